"""fairseq-train with no usable batch: it stops before the first epoch with one line naming the cause
(an empty split, or every item longer than the limit and the flag that set it) instead of running empty
epochs forever."""

import os
import shutil

import pytest

from fairseq.logging.progress_bar import read_json_log
from fairseq_cli import preprocess
from tests.train_fixtures import train_in_process

# A hang (the bug this file guards against) fails the test instead of blocking the suite.
pytestmark = pytest.mark.timeout(120)


def run_train(argv):
    """fairseq-train's console entry point, in this process: (exit status, stdout, stderr)."""
    return train_in_process(argv)


def epoch_lines(log_file):
    """The stats of the log's epoch summary lines ("| train |", JSON format)."""
    return read_json_log(log_file, "train")


def error_lines(err):
    return [line for line in err.splitlines() if line.startswith("fairseq-train: error:")]


@pytest.fixture(scope="module")
def empty_train_data(tiny_data, tmp_path_factory):
    """tiny_data's dictionary and valid split, and a train split binarized from an empty text."""
    root = tmp_path_factory.mktemp("empty_train")
    (root / "empty.txt").write_text("")
    dest = root / "bin"
    preprocess.cli_main(
        [
            "--only-source",
            "--srcdict",
            str(tiny_data / "dict.txt"),
            "--trainpref",
            str(root / "empty.txt"),
            "--destdir",
            str(dest),
            "--workers",
            "1",
        ]
    )
    for name in ("valid.bin", "valid.idx"):
        shutil.copy(tiny_data / name, dest / name)
    return dest


def test_empty_train_split_stops_at_once_naming_the_file(empty_train_data, tmp_path, train_args):
    rc, out, err = run_train(train_args(empty_train_data, tmp_path / "ck"))
    assert rc == 1
    [line] = error_lines(err)
    train_bin = os.path.join(str(empty_train_data), "train.bin")
    assert f"no training batch: the training split 'train' is empty ({train_bin}: 0 sentences" in line
    assert "fairseq-preprocess" in line
    assert epoch_lines(tmp_path / "ck" / "train.log") == []  # stopped before the first epoch
    assert not [n for n in os.listdir(tmp_path / "ck") if n.endswith(".pt")]


def test_max_tokens_below_tokens_per_sample_with_packed_blocks_is_refused_before_any_data(
    tiny_data, tmp_path, train_args
):
    # With --sample-break-mode none every block has --tokens-per-sample tokens: all but a last, shorter one would
    # be skipped and the run trained on almost nothing (the validation flag skipping them too) with a warning.
    for mode in ("none", "complete"):
        argv = train_args(
            tiny_data, tmp_path / "ck", "--skip-invalid-size-inputs-valid-test", "--sample-break-mode", mode
        )
        argv[argv.index("--max-tokens") + 1] = "16"  # blocks have 32 tokens
        rc, out, err = run_train(argv)
        assert rc == 2 and err.splitlines()[-1].split(": error: ", 1)[1] == (
            f"--max-tokens 16 is less than --tokens-per-sample 32: with --sample-break-mode {mode} (nearly) every "
            "block has 32 tokens and would be skipped; raise --max-tokens to at least 32, or lower "
            "--tokens-per-sample to at most 16"
        )
        assert not (tmp_path / "ck").exists()  # refused before the save dir was opened


def test_most_items_longer_than_max_tokens_is_an_error_naming_the_counts(tiny_data, tmp_path, train_args):
    # eos mode: a sentence per item, 4 to 26 tokens; --max-tokens 10 would skip 279 of the 400
    argv = train_args(tiny_data, tmp_path / "ck", "--skip-invalid-size-inputs-valid-test", "--sample-break-mode", "eos")
    argv[argv.index("--max-tokens") + 1] = "10"
    rc, out, err = run_train(argv)
    assert rc == 1
    [line] = error_lines(err)
    train_bin = os.path.join(str(tiny_data), "train.bin")
    assert line == (
        f"fairseq-train: error: 279 of 400 items of the training split 'train' ({train_bin}: 400 "
        "sentences, 400 blocks) are longer than --max-tokens 10 (the longest has 26 tokens) and would be "
        "skipped; raise --max-tokens to at least 26 (the longest item)"
    )
    assert epoch_lines(tmp_path / "ck" / "train.log") == []


def test_a_few_long_lines_skipped_in_eos_mode_only_warn(tiny_data, tmp_path, train_args):
    argv = train_args(
        tiny_data, tmp_path / "ck", "--skip-invalid-size-inputs-valid-test", "--sample-break-mode", "eos", max_update=2
    )
    argv[argv.index("--max-tokens") + 1] = "24"
    rc, out, err = run_train(argv)
    assert rc == 0, err[-2000:]
    log = (tmp_path / "ck" / "train.log").read_text()
    assert "31 items longer than --max-tokens 24 are skipped" in log  # of the 400 training sentences
    assert "3 items longer than --max-tokens 24 are skipped" in log  # of the 40 validation sentences


def test_every_item_longer_than_max_tokens_names_the_flag_and_the_fix(tiny_data, tmp_path, train_args):
    # The validation error for too-long items suggests --skip-invalid-size-inputs-valid-test: with it,
    # every training item was skipped too and the run looped over empty epochs, ignoring SIGTERM.
    argv = train_args(tiny_data, tmp_path / "ck", "--skip-invalid-size-inputs-valid-test", "--sample-break-mode", "eos")
    argv[argv.index("--max-tokens") + 1] = "3"  # sentences have 4 to 26 tokens
    rc, out, err = run_train(argv)
    assert rc == 1
    [line] = error_lines(err)
    assert "no training batch: all 400 items of the training split 'train'" in line
    assert "are longer than --max-tokens 3 (the longest has 26 tokens); raise --max-tokens to at least 26" in line
    log = (tmp_path / "ck" / "train.log").read_text()
    assert "400 items longer than --max-tokens 3 are skipped" in log  # the warning names the real flag
    assert "max positions" not in log and epoch_lines(tmp_path / "ck" / "train.log") == []


def test_every_item_longer_than_the_model_positions_names_those_flags(tiny_data, tmp_path, train_args):
    rc, out, err = run_train(train_args(tiny_data, tmp_path / "ck", "--max-target-positions", "16"))
    assert rc == 1
    [line] = error_lines(err)
    assert (
        "all 188 items of the training split 'train'" in line
        and "longer than --tokens-per-sample / --max-target-positions 16 (the longest has 32 tokens)" in line
    )
    assert "--max-target-positions at least 32" in line and "--tokens-per-sample at most 16" in line


def test_an_empty_shard_stops_at_its_epoch_naming_it(tiny_data, empty_train_data, tmp_path, train_args):
    data = f"{tiny_data}{os.pathsep}{empty_train_data}"
    argv = train_args(data, tmp_path / "ck", "--max-epoch", "3", max_update=0)
    argv[argv.index("--max-tokens") + 1] = "1024"  # 7 updates per epoch
    rc, out, err = run_train(argv)
    assert rc == 1
    [line] = error_lines(err)
    train_bin = os.path.join(str(empty_train_data), "train.bin")
    assert f"the training split 'train' is empty (shard 2 of 2 in DATA: {train_bin}: 0 sentences" in line
    [epoch1] = epoch_lines(tmp_path / "ck" / "train.log")  # the first shard trained, no empty epoch ran
    assert epoch1["epoch"] == 1
    assert (tmp_path / "ck" / "checkpoint1.pt").exists()


def test_an_empty_validation_subset_is_an_error_before_training(tiny_data, empty_train_data, tmp_path, train_args):
    # empty_train_data's train split is empty: as a validation subset it can give no loss
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for name in ("dict.txt", "train.bin", "train.idx", "valid.bin", "valid.idx"):
        shutil.copy(tiny_data / name, data_dir / name)
    for name in ("train.bin", "train.idx"):
        shutil.copy(empty_train_data / name, data_dir / name.replace("train", "empty"))
    rc, out, err = run_train(train_args(data_dir, tmp_path / "ck", "--valid-subset", "valid,empty"))
    assert rc == 1
    [line] = error_lines(err)
    assert "no validation batch: the validation subset 'empty' is empty" in line
    assert "drop it from --valid-subset, or pass --disable-validation" in line
    assert epoch_lines(tmp_path / "ck" / "train.log") == []


def test_validation_items_all_skipped_is_an_error_naming_max_tokens_valid(tiny_data, tmp_path, train_args):
    argv = train_args(
        tiny_data,
        tmp_path / "ck",
        "--max-tokens-valid",
        "3",
        "--sample-break-mode",
        "eos",
        "--skip-invalid-size-inputs-valid-test",
    )
    rc, out, err = run_train(argv)
    assert rc == 1
    [line] = error_lines(err)
    assert "no validation batch: all 40 items of the validation subset 'valid'" in line
    assert (
        "longer than --max-tokens-valid 3 (the longest has 25 tokens); raise --max-tokens-valid to at least 25" in line
    )
    # without validation the same run trains
    rc, out, err = run_train(argv + ["--disable-validation", "--max-update", "1"])
    assert rc == 0, err[-2000:]


@pytest.mark.timeout(300)
def test_two_ranks_stop_together_on_no_batch(tiny_data, tmp_path, train_args):
    argv = train_args(
        tiny_data,
        tmp_path / "ck",
        "--skip-invalid-size-inputs-valid-test",
        "--distributed-world-size",
        "2",
        "--sample-break-mode",
        "eos",
    )
    argv[argv.index("--max-tokens") + 1] = "3"
    rc, out, err = run_train(argv)  # the 2 ranks spawned from this process
    assert rc != 0
    assert "no training batch: all 400 items of the training split 'train'" in out + err
    assert epoch_lines(tmp_path / "ck" / "train.log") == []


def test_validation_of_no_batch_logs_no_nan_loss(tiny_data, tmp_path, train_args):
    rc, out, err = run_train(train_args(tiny_data, tmp_path / "ck", "--max-valid-steps", "0", max_update=2))
    assert rc == 0, err[-2000:]
    log = (tmp_path / "ck" / "train.log").read_text()
    assert "validation on 'valid' ran no batch (--max-valid-steps 0): no valid loss" in log
    assert "| valid |" not in log and "nan" not in log.lower()
