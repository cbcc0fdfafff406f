"""--quantize int8-weight-only and the generation options checked before any model work, through the real entry
points (fairseq-generate, fairseq-interactive, fairseq-train) and the hub on the session's tiny checkpoint: each
refusal is one line naming the flag (or keyword) and the fix. The quantized decoding itself needs CUDA:
tests/gpu/test_quantize_gpu.py."""

import io
import os
import sys

import pytest
import torch

from fairseq.models.transformer_lm import TransformerLanguageModel
from fairseq_cli import generate, interactive, train
from tests.train_fixtures import console_in_process

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread

CPU_ERROR = (
    "--quantize int8-weight-only is a CUDA decoding feature (int8 weights save GPU memory bandwidth; on "
    "the CPU they are only slower): run on a GPU (drop --cpu) or drop --quantize"
)


def generate_argv(tiny_data, ckpt, *extra):
    return [
        str(tiny_data),
        "--task",
        "language_modeling",
        "--path",
        str(ckpt),
        "--cpu",
        "--gen-subset",
        "test",
        "--tokens-per-sample",
        "32",
        "--sample-break-mode",
        "eos",
        "--batch-size",
        "40",
        "--num-workers",
        "0",
        "--prefix-size",
        "2",
        "--beam",
        "1",
        "--max-len-b",
        "4",
        *map(str, extra),
    ]


def interactive_argv(tiny_data, ckpt, *extra):
    return [
        str(tiny_data),
        "--task",
        "language_modeling",
        "--path",
        str(ckpt),
        "--cpu",
        "--num-workers",
        "0",
        *map(str, extra),
    ]


def error_line(name, main, argv, monkeypatch, stdin_text="w1 w2\n"):
    """(exit status, the one stderr line's message) of `name ARGV`; fails unless stderr is that one line."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin_text))
    status, _, err = console_in_process(name, main, argv)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return status, lines[0].split(": error: ", 1)[1]


@pytest.mark.parametrize(
    "name, main, make_argv",
    [
        ("fairseq-generate", generate.cli_main, generate_argv),
        ("fairseq-interactive", interactive.cli_main, interactive_argv),
    ],
)
def test_quantize_on_the_cpu_is_one_line(  # --cpu: the same on a machine with CUDA
    tiny_data, tiny_lm_checkpoint, monkeypatch, name, main, make_argv
):
    argv = make_argv(tiny_data, tiny_lm_checkpoint, "--quantize", "int8-weight-only", "--bf16")
    assert error_line(name, main, argv, monkeypatch) == (1, CPU_ERROR)


def test_quantize_is_a_choice_listed_in_help(tiny_data, tiny_lm_checkpoint, monkeypatch):
    status, message = error_line(
        "fairseq-generate",
        generate.cli_main,
        generate_argv(tiny_data, tiny_lm_checkpoint, "--quantize", "int8"),
        monkeypatch,
    )
    assert status == 2 and message == (
        "argument --quantize: invalid choice: 'int8'; choose from 'none', 'int8-weight-only'"
    )
    for name, main in (("fairseq-generate", generate.cli_main), ("fairseq-interactive", interactive.cli_main)):
        status, out, _ = console_in_process(name, main, ["--help"])
        text = " ".join(out.split())
        assert status == 0 and "--quantize {none,int8-weight-only} int8-weight-only: the Linear weights in int8" in text
        assert "a fused int8 matmul) after the model is loaded" in text and "needs CUDA and --bf16" in text


def test_quantize_given_to_training_is_one_line(tmp_path, tiny_data):
    status, _, err = console_in_process(
        "fairseq-train", train.cli_main, [str(tiny_data), "--arch", "transformer_lm", "--quantize", "int8-weight-only"]
    )
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert err.strip().split(": error: ", 1)[1] == (
        "unrecognized arguments: --quantize int8-weight-only (--quantize is a generation option: fairseq-generate, "
        "fairseq-interactive and the hub quantize a trained model's weights when they load it for generation; this "
        "command does not: drop it)"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--temperature", 0],
            "--temperature 0.0 is out of range: the logits are divided by it, so it must be greater "
            "than 0 (1: the model's distribution; below 1 sharper, above 1 flatter)",
        ),
        (["--temperature", -0.5, "--sampling"], "--temperature -0.5 is out of range"),
        (
            ["--sampling", "--sampling-topp", 0],
            "--sampling-topp 0.0 is out of range: -1 (off: all tokens) or a probability mass in (0, 1]",
        ),
        (["--sampling", "--sampling-topp", 1.01], "--sampling-topp 1.01 is out of range"),
        # NaN and infinity: refused, not decoded into empty output or `nan` scores
        (["--temperature", "nan"], "--temperature nan is out of range: a finite number greater than 0"),
        (["--beam", 2, "--temperature", "inf"], "--temperature inf is out of range: a finite number greater than 0"),
        (["--unkpen", "nan"], "--unkpen nan is out of range: a finite number (subtracted from <unk>'s log probability"),
        (["--lenpen", "nan"], "--lenpen nan is out of range: a finite number (the score is divided by length**lenpen"),
        (
            ["--max-len-a", "nan"],
            "--max-len-a nan is out of range: a finite number (outputs have at most a * input length + b tokens)",
        ),
        (["--max-len-a", "inf"], "--max-len-a inf is out of range: a finite number"),
        (["--beam", 0], "--beam 0 is out of range: an integer, at least 1 (1: greedy decoding)"),
        # below 1/ln(largest float32) every token but the likeliest has probability 0 (was decoded, scores of -8e9)
        (
            ["--sampling", "--temperature", "1e-9"],
            "--temperature 1e-09 is below 0.0113 (1/ln of 3.403e+38, the largest float32, which the probabilities are "
            "computed in): divided by it, logits one apart give probabilities whose ratio no float32 holds, so every token "
            "but the likeliest gets probability 0 (scores near -1e9); pass at least 0.0113, or --beam 1 without "
            "--sampling for greedy decoding",
        ),
        (["--temperature", "0.01"], "--temperature 0.01 is below 0.0113"),
        # its own message (was --min-len's: "--min-len 1 is larger than the longest output allowed, -5 tokens")
        (
            ["--max-len-b", -5],
            "--max-len-b -5 is out of range: outputs have at most --max-len-a * input length + "
            "--max-len-b tokens (the prompt included), below 0 with --max-len-a 0; give --max-len-b 0 "
            "or more",
        ),
    ],
)
def test_sampling_options_out_of_range_are_usage_errors(tiny_data, tiny_lm_checkpoint, monkeypatch, extra, message):
    """Refused by the parser's check (status 2) before a checkpoint is read: the --path here does not exist."""
    for name, main, make_argv in (
        ("fairseq-generate", generate.cli_main, generate_argv),
        ("fairseq-interactive", interactive.cli_main, interactive_argv),
    ):
        status, got = error_line(name, main, make_argv(tiny_data, "no-such.pt", *extra), monkeypatch)
        assert status == 2 and got.startswith(message), got


@pytest.fixture(scope="module")
def hub(tiny_data, tiny_lm_checkpoint):
    return TransformerLanguageModel.from_pretrained(
        os.path.dirname(tiny_lm_checkpoint), "checkpoint_last.pt", data_name_or_path=str(tiny_data)
    )


def test_hub_sampling_options_out_of_range(hub):
    with pytest.raises(ValueError, match=r"^temperature=0 is out of range: the logits are divided by it"):
        hub.sample("w1 w2", temperature=0)
    with pytest.raises(ValueError, match=r"^sampling_topp=1.5 is out of range"):
        hub.sample("w1 w2", sampling=True, sampling_topp=1.5)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            dict(sampling=True, sampling_topk=2.5),
            "sampling_topk=2.5 must be an integer: -1 (off: all tokens) or a number of tokens, at least 1",
        ),
        (dict(sampling=True, sampling_topk="5"), "sampling_topk='5' must be an integer: -1 (off: all tokens)"),
        (dict(beam=2.5), "beam=2.5 must be an integer, at least 1 (1: greedy decoding)"),
        (dict(beam=0), "beam=0 is out of range: an integer, at least 1"),
        (
            dict(sampling=True, temperature=float("nan")),
            "temperature=nan is out of range: a finite number greater than 0",
        ),
        (
            dict(unkpen=float("nan")),
            "unkpen=nan is out of range: a finite number (subtracted from <unk>'s log probability; 0: none)",
        ),
        (dict(lenpen=float("inf")), "lenpen=inf is out of range: a finite number"),
        (dict(max_len_b="7"), "max_len_b='7' must be an integer"),
        (dict(max_len_a=float("nan")), "max_len_a=nan is out of range: a finite number"),
    ],
)
def test_hub_options_of_the_wrong_type_or_not_finite(hub, options, message):
    """One ValueError naming the keyword, its value and what is allowed, before any decoding (not a TypeError
    from torch, an IndexError, or `nan` scores)."""
    with pytest.raises(ValueError) as error:
        hub.sample("w1 w2", **options)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_hub_quantize_keyword(tiny_data, tiny_lm_checkpoint, hub):
    lm = TransformerLanguageModel.from_pretrained(
        os.path.dirname(tiny_lm_checkpoint),
        "checkpoint_last.pt",
        data_name_or_path=str(tiny_data),
        quantize="int8-weight-only",
    )
    assert lm.cfg.generation.quantize == "int8-weight-only" and lm.quantized == "none"  # applied when generating
    lm.to(torch.bfloat16)
    with pytest.raises(ValueError) as error:
        lm.sample("w1 w2", beam=1)
    assert str(error.value) == (
        "quantize='int8-weight-only' is a CUDA decoding feature (int8 weights save GPU memory bandwidth; on the CPU "
        "they are only slower): move the model to a GPU before generating (lm.cuda()) or drop quantize="
    )
    with pytest.raises(
        ValueError,
        match=r"^quantize='int4' is no quantization mode: choose one of none, "
        r"int8-weight-only$",
    ):
        hub.quantize("int4")
    with pytest.raises(ValueError, match=r"^quantize='int8' is no quantization mode"):  # refused when loading
        TransformerLanguageModel.from_pretrained(
            os.path.dirname(tiny_lm_checkpoint), "checkpoint_last.pt", data_name_or_path=str(tiny_data), quantize="int8"
        )
    with pytest.raises(
        ValueError,
        match=r"^generate\(\): quantize='int8-weight-only' applies to the models, not to "
        r"one call: pass it to from_pretrained or call "
        r"lm.quantize\('int8-weight-only'\) once$",
    ):
        hub.sample("w1 w2", quantize="int8-weight-only")
    assert hub.quantize("none") is hub and hub.quantized == "none"
    assert hub.sample("w1 w2", beam=1, max_len_b=4).startswith("w1 w2")  # unquantized: generates as before


def test_quantize_in_a_training_yaml_is_one_line():
    """fairseq-hydra-train has no generation group: a config that sets one is refused, naming the key."""
    from fairseq.frontend.hydra import fairseq_config_from_dict

    with pytest.raises(ValueError) as error:
        fairseq_config_from_dict(
            {
                "generation": {"quantize": "int8-weight-only"},
                "task": {"_name": "language_modeling"},
                "model": {"_name": "transformer_lm"},
                "optimizer": {"_name": "adam"},
            }
        )
    assert str(error.value) == (
        "'generation' is set to {'quantize': 'int8-weight-only'}, but fairseq-hydra-train here "
        "has no generation options (language-model training does not use them): remove "
        "'generation' or set it to null"
    )
