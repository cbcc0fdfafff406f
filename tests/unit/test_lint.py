"""ruff's lint rules (pyproject's [tool.ruff.lint]) over the tree: CI fails on a finding, with its line named."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TREE = ["fairseq", "fairseq_cli", "scripts", "tests", "examples"]


def test_ruff_lint_passes():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", *TREE], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
