"""Running fairseq from Python as upstream documents it, on a tiny model (CPU): parse_args_and_arch ->
call_main(args, train.main) with an argparse namespace, --store-ema checkpoints (single file, resumed, and
FSDP2 with sharded state), fairseq-validate (--valid-subset, --combine-valid-subsets, --nval), eval-lm's
default batch, and the error for numbered valid splits that --valid-subset leaves out."""

import os
import re
import time

import pytest
import torch

from tests.train_fixtures import tiny_train_argv, write_corpus
from fairseq import options
from fairseq.checkpoint_utils import load_ema_from_checkpoint
from fairseq.data import MMapIndexedDataset
from fairseq.distributed.utils import call_main
from fairseq_cli import eval_lm, train
from fairseq_cli import validate as validate_cli

DECAY = 0.5
EMA_FLAGS = ["--store-ema", "--ema-decay", str(DECAY), "--disable-validation"]


@pytest.fixture(scope="module")
def data_with_valid1(tmp_path_factory):
    """train / valid / valid1 / test, binarized by fairseq-preprocess (valid1 from a second --validpref)."""
    from fairseq_cli.preprocess import cli_main

    root = tmp_path_factory.mktemp("valid1")
    for name, lines, seed in (("train", 120, 1), ("valid", 20, 2), ("valid1", 16, 3), ("test", 16, 4)):
        write_corpus(root / f"{name}.txt", lines, seed=seed)
    cli_main(
        [
            "--only-source",
            "--trainpref",
            str(root / "train.txt"),
            "--validpref",
            f"{root / 'valid.txt'},{root / 'valid1.txt'}",
            "--testpref",
            str(root / "test.txt"),
            "--destdir",
            str(root / "bin"),
            "--workers",
            "1",
        ]
    )
    return root / "bin"


def parse(data, save_dir, *extra, max_update):
    argv = tiny_train_argv(data, save_dir, *EMA_FLAGS, *extra, max_update=max_update, json_log=False, log_file=False)
    return options.parse_args_and_arch(options.get_training_parser(), argv)


@pytest.fixture(scope="module")
def ema_runs(data_with_valid1, tmp_path_factory):
    """A: 2 updates through call_main(namespace, train.main), resumed to 4 with train.main(namespace), a
    checkpoint per update; B: A's update-2 file resumed to 4 under FSDP2, saving a sharded (DCP) checkpoint."""
    root = tmp_path_factory.mktemp("ema")
    a, b = root / "a", root / "b"
    call_main(parse(data_with_valid1, a, "--save-interval-updates", "1", max_update=2), train.main)
    train.main(parse(data_with_valid1, a, "--save-interval-updates", "1", max_update=4))
    call_main(
        parse(
            data_with_valid1,
            b,
            "--save-interval-updates",
            "2",
            "--ddp-backend",
            "fully_sharded",
            "--use-sharded-state",
            "--restore-file",
            str(a / "checkpoint_1_2.pt"),
            max_update=4,
        ),
        train.main,
    )
    return a, b


def test_ema_in_checkpoints_follows_the_rule_across_a_resume(ema_runs):
    a, _ = ema_runs
    average = None
    for update in range(1, 5):
        state = torch.load(a / f"checkpoint_1_{update}.pt", map_location="cpu", weights_only=True)
        weights = state["model"]
        # the EMA starts as the weights after the first update (upstream builds it then), then follows the rule;
        # the same fp32 operations in the same order: bitwise, also after the resume at update 2
        average = (
            {k: v.clone() for k, v in weights.items()}
            if average is None
            else {k: average[k] * DECAY + weights[k] * (1 - DECAY) for k in weights}
        )
        saved = state["extra_state"]["ema"]
        assert saved.keys() == weights.keys()
        for key in weights:
            assert torch.equal(saved[key], average[key]), (update, key)
    assert torch.equal(
        load_ema_from_checkpoint(str(a / "checkpoint_last.pt"))["model"]["decoder.embed_tokens.weight"],
        average["decoder.embed_tokens.weight"],
    )


def test_fsdp2_sharded_ema_equals_the_unsharded_one(ema_runs):
    """B took A's EMA from a single file into DTensor shards, stepped them and saved them in DCP's shards."""
    a, b = ema_runs
    assert os.path.isdir(b / "checkpoint_1_4") and os.path.isfile(b / "checkpoint_1_4" / "metadata.pt")
    sharded = load_ema_from_checkpoint(str(b / "checkpoint_1_4"))["model"]
    single = load_ema_from_checkpoint(str(a / "checkpoint_1_4.pt"))["model"]
    assert sharded.keys() == single.keys()
    for key in single:  # one rank: FSDP2 runs the same fp32 arithmetic on its one shard
        assert torch.allclose(sharded[key], single[key], rtol=1e-6, atol=1e-7), key


def test_validate_prints_upstreams_line_and_matches_eval_lm(ema_runs, data_with_valid1, caplog):
    a, _ = ema_runs
    ckpt = str(a / "checkpoint_last.pt")
    common = [str(data_with_valid1), "--path", ckpt, "--cpu", "--max-tokens", "256", "--log-format", "simple"]
    caplog.set_level("INFO")
    validate_cli.cli_main(common + ["--valid-subset", "valid,valid1"])
    lines = [r.getMessage() for r in caplog.records if "subset |" in r.getMessage()]
    assert len(lines) == 2
    # upstream's line: loss, ppl, wps, wpb, bsz, numbers as "{:g}" prints them (wpb, bsz: per batch)
    number = r"[\d.]+(e[+-]\d+)?"
    for line, subset in zip(lines, ("valid", "valid1")):
        assert re.fullmatch(
            rf"valid on '{subset}' subset \| loss {number} \| ppl {number} \| wps {number} \| wpb "
            rf"{number} \| bsz {number}$",
            line,
        ), line
    started = time.perf_counter()
    results = validate_cli.main(
        options.convert_namespace_to_config(
            options.parse_args_and_arch(
                options.get_validation_parser(), common + ["--valid-subset", "valid,valid1", "--combine-valid-subsets"]
            )
        )
    )
    seconds = time.perf_counter() - started
    tokens = {s: int(MMapIndexedDataset(str(data_with_valid1 / s)).sizes.sum()) for s in ("valid", "valid1")}
    assert_batches_of(results["valid"], tokens["valid"] + tokens["valid1"], 256)  # valid and valid1 as one set
    # wps: the tokens over the time the subset took (was over a meter's microseconds: 1.8e7 on a laptop)
    assert 1e-3 < (tokens["valid"] + tokens["valid1"]) / results["valid"]["wps"] <= seconds
    args = options.parse_args_and_arch(
        options.get_eval_lm_parser(),
        [str(data_with_valid1), "--path", ckpt, "--gen-subset", "valid", "--tokens-per-sample", "32", "--cpu"],
    )
    evaluated = eval_lm.main(args)  # a namespace, no batch size: upstream's --max-tokens 36000
    assert args.max_tokens is None and evaluated["tokens"] == tokens["valid"]
    per_subset = validate_cli.main(
        options.convert_namespace_to_config(
            options.parse_args_and_arch(options.get_validation_parser(), common + ["--valid-subset", "valid"])
        )
    )
    assert per_subset["valid"]["loss"] == pytest.approx(evaluated["loss"], abs=5e-4)  # rounded to 3 decimals
    assert_batches_of(per_subset["valid"], tokens["valid"], 256)
    first = validate_cli.main(
        options.convert_namespace_to_config(
            options.parse_args_and_arch(
                options.get_validation_parser(), common + ["--valid-subset", "valid", "--nval", "1"]
            )
        )
    )
    assert 0 < first["valid"]["wpb"] <= 256
    sentences = validate_cli.main(
        options.convert_namespace_to_config(
            options.parse_args_and_arch(
                options.get_validation_parser(),
                [str(data_with_valid1), "--path", ckpt, "--cpu", "--batch-size", "3", "--valid-subset", "valid"],
            )
        )
    )
    assert sentences["valid"]["bsz"] <= 3 and sentences["valid"]["loss"] == per_subset["valid"]["loss"]


def assert_batches_of(stats, tokens, max_tokens):
    """wpb is tokens per batch of at most `max_tokens` (was the whole subset as one batch): `tokens` in a whole
    number of batches, wpb rounded to one decimal."""
    assert 0 < stats["wpb"] <= max_tokens
    batches = round(tokens / stats["wpb"])
    assert batches > 1 and abs(batches * stats["wpb"] - tokens) <= 0.05 * batches


def test_validate_errors_are_one_line(ema_runs, data_with_valid1, capsys):
    from fairseq.utils import run_console_script

    with pytest.raises(SystemExit) as e:  # fairseq-validate's entry point (console_main) on these arguments
        run_console_script(
            "fairseq-validate",
            validate_cli.cli_main,
            [str(data_with_valid1), "--path", str(ema_runs[0] / "nope.pt"), "--cpu", "--max-tokens", "64"],
        )
    assert e.value.code == 1
    assert (
        capsys.readouterr().err.strip().splitlines()[-1]
        == f"fairseq-validate: error: Model file not found: {ema_runs[0] / 'nope.pt'}"
    )


def test_numbered_valid_split_left_out_is_an_error(data_with_valid1, tmp_path):
    argv = tiny_train_argv(data_with_valid1, tmp_path, max_update=1, json_log=False, log_file=False)
    with pytest.raises(ValueError, match=r"validation splits \['valid1'\] in DATA are not in --valid-subset valid"):
        train.cli_main(argv)
