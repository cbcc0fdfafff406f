"""fairseq.checkpoint_utils (upstream's loading names) on checkpoints written by the real fairseq-train: a
single file and a sharded directory (--use-sharded-state), each trained once in this module, in-process.
Weights come back bitwise as saved; arg_overrides act as upstream's; bad input is one clear error."""

import argparse
import os
import shutil

import pytest
import torch

from fairseq import checkpoint_utils
from fairseq.checkpoint.io import CheckpointError
from fairseq_cli import train


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory, train_args):
    """(checkpoint file, data directory it was trained on): the data is a copy, moved away after training, so
    the checkpoint's saved data path no longer exists (as when a model is shared)."""
    root = tmp_path_factory.mktemp("ckpt_utils")
    data = root / "data"
    shutil.copytree(tiny_data, data)
    train.cli_main(train_args(data, root / "run", max_update=4))
    moved = root / "moved-data"
    os.rename(data, moved)
    return root / "run" / "checkpoint_last.pt", moved


@pytest.fixture(scope="module")
def sharded_dir(tiny_data, tmp_path_factory, build_train_args):
    """(sharded checkpoint directory written by fairseq-train --use-sharded-state, DCP's own reading of it)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    save_dir = tmp_path_factory.mktemp("ckpt_utils_sharded")
    try:
        train.cli_main(
            build_train_args(
                tiny_data,
                save_dir,
                "--disable-validation",
                "--ddp-backend",
                "fully_sharded",
                "--use-sharded-state",
                max_update=2,
                json_log=False,
                log_file=False,
            )
        )
    finally:  # one process: fairseq-train made a one-rank process group for FSDP2; leave none behind
        if dist.is_initialized():
            dist.destroy_process_group()
    path = save_dir / "checkpoint_last"
    reference = save_dir / "reference.pt"
    dcp_to_torch_save(str(path), str(reference))  # written by us just now: trusted
    return path, torch.load(reference, map_location="cpu", weights_only=True)["model"]


def assert_state_equal(model_state, expected):
    assert set(model_state) == set(expected)
    for key, value in expected.items():
        assert torch.equal(model_state[key], value), key


def test_load_model_ensemble_and_task_with_data_override(trained):
    ckpt, data = trained
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(ckpt)], arg_overrides={"data": str(data)})
    (model,) = models
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert_state_equal(model.state_dict(), saved["model"])
    assert cfg.task.data == task.cfg.data == str(data)
    assert cfg.model.decoder_layers == saved["cfg"]["model"]["decoder_layers"] == 2
    assert cfg.generation.beam == 5 and cfg.interactive.input == "-"  # upstream's defaults for the hub
    assert len(task.source_dictionary) == saved["model"]["decoder.embed_tokens.weight"].shape[0]
    # without the override the task looks for the training data where it was
    with pytest.raises(FileNotFoundError, match="dict.txt"):
        checkpoint_utils.load_model_ensemble([str(ckpt)])


def test_ensemble_shares_one_task_and_model_overrides_reach_the_model(trained):
    ckpt, data = trained
    models, cfg = checkpoint_utils.load_model_ensemble([str(ckpt), str(ckpt)], arg_overrides={"data": str(data)})
    assert len(models) == 2 and models[0] is not models[1]
    # a model option: the model built from it no longer fits the saved weights
    with pytest.raises(CheckpointError, match="different architecture .*decoder.layers.2"):
        checkpoint_utils.load_model_ensemble([str(ckpt)], arg_overrides={"data": str(data), "decoder_layers": 3})
    # strict=False (upstream's): the matching parameters load, the extra layer keeps its initialization
    (model,), _ = checkpoint_utils.load_model_ensemble(
        [str(ckpt)], arg_overrides={"data": str(data), "decoder_layers": 3}, strict=False
    )
    assert len(model.decoder.layers) == 3
    assert torch.equal(model.decoder.layers[1].fc1.weight, models[0].decoder.layers[1].fc1.weight)


def test_load_checkpoint_to_cpu_layout_and_overrides(trained):
    ckpt, data = trained
    state = checkpoint_utils.load_checkpoint_to_cpu(
        str(ckpt), arg_overrides={"data": str(data), "bpe": "sentencepiece", "sentencepiece_model": "spm.model"}
    )
    assert {"cfg", "model", "extra_state", "optimizer_history", "last_optimizer_state"} <= set(state)
    assert state["cfg"]["task"]["data"] == str(data)
    assert state["cfg"]["bpe"] == {"_name": "sentencepiece", "sentencepiece_model": "spm.model"}
    assert state["cfg"]["model"]["decoder_layers"] == 2  # untouched groups keep the saved values
    # the loaded state goes back in without reading the file again
    (model,), cfg = checkpoint_utils.load_model_ensemble([str(ckpt)], state=state)
    assert cfg.bpe.sentencepiece_model == "spm.model"
    assert_state_equal(model.state_dict(), state["model"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dataa": "x"}, "override 'dataa' is no option"),
        ({"bpe": "gpt2", "sentencepiece_model": "x"}, "override 'sentencepiece_model'"),  # not a gpt2 option
    ],
)
def test_unknown_override_is_an_error(trained, overrides, message):
    ckpt, _ = trained
    with pytest.raises(ValueError, match=message):
        checkpoint_utils.load_checkpoint_to_cpu(str(ckpt), arg_overrides=overrides)


def test_bad_paths_and_arguments(trained, tmp_path):
    ckpt, data = trained
    with pytest.raises(FileNotFoundError, match="Model file not found: .*checkpoint_last-x.pt"):
        checkpoint_utils.load_model_ensemble([str(ckpt)], suffix="-x")
    with pytest.raises(ValueError, match="num_shards=2.*one directory"):
        checkpoint_utils.load_model_ensemble([str(ckpt)], num_shards=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete sharded checkpoint"):
        checkpoint_utils.load_model_ensemble([str(tmp_path / "empty")])


def test_an_architecture_not_registered_here(trained, tmp_path):
    ckpt, data = trained
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    state["cfg"]["model"]["_name"] = "transformer_iwslt_de_en"  # a translation model of upstream's
    other = tmp_path / "translation.pt"
    torch.save(state, other)
    with pytest.raises(
        CheckpointError, match="architecture 'transformer_iwslt_de_en', which is not registered here .*--user-dir"
    ):
        checkpoint_utils.load_model_ensemble([str(other)], arg_overrides={"data": str(data)})


def test_pickled_upstream_file_needs_trust(trained, tmp_path):
    ckpt, data = trained
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    legacy = tmp_path / "upstream.pt"
    args = argparse.Namespace(**saved["cfg"]["model"], arch="transformer_lm", task="language_modeling", data=str(data))
    torch.save({"args": args, "model": saved["model"]}, legacy)  # upstream < 0.10: a pickled Namespace
    with pytest.raises(CheckpointError, match="--trust-legacy-checkpoint"):
        checkpoint_utils.load_model_ensemble([str(legacy)])
    (model,), cfg = checkpoint_utils.load_model_ensemble([str(legacy)], trust_legacy_checkpoint=True)
    assert_state_equal(model.state_dict(), saved["model"])


def test_sharded_directory_loads_as_dcp_reads_it(sharded_dir, tiny_data):
    path, reference = sharded_dir
    (model,), cfg = checkpoint_utils.load_model_ensemble([str(path)])
    assert cfg.model._name == "transformer_lm"
    assert_state_equal(model.state_dict(), reference)
    state = checkpoint_utils.load_checkpoint_to_cpu(str(path))  # full tensors allocated from the index
    assert_state_equal(state["model"], reference)
    assert state["cfg"]["task"]["data"] == str(tiny_data)
    (again,), _ = checkpoint_utils.load_model_ensemble([str(path)], state=state)
    assert_state_equal(again.state_dict(), reference)
