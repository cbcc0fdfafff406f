"""--fp8: the flag rules and the environment checks fail in one line, before any work; which Linear layers are
converted (the output projection stays bf16). The float8 training itself runs in tests/gpu/test_float8_gpu.py."""

import importlib.util
import re
import sys

import pytest
import torch

from fairseq import options
from fairseq.frontend.validate import validate
from fairseq.distributed.float8 import is_float8_convertible
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config

BASE = ["--task", "dummy_lm", "--arch", "transformer_lm_gpt2_tiny", "--optimizer", "adam", "--max-tokens", "64"]


def config(*flags):
    return options.convert_namespace_to_config(
        options.parse_args_and_arch(options.get_training_parser(), BASE + list(flags))
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp8"], "--fp8 needs --bf16"),
        (["--fp8", "--fp16"], "use --fp8 with --bf16, not --fp16"),
        (["--fp8-fsdp-all-gather", "--bf16"], "--fp8-fsdp-all-gather needs --fp8"),
        (
            ["--fp8", "--bf16", "--fp8-recipe", "rowwise", "--fp8-fsdp-all-gather", "--ddp-backend", "fully_sharded"],
            "--fp8-fsdp-all-gather works with --fp8-recipe tensorwise only",
        ),
        (["--fp8", "--bf16", "--fp8-fsdp-all-gather"], "--fp8-fsdp-all-gather needs --ddp-backend fully_sharded"),
    ],
)
def test_flag_rules(flags, message):
    with pytest.raises(ValueError, match=message):
        validate(config(*flags))


def test_unknown_recipe_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        config("--fp8", "--bf16", "--fp8-recipe", "blockwise")
    assert "invalid choice: 'blockwise'" in capsys.readouterr().err


def test_fp8_without_torchao_names_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # what an environment without torchao finds
    with pytest.raises(ValueError, match="--fp8 needs torchao, which is not installed: pip install torchao"):
        validate(config("--fp8", "--bf16", "--cpu"))


def test_fp8_without_torchao_through_fairseq_train_is_one_line(tiny_data, tmp_path, capsys, monkeypatch):
    from fairseq_cli import train

    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(SystemExit) as exit_info:
        train.cli_main(
            [
                str(tiny_data),
                "--arch",
                "transformer_lm_gpt2_tiny",
                "--optimizer",
                "adam",
                "--max-tokens",
                "64",
                "--tokens-per-sample",
                "64",
                "--save-dir",
                str(tmp_path),
                "--fp8",
                "--bf16",
                "--cpu",
            ]
        )
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "--fp8 needs torchao" in err[-1] and not any("Traceback" in line for line in err)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (the dev extra has it)")
def test_fp8_on_the_cpu_trains_with_float8_linears(tiny_data, tmp_path, caplog):
    """--fp8 --cpu runs torch's reference float8 matmuls (slow, for checking a configuration): the decoder
    layers' Linears are converted and the loss goes down."""
    from fairseq.logging.progress_bar import read_json_log
    from fairseq_cli import train

    train.cli_main(
        [
            str(tiny_data),
            "--arch",
            "transformer_lm_gpt",
            "--decoder-layers",
            "1",
            "--decoder-embed-dim",
            "32",
            "--decoder-ffn-embed-dim",
            "64",
            "--decoder-attention-heads",
            "2",
            "--task",
            "language_modeling",
            "--optimizer",
            "adam",
            "--lr",
            "0.003",
            "--tokens-per-sample",
            "32",
            "--batch-size",
            "4",
            "--max-update",
            "8",
            "--num-workers",
            "0",
            "--save-dir",
            str(tmp_path),
            "--no-save",
            "--disable-validation",
            "--fp8",
            "--bf16",
            "--cpu",
            "--log-format",
            "json",
            "--log-interval",
            "1",
            "--log-file",
            str(tmp_path / "log"),
        ]
    )
    assert "float8 (tensorwise): 6 Linear layers converted" in caplog.text
    assert caplog.text.count("--fp8 on the CPU runs torch's reference float8 matmuls") == 1
    losses = [float(r["loss"]) for r in read_json_log(tmp_path / "log") if "loss" in r and "num_updates" in r]
    assert len(losses) >= 8 and losses[-1] < losses[0]


def test_only_decoder_layer_linears_with_float8_sized_dims_are_converted():
    cfg = preset_config(
        "transformer_lm_gpt3_small",
        decoder_layers=1,
        decoder_embed_dim=64,
        decoder_attention_heads=4,
        decoder_ffn_embed_dim=200,
        tokens_per_sample=32,
    )
    model = TransformerLanguageModel.build(cfg, 100, 1)
    chosen = sorted(name for name, m in model.named_modules() if is_float8_convertible(m, name))
    # fc1/fc2 (64 x 200: 200 is no multiple of 16) and the output projection stay in bf16
    assert chosen == [f"decoder.layers.0.self_attn.{p}_proj" for p in ("k", "out", "q", "v")]
    assert isinstance(model.decoder.output_projection, torch.nn.Linear)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (the dev extra has it)")
def test_rowwise_on_a_cpu_without_per_row_float8_matmuls_is_one_line():
    """torch 2.11 multiplies float8 on the CPU with one scale per tensor only (scripts/test.sh runs this file on
    it): the rowwise recipes are refused there before any work; on 2.13 they run (test_tensor_parallel_compose)."""
    from fairseq.distributed.float8 import cpu_float8_matmul

    cfg = config("--fp8", "--bf16", "--fp8-recipe", "rowwise", "--cpu")
    if cpu_float8_matmul(rowwise=True):
        validate(cfg)
        return
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"--fp8-recipe rowwise on the CPU needs float8 matmuls with one "
            f"scale per row, which torch {torch.__version__} has only on CUDA"
        ),
    ):
        validate(cfg)
