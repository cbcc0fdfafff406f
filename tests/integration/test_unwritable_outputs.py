"""An output of a command that cannot be written, or an input that is a directory, is one `PROG: error:` line
naming the path, the errno and the fix, with a non-zero status and no traceback (issue 29 item 14, walk-through
D8). The unwritable path is one below a plain file (ENOTDIR) or a plain file where a directory is expected
(EEXIST): a read-only mode does not stop root, a file in the way stops everyone, and the same code path words
a read-only file system (EROFS)."""

import pytest

from fairseq_cli import generate, interactive, train
from tests.train_fixtures import console_in_process, default_train_argv

pytestmark = pytest.mark.usefixtures("one_thread")


def one_error_line(name, cli_main, argv):
    status, _, err = console_in_process(name, cli_main, [str(a) for a in argv])
    lines = err.strip().splitlines()
    assert status == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.fixture
def blocker(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a directory")
    return path


def test_train_log_file_under_a_file(tiny_data, tmp_path, blocker):
    log_file = blocker / "train.log"
    argv = default_train_argv(tiny_data, tmp_path / "ck", "--no-save", "--log-file", log_file, max_update=1)
    line = one_error_line("fairseq-train", train.cli_main, argv)
    assert line.startswith(
        f"fairseq-train: error: cannot write {log_file}: File exists (EEXIST). Fix: "
    ) and line.endswith("choose another --log-file"), line


@pytest.mark.parametrize("where, code", [("under a file", "ENOTDIR"), ("is a file", "EEXIST")])
def test_generate_results_path_that_cannot_be_a_directory(tiny_data, tiny_lm_checkpoint, blocker, where, code):
    results = blocker / "res" if where == "under a file" else blocker
    argv = [
        tiny_data,
        "--path",
        tiny_lm_checkpoint,
        "--task",
        "language_modeling",
        "--gen-subset",
        "test",
        "--cpu",
        "--beam",
        1,
        "--max-len-b",
        2,
        "--num-workers",
        0,
        "--results-path",
        results,
    ]
    line = one_error_line("fairseq-generate", generate.cli_main, argv)
    assert (
        line.startswith(f"fairseq-generate: error: cannot write {results / 'generate-test.txt'}: ")
        and f"({code}). Fix: " in line
        and line.endswith("choose another --results-path")
    ), line
    assert blocker.read_text() == "not a directory"


def test_interactive_input_that_is_a_directory(tiny_data, tiny_lm_checkpoint, tmp_path):
    argv = [
        tiny_data,
        "--path",
        tiny_lm_checkpoint,
        "--task",
        "language_modeling",
        "--cpu",
        "--num-workers",
        0,
        "--input",
        tmp_path,
    ]
    line = one_error_line("fairseq-interactive", interactive.cli_main, argv)
    assert line == (
        f"fairseq-interactive: error: --input {tmp_path} is a directory: pass a text file, one prompt "
        "a line, or '-' to read standard input"
    ), line
