"""--max-tokens, --batch-size, --update-freq and --buffer-size of 0 or less: refused by every entry point that takes
them (one check each, fairseq.dataclass.batch_flags), in the one usage line `PROG: error: FLAG VALUE ...` with
status 2, before any checkpoint or data is read (the --path given does not exist); and by the hub, for its
from_pretrained keywords. The planner's refusals are in tests/unit/test_plan_memory.py."""

import io
import os
import sys

import pytest

from fairseq.models.transformer_lm import TransformerLanguageModel
from fairseq_cli import eval_lm, generate, interactive, train, validate
from tests.train_fixtures import console_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = "must be at least 1: the most tokens in one batch (leave it out to batch by the number of sentences alone)"
BATCH_SIZE = "must be at least 1: the most sentences in one batch (leave it out to batch by the number of tokens alone)"
UPDATE_FREQ = (
    ": every value must be an integer of at least 1 (the batches whose gradients make one update; one "
    "value per epoch, e.g. 4 or 4,2)"
)
BUFFER_SIZE = "must be at least 0: the input lines read before generating for them (0 or 1: one at a time)"

ENTRY_POINTS = {
    "fairseq-train": (train.cli_main, ["--arch", "transformer_lm", "--optimizer", "adam", "--cpu"]),
    "fairseq-generate": (generate.cli_main, ["--path", "no-such.pt", "--cpu"]),
    "fairseq-interactive": (interactive.cli_main, ["--path", "no-such.pt", "--cpu"]),
    "fairseq-eval-lm": (eval_lm.cli_main, ["--path", "no-such.pt", "--cpu"]),
    "fairseq-validate": (validate.cli_main, ["--path", "no-such.pt", "--cpu", "--task", "language_modeling"]),
}
BAD_VALUES = [
    (["--max-tokens", "0"], f"--max-tokens 0 {MAX_TOKENS}"),
    (["--max-tokens", "-100"], f"--max-tokens -100 {MAX_TOKENS}"),  # was "... raise --max-tokens" (interactive)
    (["--batch-size", "0"], f"--batch-size 0 {BATCH_SIZE}"),
    (["--batch-size", "-1"], f"--batch-size -1 {BATCH_SIZE}"),
    (["--max-sentences", "-1"], f"--batch-size -1 {BATCH_SIZE}"),  # upstream's alias, the one option
]


def usage_error(name, argv, monkeypatch):
    """The message of the one stderr line of `name ARGV`, which must exit 2 with no traceback."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("w1 w2\n"))
    main, _ = ENTRY_POINTS[name]
    status, _, err = console_in_process(name, main, [str(a) for a in argv])
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, (status, err)
    return lines[0].split(": error: ", 1)[1]


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("flags, message", BAD_VALUES)
def test_every_entry_point_refuses_a_batch_of_no_size(name, flags, message, tiny_data, monkeypatch):
    argv = [tiny_data, *ENTRY_POINTS[name][1], *flags]
    assert usage_error(name, argv, monkeypatch) == message


@pytest.mark.parametrize("name", ["fairseq-train", "fairseq-eval-lm"])  # the tools that parse --update-freq
@pytest.mark.parametrize("value", ["0", "-2", "4,0"])
def test_update_freq_below_one(name, value, tiny_data, monkeypatch):
    argv = [tiny_data, *ENTRY_POINTS[name][1], "--max-tokens", "64", "--update-freq", value]
    assert usage_error(name, argv, monkeypatch) == f"--update-freq {value}{UPDATE_FREQ}"


def test_valid_batch_options_and_buffer_size(tiny_data, monkeypatch):
    train_argv = [tiny_data, *ENTRY_POINTS["fairseq-train"][1], "--max-tokens", "64"]
    assert (
        usage_error("fairseq-train", train_argv + ["--max-tokens-valid", "0"], monkeypatch)
        == f"--max-tokens-valid 0 {MAX_TOKENS}"
    )
    assert (
        usage_error("fairseq-train", train_argv + ["--batch-size-valid", "-3"], monkeypatch)
        == f"--batch-size-valid -3 {BATCH_SIZE}"
    )
    argv = [tiny_data, *ENTRY_POINTS["fairseq-interactive"][1], "--buffer-size", "-1"]
    assert usage_error("fairseq-interactive", argv, monkeypatch) == f"--buffer-size -1 {BUFFER_SIZE}"


@pytest.mark.parametrize(
    "keyword, value, message",
    [
        ("max_tokens", -100, f"max_tokens=-100 {MAX_TOKENS}"),
        ("max_tokens", 0, f"max_tokens=0 {MAX_TOKENS}"),
        ("batch_size", 0, f"batch_size=0 {BATCH_SIZE}"),
        ("batch_size", 2.5, "batch_size=2.5 must be an integer: the most sentences in one batch"),
    ],
)
def test_the_hub_refuses_them_as_keywords(keyword, value, message, tiny_data, tiny_lm_checkpoint):
    lm = TransformerLanguageModel.from_pretrained(
        os.path.dirname(tiny_lm_checkpoint), "checkpoint_last.pt", data_name_or_path=str(tiny_data), **{keyword: value}
    )
    with pytest.raises(ValueError) as error:
        lm.sample("w1 w2", max_len_b=3)
    assert str(error.value).startswith(message)
