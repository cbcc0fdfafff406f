"""fairseq-train --store-ema logs the EMA's decay as upstream's trainer does: `ema_decay` (priority 10000,
round 5, weight 0) in the train_inner and train lines, after every other key but the clock, the value the EMA
used at the last update of the interval (0 before --ema-start-update), and nowhere without --store-ema.

The tiny transformer_lm on tiny_data, 6 updates (within the first epoch). With --log-interval 2 and
--ema-start-update 4 the line at update 2 covers decays 0, 0 (shows 0), the one at update 4 covers 0, D (shows
D: the latest value, where a mean would show D / 2), the one at 6 D, D; the epoch line shows D. D = 0.987654
shows the rounding to 5 digits (0.98765)."""

import json
from pathlib import Path

import pytest

from tests.train_fixtures import tiny_train_argv, train_in_process

DECAY = "0.987654"
LOGGED_DECAY = "0.98765"  # round(0.987654, 5), printed with "{:g}"


def log_lines(path):
    """(tag, values) of the train_inner / train / valid lines of a json --log-file."""
    rows = []
    for line in Path(path).read_text().splitlines():
        parts = line.split(" | ", 3)
        if len(parts) == 4 and parts[2] in ("train_inner", "train", "valid"):
            rows.append((parts[2], json.loads(parts[3])))
    return rows


def train(data, save_dir, *flags):
    argv = tiny_train_argv(data, save_dir, "--log-interval", "2", *flags, max_update=6)
    status, _, err = train_in_process(argv)
    assert status == 0, err
    return log_lines(save_dir / "train.log")


@pytest.fixture(scope="module")
def ema_log(tiny_data, tmp_path_factory):
    return train(
        tiny_data, tmp_path_factory.mktemp("ema_log"), "--store-ema", "--ema-decay", DECAY, "--ema-start-update", "4"
    )


def test_train_inner_lines_show_the_decay_the_ema_used(ema_log):
    inner = [values for tag, values in ema_log if tag == "train_inner"]
    assert [(v["num_updates"], v["ema_decay"]) for v in inner] == [("2", "0"), ("4", LOGGED_DECAY), ("6", LOGGED_DECAY)]
    for values in inner:  # upstream's place: after every other meter, then the wall clock
        assert list(values)[-2:] == ["ema_decay", "wall"]


def test_epoch_lines_show_the_latest_decay_and_valid_lines_none(ema_log):
    epochs = [values for tag, values in ema_log if tag == "train"]
    assert [(v["train_num_updates"], v["train_ema_decay"]) for v in epochs] == [("6", LOGGED_DECAY)]
    assert all(list(v)[-2:] == ["train_ema_decay", "train_wall"] for v in epochs)
    valid = [values for tag, values in ema_log if tag == "valid"]
    assert valid and not any("ema" in key for v in valid for key in v)


def test_no_ema_decay_without_store_ema(tiny_data, tmp_path):
    rows = train(tiny_data, tmp_path)
    assert [v["num_updates"] for tag, v in rows if tag == "train_inner"] == ["2", "4", "6"]
    assert not any("ema" in key for _, values in rows for key in values)
