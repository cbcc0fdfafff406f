"""fairseq.utils.run_console_script: a user-facing error is printed once, as one line on stderr, exit 1."""

import logging
import os
import subprocess
import sys

import pytest

from fairseq.utils import run_console_script


@pytest.fixture
def root_logs_to_stderr():
    """What the tools set up: the root logger writing to the console (here: pytest's captured stderr)."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    root.addHandler(handler)
    yield
    root.removeHandler(handler)


def test_error_is_printed_once_as_one_line(capsys, root_logs_to_stderr):
    def main(argv):
        raise ValueError("the first part\n  and the second part")

    with pytest.raises(SystemExit) as exit_info:
        run_console_script("fairseq-something", main, [])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert captured.err == "fairseq-something: error: the first part and the second part\n"
    assert captured.out == ""


def test_other_errors_are_not_swallowed():
    def main(argv):
        raise KeyError("a bug, not a user error")

    with pytest.raises(KeyError):
        run_console_script("fairseq-something", main, [])


def test_result_is_returned():
    assert run_console_script("fairseq-something", lambda argv: argv + [1], [0]) == [0, 1]


def test_fairseq_train_prints_a_user_error_once(tmp_path):
    """The real command line: data without dict.txt."""
    data = tmp_path / "data"
    data.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fairseq_cli.train",
            "--task",
            "language_modeling",
            str(data),
            "--arch",
            "transformer_lm",
            "--optimizer",
            "adam",
            "--max-tokens",
            "64",
            "--tokens-per-sample",
            "64",
            "--cpu",
            "--save-dir",
            str(tmp_path / "ck"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert output.count(f"no dict.txt in {data}") == 1, output[-3000:]
    assert result.stderr.splitlines()[-1].startswith(f"fairseq-train: error: no dict.txt in {data}")
    assert "Traceback" not in output
