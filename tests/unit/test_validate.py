"""validate(cfg): every training entry point checks flag combinations before any process or data exists."""

import pytest

from fairseq import options
from fairseq.frontend.validate import validate
from fairseq_cli import train
from tests.train_fixtures import train_in_process

BASE = [
    "--task",
    "language_modeling",
    "/nonexistent/data",
    "--arch",
    "transformer_lm",
    "--optimizer",
    "adam",
    "--lr",
    "0.001",
    "--max-tokens",
    "64",
    "--tokens-per-sample",
    "16",
    "--cpu",
]


def config(*extra):
    parser = options.get_training_parser()
    return options.convert_namespace_to_config(options.parse_args_and_arch(parser, BASE + list(extra)))


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--use-sharded-state"], "--use-sharded-state needs --ddp-backend fully_sharded"),
        (["--fsdp-sync-free"], "--fsdp-sync-free needs --ddp-backend fully_sharded"),
        (
            ["--ddp-backend", "fully_sharded", "--fsdp-forward-prefetch", "--fsdp-prefetch-depth", "0"],
            "--fsdp-prefetch-depth must be at least 1",
        ),
        (["--decoder-layers", "-1"], "--decoder-layers must be >= 0"),
        (["--use-bmuf"], "--use-bmuf"),
        (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
        (["--seed", "-1"], r"--seed -1 is out of range: an integer from 0 to 2\*\*32 - 1"),
        (["--seed", str(2**32)], "--seed 4294967296 is out of range"),
    ],
)
def test_validate_names_the_flag(extra, message):
    with pytest.raises(ValueError, match=message):
        validate(config(*extra))


def test_a_config_built_in_code_with_fp16_and_bf16_is_refused():
    # the front ends refuse the flags together as they read them; a config set in code reaches validate() only
    cfg = config("--bf16")
    cfg.common.fp16 = True
    with pytest.raises(ValueError, match="--fp16 and --bf16 cannot be combined"):
        validate(cfg)


def test_a_valid_config_passes():
    validate(config())


def test_main_validates_before_reading_data_or_spawning(tmp_path):
    # The data directory does not exist: the flag error must come first, from the parser, before any
    # process is spawned.
    args = BASE + ["--use-sharded-state", "--distributed-world-size", "2", "--save-dir", str(tmp_path)]
    returncode, stdout, stderr = train_in_process(args)  # the console entry point, log and all
    assert returncode == 2, stderr[-2000:]
    assert "--use-sharded-state needs --ddp-backend fully_sharded" in stderr
    assert "spawning" not in stdout + stderr and "Dataset not found" not in stdout + stderr
    with pytest.raises(ValueError, match="--use-sharded-state needs"):  # in-process callers of main() too
        train.main(config("--use-sharded-state", "--save-dir", str(tmp_path)))


def test_validate_reads_no_file_the_start_up_checks_do(tmp_path):
    """validate(cfg) checks the flags only: the --bpe files (and, with --model-parallel-size, dict.txt) are read
    by fairseq.training.loop.check_input_files, which fairseq-train runs next, before spawning."""
    from fairseq.training.loop import check_input_files

    with pytest.raises(ValueError, match="--bpe gpt2 needs --gpt2-encoder-json PATH"):
        validate(config("--bpe", "gpt2"))
    missing = config(
        "--bpe",
        "gpt2",
        "--gpt2-encoder-json",
        str(tmp_path / "encoder.json"),
        "--gpt2-vocab-bpe",
        str(tmp_path / "vocab.bpe"),
    )
    validate(missing)
    with pytest.raises(FileNotFoundError, match="--gpt2-encoder-json .*encoder.json: no such file"):
        check_input_files(missing)
