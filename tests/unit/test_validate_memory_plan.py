"""scripts/validate_memory_plan.py without a GPU: the planner's inputs from a composed recipe are those of the
equivalent command line, the run it would start, and how it reads a training log (the GPU run itself is the
lead's: its command is the script's default)."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from fairseq.frontend.hydra import compose_dict, fairseq_config_from_dict, split_recipe
from fairseq.planning import memory_model as mm
from fairseq.planning import plan_memory
from fairseq.planning.request import inputs_from_config

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "examples" / "large_lm" / "config"


def load_script():
    spec = importlib.util.spec_from_file_location("validate_memory_plan", REPO / "scripts" / "validate_memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "recipe, arch, gpus, batch",
    [("175b_tp8", "transformer_lm_gpt3_175", 1024, 8), ("66b_tp8", "transformer_lm_gpt3_66", 512, 16)],
)
def test_a_recipe_plans_as_its_command_line(recipe, arch, gpus, batch):
    values, _ = split_recipe(compose_dict(str(CONFIG_DIR), recipe, ["task.data=/data"]))
    shape, setup = inputs_from_config(fairseq_config_from_dict(values), gpus=gpus, environ={})
    request = plan_memory.parse(
        [
            "--arch",
            arch,
            "--gpus",
            str(gpus),
            "--activation-fn",
            "relu",
            "--dropout",
            "0.1",
            "--no-scale-embedding",
            "--checkpoint-activations",
            "--batch-size",
            str(batch),
            "--model-parallel-size",
            "8",
            "--bf16",
            "--fp8",
            "--fp8-fsdp-all-gather",
            "--compile",
            "--fsdp-forward-prefetch",
            "--fsdp-sync-free",
        ]
    )
    assert (shape, setup) == (request.shape, request.setup)
    # FAIRSEQ_TP_MESH_OF_ONE applies only where the tensor-parallel size is 1
    assert not inputs_from_config(fairseq_config_from_dict(values), gpus, environ={"FAIRSEQ_TP_MESH_OF_ONE": "1"})[
        1
    ].tp_plan_on_one_rank


def test_dry_run_prints_the_one_gpu_command_and_the_prediction(capsys, tmp_path):
    script = load_script()
    assert script.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    command = out.splitlines()[0]
    assert command.startswith("command: FAIRSEQ_TP_MESH_OF_ONE=1 ")
    for override in (
        "--config-name 175b_tp8",
        "model.decoder_layers=2",
        "distributed_training.model_parallel_size=1",
        "task._name=dummy_lm",
        "task.dict_size=50268",
        f"common.log_file={tmp_path / 'train.log'}",
        "dataset.disable_validation=true",
    ):  # dummy_lm's valid split: 100,000 samples
        assert override in command
    values, _ = split_recipe(
        compose_dict(
            str(CONFIG_DIR),
            "175b_tp8",
            [
                "task._name=dummy_lm",
                "task.dict_size=50268",
                "model.decoder_layers=2",
                "distributed_training.model_parallel_size=1",
            ],
        )
    )
    shape, setup = inputs_from_config(
        fairseq_config_from_dict(values), 1, 50272, environ={"FAIRSEQ_TP_MESH_OF_ONE": "1"}
    )
    assert setup.tp_plan_on_one_rank and setup.batch_size == 8 and setup.float8_all_gather and setup.compiled
    predicted = mm.plan(shape, setup)
    assert f"predicted peak allocated: {mm.gib(predicted.peak_bytes):.2f} GiB (not run)" in out
    plain = mm.plan(shape, dataclasses.replace(setup, tp_plan_on_one_rank=False))
    assert plain.peak_bytes != predicted.peak_bytes  # the TP code path is what is predicted


def test_reads_the_peaks_of_a_training_log(tmp_path, capsys):
    rows = [(1, 60.1, 66.0, 0), (2, 75.9, 82.5, 0), (3, 75.4, 82.4, 1)]
    log = tmp_path / "train.log"
    log.write_text(
        "".join(
            f'2026-12-05 10:00:0{n} | INFO | train_inner | {{"num_updates": "{n}", "loss": "9.1", '
            f'"max_cuda_gb_allocated": "{a}", "max_cuda_gb_reserved": "{r}", "cuda_alloc_retries": "{k}"}}\n'
            for n, a, r, k in rows
        )
    )
    script = load_script()
    assert script.measured(log) == (75.9, 82.5, 1.0, 3)
    assert script.main(["--log", str(log), "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    peak = next(line for line in table if line.startswith("peak allocated GiB")).split()
    predicted = float(peak[3])
    assert peak[4] == "75.90" and peak[5] == f"{(predicted - 75.9) / 75.9:+.1%}"
    assert "over 3 logged updates; allocator retries: 1" in table
