"""Upstream fairseq checkpoints (pickled DictConfig or argparse Namespace, upstream weight names and optimizer
layout), written by hand from a model of ours: evaluation, --finetune-from-model and --restore-file."""

import argparse

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from fairseq import options
from fairseq.checkpoint.io import CheckpointError, load_checkpoint_file
from fairseq.checkpoint.legacy import is_legacy_checkpoint, upgrade_legacy_checkpoint
from fairseq.logging.progress_bar import read_json_log
from fairseq_cli import eval_lm, train


@pytest.fixture(scope="module")
def train_argv(build_train_args):
    """This file's runs: the tiny transformer_lm at --lr 1e-3, --seed 5, 3 updates by default."""

    def argv(data, save_dir, *extra, max_update=3):
        return build_train_args(data, save_dir, *extra, max_update=max_update, lr="1e-3", seed="5")

    return argv


def eval_cfg(data, path, *extra):
    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(
        parser,
        [
            str(data),
            "--path",
            str(path),
            "--gen-subset",
            "test",
            "--tokens-per-sample",
            "32",
            "--batch-size",
            "4",
            "--cpu",
            *extra,
        ],
    )
    return options.convert_namespace_to_config(args)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


# ----------------------------------------------------------------------------- building upstream files


def upstream_weights(ours, fuse_qkv, drop_output_projection):
    """Our state dict under upstream names: fused `in_proj_*` (rows q, k, v) as fairseq < 0.9 stored them,
    and, for shared embeddings, no output matrix (older files keep only the embedding)."""
    out = {}
    for key, value in ours.items():
        if fuse_qkv and (".self_attn.k_proj." in key or ".self_attn.v_proj." in key):
            continue
        if fuse_qkv and ".self_attn.q_proj." in key:
            prefix, kind = key.split(".self_attn.q_proj.")
            parts = [ours[f"{prefix}.self_attn.{p}_proj.{kind}"] for p in ("q", "k", "v")]
            out[f"{prefix}.self_attn.in_proj_{kind}"] = torch.cat(parts, dim=0).clone()
            continue
        if drop_output_projection and key == "decoder.output_projection.weight":
            continue
        out[key] = value.clone()
    assert "decoder.version" in out
    return out


def upstream_optimizer_state(ours):
    """torch.optim's own layout, as upstream saves it: state and params indexed by ints."""
    names = ours["param_groups"][0]["params"]
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: dict(s) for name, s in ours["state"].items()},
        "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in ours["param_groups"]],
    }


def common_upstream_keys(ours):
    return {
        "criterion": None,
        "optimizer_history": [
            {
                "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": "FairseqAdam",
                "lr_scheduler_state": {"best": None},
                "num_updates": 3,
            }
        ],
        "task_state": {},
        "extra_state": {
            "epoch": 1,
            "train_iterator": {"epoch": 1, "iterations_in_epoch": 3, "shuffle": True},
            "val_loss": 6.0,
            "best": 6.0,
            "previous_training_time": 1.0,
            "metrics": {"train": []},
        },
        "last_optimizer_state": upstream_optimizer_state(ours["last_optimizer_state"]),
    }


def write_cfg_checkpoint(ours, path):
    """fairseq >= 0.10: an omegaconf DictConfig under "cfg", separate q/k/v (as modern upstream saves)."""
    cfg = {k: v for k, v in ours["cfg"].items() if isinstance(v, dict)}
    cfg["model"] = dict(ours["cfg"]["model"], _name="transformer_lm")
    cfg["task"] = dict(ours["cfg"]["task"], _name="language_modeling")
    state = dict(
        common_upstream_keys(ours),
        args=None,
        cfg=OmegaConf.create(cfg),
        model=upstream_weights(ours["model"], fuse_qkv=False, drop_output_projection=False),
    )
    assert isinstance(state["cfg"], DictConfig)
    torch.save(state, path)


def write_args_checkpoint(ours, path):
    """fairseq < 0.10: one flat argparse Namespace under "args", fused q/k/v, no separate output matrix."""
    flat = {}
    for group in ("common", "dataset", "optimization", "checkpoint", "task", "model"):
        flat.update({k: v for k, v in ours["cfg"][group].items() if k != "_name"})
    flat.update(arch="transformer_lm", task="language_modeling", criterion="cross_entropy", optimizer="adam")
    state = dict(
        common_upstream_keys(ours),
        args=argparse.Namespace(**flat),
        model=upstream_weights(ours["model"], fuse_qkv=True, drop_output_projection=True),
    )
    torch.save(state, path)


@pytest.fixture(scope="module")
def files(tiny_data, tmp_path_factory, train_argv):
    root = tmp_path_factory.mktemp("legacy")
    save = root / "ours"
    save.mkdir()
    train.cli_main(train_argv(tiny_data, save))
    ours_path = save / "checkpoint_last.pt"
    ours = load(ours_path)
    write_cfg_checkpoint(ours, root / "upstream_cfg.pt")
    write_args_checkpoint(ours, root / "upstream_args.pt")
    return {"root": root, "ours": ours_path, "cfg": root / "upstream_cfg.pt", "args": root / "upstream_args.pt"}


KINDS = ["cfg", "args"]


# ----------------------------------------------------------------------------- the files themselves


@pytest.mark.parametrize("kind", KINDS)
def test_files_are_upstream_shaped(files, kind):
    with pytest.raises(Exception):
        load(files[kind])  # pickled objects: weights_only refuses
    raw = torch.load(files[kind], map_location="cpu", weights_only=False)
    assert is_legacy_checkpoint(raw)
    assert sorted(raw["last_optimizer_state"]["state"]) == list(range(len(raw["last_optimizer_state"]["state"])))
    if kind == "args":
        assert "decoder.layers.0.self_attn.in_proj_weight" in raw["model"]
        assert raw["model"]["decoder.layers.1.self_attn.in_proj_bias"].shape == (96,)
        assert "decoder.output_projection.weight" not in raw["model"]


@pytest.mark.parametrize("kind", KINDS)
def test_upgrade_gives_back_our_weights_exactly(files, kind):
    ours = load(files["ours"])["model"]
    state = upgrade_legacy_checkpoint(load_checkpoint_file(str(files[kind]), trust_legacy=True))
    assert state["model"].keys() == ours.keys()
    for key in ours:
        assert torch.equal(state["model"][key], ours[key]), key
    assert state["cfg"]["model"]["_name"] == "transformer_lm"
    assert state["cfg"]["model"]["decoder_layers"] == 2
    assert state["cfg"]["task"]["_name"] == "language_modeling"
    assert state["last_optimizer_state"] is None  # upstream's optimizer layout is not mapped


# ----------------------------------------------------------------------------- fairseq-eval-lm


@pytest.fixture(scope="module")
def reference_eval(files, tiny_data):
    return eval_lm.main(eval_cfg(tiny_data, files["ours"]))


@pytest.mark.parametrize("kind", KINDS)
def test_eval_lm_needs_trust_legacy_checkpoint(files, tiny_data, kind):
    with pytest.raises(CheckpointError, match="--trust-legacy-checkpoint"):
        eval_lm.main(eval_cfg(tiny_data, files[kind]))


@pytest.mark.parametrize("kind", KINDS)
def test_eval_lm_of_upstream_file_matches_ours_exactly(files, tiny_data, reference_eval, kind):
    result = eval_lm.main(eval_cfg(tiny_data, files[kind], "--trust-legacy-checkpoint"))
    assert reference_eval["tokens"] > 0
    assert result == reference_eval  # same tokens, bit-identical loss and perplexity


# ----------------------------------------------------------------------------- fairseq-train


@pytest.fixture(scope="module")
def finetuned_from_ours(files, tiny_data, train_argv):
    save = files["root"] / "ft_ours"
    save.mkdir()
    train.cli_main(train_argv(tiny_data, save, "--finetune-from-model", str(files["ours"]), max_update=2))
    return save


def test_finetune_from_upstream_file_starts_from_its_weights(
    files, tiny_data, tmp_path, finetuned_from_ours, train_argv
):
    save = tmp_path / "ft_legacy"
    save.mkdir()
    train.cli_main(
        train_argv(
            tiny_data, save, "--finetune-from-model", str(files["args"]), "--trust-legacy-checkpoint", max_update=2
        )
    )
    log = (save / "train.log").read_text()
    assert f"loaded model weights from {files['args']}" in log
    # the same run as fine-tuning from our own file: identical losses and identical weights after 2 updates
    rows_legacy, rows_ours = read_json_log(save / "train.log"), read_json_log(finetuned_from_ours / "train.log")
    assert [r["loss"] for r in rows_legacy] == [r["loss"] for r in rows_ours]
    assert len(rows_legacy) == 2
    a, b = load(save / "checkpoint_last.pt"), load(finetuned_from_ours / "checkpoint_last.pt")
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    # and not the same as starting from scratch with the same seed
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    train.cli_main(train_argv(tiny_data, scratch, max_update=1))
    assert read_json_log(scratch / "train.log")[0]["loss"] != rows_legacy[0]["loss"]
    assert float(rows_legacy[0]["loss"]) < float(read_json_log(scratch / "train.log")[0]["loss"])


def test_finetune_from_upstream_file_needs_trust(files, tiny_data, tmp_path, train_argv):
    with pytest.raises(CheckpointError, match="--trust-legacy-checkpoint"):
        train.cli_main(train_argv(tiny_data, tmp_path, "--finetune-from-model", str(files["cfg"]), max_update=1))
    assert not (tmp_path / "checkpoint_last.pt").exists()


def test_resume_from_upstream_file_needs_reset_optimizer(files, tiny_data, tmp_path, train_argv):
    with pytest.raises(CheckpointError, match="--reset-optimizer"):
        train.cli_main(
            train_argv(
                tiny_data, tmp_path, "--restore-file", str(files["cfg"]), "--trust-legacy-checkpoint", max_update=4
            )
        )
    assert not (tmp_path / "checkpoint_last.pt").exists()


def test_resume_from_upstream_file_with_reset_optimizer_saves_a_plain_checkpoint(
    files, tiny_data, tmp_path, train_argv
):
    train.cli_main(
        train_argv(
            tiny_data,
            tmp_path,
            "--restore-file",
            str(files["cfg"]),
            "--trust-legacy-checkpoint",
            "--reset-optimizer",
            max_update=1,
        )
    )
    assert f"loading checkpoint {files['cfg']}" in (tmp_path / "train.log").read_text()
    state = load(tmp_path / "checkpoint_last.pt")  # weights_only: nothing pickled is carried over
    assert isinstance(state["cfg"], dict)
    assert state["extra_state"]["trainer"]["num_updates"] == 1
    assert state["model"].keys() == load(files["ours"])["model"].keys()
