"""Upstream's language-model test flow, as its tests/utils.py and test_binaries.py drive it, on this fork: text
made like upstream's create_dummy_data, fairseq-preprocess from `get_preprocessing_parser().parse_args`, training
through `convert_namespace_to_omegaconf` and `distributed_utils.call_main(cfg, train.main)`, then
`validate.main`, `eval_lm.main`, `generate.main` and `interactive.main` each called with the argparse Namespace of
`parse_args_and_arch` (interactive with the generation namespace, --buffer-size and --input set on it, prompts
on stdin). Smaller models than upstream's defaults (upstream's flags otherwise), for the CPU suite's time.

What this fork does differently on that flow, each said in one line: eval-lm without --tokens-per-sample reads
blocks of the model's trained length (upstream reads 1024 and skips the blocks longer than the model); a
prompt longer than --max-len-b is cut there with a warning (upstream cuts it silently)."""

import io
import os
import random
import sys

import pytest
import torch

import fairseq.distributed.utils as distributed_utils
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq_cli import eval_lm, generate, interactive, preprocess, train, validate

SMALL = [
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-attention-heads",
    "4",
]
LM_GENERATION = ["--task", "language_modeling", "--sample-break-mode", "eos", "--tokens-per-sample", "500"]


def create_dummy_data(data_dir, num_examples=100, maxlen=20):
    """Lines of 1..maxlen random letters (upstream's test data), train/valid/test."""
    rng = random.Random(0)
    for name in ("train.out", "valid.out", "test.out"):
        with open(os.path.join(data_dir, name), "w") as f:
            for _ in range(num_examples):
                print(" ".join(chr(97 + rng.randrange(26)) for _ in range(rng.randint(1, maxlen))), file=f)


def preprocess_lm_data(data_dir):
    args = options.get_preprocessing_parser().parse_args(
        [
            "--only-source",
            "--trainpref",
            os.path.join(data_dir, "train.out"),
            "--validpref",
            os.path.join(data_dir, "valid.out"),
            "--testpref",
            os.path.join(data_dir, "test.out"),
            "--destdir",
            data_dir,
        ]
    )
    preprocess.main(args)


def train_language_model(data_dir, arch, extra_flags=(), run_validation=False):
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            "--task",
            "language_modeling",
            data_dir,
            "--arch",
            arch,
            "--optimizer",
            "adam",
            "--lr",
            "0.0001",
            "--max-tokens",
            "500",
            "--tokens-per-sample",
            "500",
            "--save-dir",
            data_dir,
            "--max-epoch",
            "1",
            "--no-progress-bar",
            "--distributed-world-size",
            "1",
            "--ddp-backend",
            "no_c10d",
            "--num-workers",
            "0",
            *extra_flags,
        ],
    )
    distributed_utils.call_main(convert_namespace_to_omegaconf(args), train.main)
    if run_validation:
        validate_args = options.parse_args_and_arch(
            options.get_validation_parser(),
            [
                "--task",
                "language_modeling",
                data_dir,
                "--path",
                os.path.join(data_dir, "checkpoint_last.pt"),
                "--valid-subset",
                "valid",
                "--max-tokens",
                "500",
                "--no-progress-bar",
                "--num-workers",
                "0",
            ],
        )
        return validate.main(validate_args)


def eval_lm_main(data_dir, extra_flags=()):
    args = options.parse_args_and_arch(
        options.get_eval_lm_parser(),
        [
            data_dir,
            "--path",
            os.path.join(data_dir, "checkpoint_last.pt"),
            "--no-progress-bar",
            "--num-workers",
            "0",
            *extra_flags,
        ],
    )
    return eval_lm.main(args)


def generate_main(data_dir, extra_flags=()):
    args = options.parse_args_and_arch(
        options.get_generation_parser(),
        [
            data_dir,
            "--path",
            os.path.join(data_dir, "checkpoint_last.pt"),
            "--beam",
            "3",
            "--batch-size",
            "64",
            "--max-len-b",
            "5",
            "--gen-subset",
            "valid",
            "--no-progress-bar",
            "--num-workers",
            "0",
            *extra_flags,
        ],
    )
    result = generate.main(args)
    args.buffer_size = 0  # upstream then runs interactive on the same namespace
    args.input = "-"
    args.batch_size = None
    stdin, sys.stdin = sys.stdin, io.StringIO("h e l l o\n")
    try:
        prompts = interactive.main(args)
    finally:
        sys.stdin = stdin
    return result, prompts


@pytest.mark.parametrize(
    "name, arch, flags, context_window",
    [
        ("transformer_lm", "transformer_lm", ["--add-bos-token", "--nval", "1", *SMALL], True),
        (
            "normformer",
            "transformer_lm",
            ["--add-bos-token", "--nval", "1", "--scale-fc", "--scale-heads", "--scale-attn", "--scale-fc", *SMALL],
            True,
        ),
        (
            "adaptive_softmax",
            "transformer_lm",
            [
                "--add-bos-token",
                "--criterion",
                "adaptive_loss",
                "--adaptive-softmax-cutoff",
                "5,10,15",
                *SMALL,
                "--decoder-embed-dim",
                "64",
            ],
            False,
        ),
        (
            "fconv_lm",
            "fconv_lm",
            [
                "--decoder-layers",
                "[(64, 3)] * 2 + [(128, 4)]",
                "--decoder-embed-dim",
                "32",
                "--optimizer",
                "nag",
                "--lr",
                "0.1",
            ],
            False,
        ),
    ],
)
def test_upstreams_lm_flow_with_namespaces(tmp_path, capsys, caplog, name, arch, flags, context_window):
    data_dir = str(tmp_path)
    torch.manual_seed(0)
    create_dummy_data(data_dir)
    preprocess_lm_data(data_dir)
    validated = train_language_model(data_dir, arch, flags, run_validation=name != "fconv_lm")
    if validated is not None:
        assert validated["valid"]["loss"] > 0
    result = eval_lm_main(data_dir)
    assert result["tokens"] == sum(len(line.split()) + 1 for line in open(tmp_path / "test.out"))  # every token
    if arch == "transformer_lm":  # trained with --tokens-per-sample 500, evaluated without the flag
        assert "(its default) is more than the model's 500 positions: evaluating blocks of 500 tokens" in caplog.text
    if context_window:
        assert eval_lm_main(data_dir, ["--context-window", "25"])["tokens"] == result["tokens"]
    capsys.readouterr()
    generated, prompts = generate_main(data_dir, LM_GENERATION)
    out = capsys.readouterr().out
    assert generated["sentences"] == 100 and prompts == 1
    hypotheses = [line.split("\t") for line in out.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 101 and all(len(h[2].split()) <= 5 for h in hypotheses)
    assert "is longer than the longest output allowed, 5 tokens" in caplog.text
