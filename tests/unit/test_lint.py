"""ruff over the tree (pyproject's [tool.ruff]): its lint rules and its formatter. CI fails on a finding, with the
line or file named."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TREE = ["fairseq", "fairseq_cli", "scripts", "tests", "examples"]


def _ruff(*args):
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *TREE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_ruff_lint_passes():
    proc = _ruff("check", "--output-format", "concise")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_tree_is_formatted():
    # `ruff format` (line length 120) is the one layout: run it before committing (docs/testing.md)
    proc = _ruff("format", "--check")
    assert proc.returncode == 0, (
        "run `ruff format " + " ".join(TREE) + "`:\n" + proc.stdout[-6000:] + proc.stderr[-2000:]
    )
