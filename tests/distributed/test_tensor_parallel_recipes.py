"""The tensor-parallel large-LM recipes (examples/large_lm/config/66b_tp8.yaml, 175b_tp8.yaml) through
fairseq-hydra-train on 4 CPU processes (gloo), TP 2 x FSDP 2, scaled down by overrides: 2 layers, a width that
fits 2 cores (the real 9216 and 12288 do not; the recipe's head count is kept, 4 dimensions each), 32-token
samples of the tiny corpus, 3 updates, no validation; every other setting is the recipe's (each layer compiled,
activation checkpointing, the vocabulary-parallel loss, the FSDP flags, sharded checkpoints, batch size). bf16
and float8 are GPU features: off here. About 30 s per recipe, half of it compiling.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fairseq.logging.progress_bar import read_json_log

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "examples" / "large_lm" / "config"

# recipe -> (width, ffn): the recipe's heads (72, 96) of 4 dimensions each
SCALED = {"66b_tp8": (288, 1152), "175b_tp8": (384, 1536)}
UPDATES = 3
CPU = ["common.cpu=true", "common.bf16=false", "common.fp8=false", "common.fp8_fsdp_all_gather=false"]


def hydra_train(recipe, data, out):
    width, ffn = SCALED[recipe]
    overrides = [
        f"task.data={data}",
        "task.tokens_per_sample=32",
        "model.decoder_layers=2",
        f"model.decoder_embed_dim={width}",
        f"model.decoder_ffn_embed_dim={ffn}",
        "distributed_training.distributed_world_size=4",
        "distributed_training.model_parallel_size=2",
        "dataset.num_workers=0",
        "dataset.disable_validation=true",
        f"optimization.max_update={UPDATES}",
        "lr_scheduler.warmup_updates=1",
        f"lr_scheduler.total_num_update={UPDATES}",
        "common.log_interval=1",
        "common.log_format=json",
        f"common.log_file={out / 'train.log'}",
        f"checkpoint.save_dir={out / 'checkpoints'}",
        f"hydra.run.dir={out / 'run'}",
        *CPU,
    ]
    command = [
        sys.executable,
        "-m",
        "fairseq_cli.hydra_train",
        "--config-dir",
        str(CONFIG_DIR),
        "--config-name",
        recipe,
        *overrides,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.parametrize("recipe", list(SCALED))
def test_tensor_parallel_recipe_trains_scaled_down(recipe, tiny_data, tmp_path):
    from fairseq.checkpoint import sharded
    from fairseq.checkpoint.consolidate import read_full_state

    proc = hydra_train(recipe, tiny_data, tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    log = proc.stdout + proc.stderr
    assert "device mesh: TP 2 x FSDP 2 (dp_shard 2 x tp 2)" in log
    used = yaml.safe_load((tmp_path / "run" / ".hydra" / "fairseq_config.yaml").read_text())
    assert used["model"]["checkpoint_activations"] and used["distributed_training"]["compile"]
    assert used["model"]["activation_fn"] == "relu"
    assert used["dataset"]["batch_size"] == {"66b_tp8": 16, "175b_tp8": 8}[recipe]  # the recipe's
    dt = used["distributed_training"]
    assert dt["fsdp_forward_prefetch"] and dt["fsdp_sync_free"] and dt["use_sharded_state"]
    assert "VocabParallelCrossEntropyCriterion" in log
    rows = read_json_log(tmp_path / "train.log")
    assert [int(row["num_updates"]) for row in rows] == list(range(1, UPDATES + 1))
    losses = [float(row["loss"]) for row in rows]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]

    checkpoint = tmp_path / "checkpoints" / "checkpoint_last"  # a DCP directory (use_sharded_state)
    assert sharded._saved_layout(sharded.read_metadata(str(checkpoint))) == "4 rank(s) (TP 2 x FSDP 2)"
    model = read_full_state(str(checkpoint), keys=["model"])["model"]
    width, ffn = SCALED[recipe]
    assert model["decoder.layers.1.fc1.weight"].shape == (ffn, width)  # whole, gathered from the 4 shards
    assert all(torch.isfinite(tensor).all() for tensor in model.values() if tensor.is_floating_point())
