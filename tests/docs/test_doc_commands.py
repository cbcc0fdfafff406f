"""The docs tier: every ```bash / ```python block of README.md, docs/*.md and examples/*/README.md runs, as a
reader would run it after the quickstart, or is marked in the doc with why it cannot run here
(tests/docs/doc_blocks.py has the markers; docs/testing.md says how to mark a block).

Set-up: the README's `bash scripts/quickstart.sh` runs once, in a scratch copy of the repository root (links
to scripts/, examples/, fairseq/, ... and .venv -> the Python under test; FAIRSEQ_NO_INSTALL=1), at the tiny
MAX_UPDATE the docs document for it. Each doc file then gets a scratch root of its own, the quickstart's
work/quickstart linked in, and runs its blocks there in document order: bash blocks through `bash -e -o
pipefail`, python blocks with the environment's python; a block passes when it exits 0 and prints no
traceback. MAX_UPDATE is set small for the blocks that train, as the docs say they may be.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.doc_blocks import ROOT, all_blocks, doc_files, parse, problems

# The sizes the docs expose as variables, tiny here: MAX_UPDATE, of the quickstart and of the commands
# that train after it.
SIZES = {"MAX_UPDATE": "4"}
LINKED = ["scripts", "examples", "fairseq", "fairseq_cli", "docs", "tests", "pyproject.toml", "README.md"]
BLOCK_TIMEOUT = 300

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.runs]


def block_env():
    env = dict(os.environ)
    env.update(SIZES)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # The tree under test, whatever the environment's editable install points at.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(
        OMP_NUM_THREADS="1",
        FAIRSEQ_NO_INSTALL="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.pop("FAIRSEQ_VENV", None)
    env.pop("WORK", None)
    return env


def scratch_root(path: Path) -> Path:
    """A directory that looks like the repository root after a clone: the tracked top-level entries as links,
    .venv the environment under test."""
    path.mkdir(parents=True)
    for name in LINKED:
        (path / name).symlink_to(ROOT / name)
    (path / ".venv").symlink_to(Path(sys.prefix))
    return path


def run_bash(text: str, cwd: Path, timeout=BLOCK_TIMEOUT):
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", text],
        cwd=cwd,
        env=block_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check(result, what: str):
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback (most recent call last)" not in out, (
        f"{what} exited with status {result.returncode}:\n{out[-6000:]}"
    )


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The README's quickstart, run as the README says, at MAX_UPDATE=SIZES["MAX_UPDATE"]; returns its
    work/quickstart directory."""
    readme = [b for b in parse(ROOT / "README.md") if b.marker == "setup"]
    assert readme and "bash scripts/quickstart.sh" in readme[0].text, "README's setup block lost the quickstart"
    home = scratch_root(tmp_path_factory.mktemp("docs") / "quickstart")
    check(run_bash("bash scripts/quickstart.sh", home), "bash scripts/quickstart.sh")
    work = home / "work" / "quickstart"
    assert (work / "checkpoints" / "checkpoint_best.pt").is_file()
    return work


@pytest.fixture(scope="module")
def doc_home(quickstart, tmp_path_factory):
    """doc_home(block): the scratch root of the block's doc file (made once per file)."""
    homes = {}

    def home(block):
        if block.path not in homes:
            root = scratch_root(tmp_path_factory.mktemp("doc") / block.path.replace("/", "_"))
            (root / "work").mkdir()
            (root / "work" / "quickstart").symlink_to(quickstart)
            homes[block.path] = root
        return homes[block.path]

    return home


def test_every_code_block_runs_or_is_marked():
    bad = problems(BLOCKS)
    assert not bad, "\n".join(bad)
    assert {str(f.relative_to(ROOT)) for f in doc_files()} >= {
        "README.md",
        "docs/generation.md",
        "examples/large_lm/README.md",
    }


def test_markers_are_checked(tmp_path, monkeypatch):
    """The collector itself: an unlabeled block is reported, an unknown marker is an error, markers bind to
    the next block only."""
    import tests.docs.doc_blocks as db

    monkeypatch.setattr(db, "ROOT", tmp_path)
    doc = tmp_path / "x.md"
    doc.write_text(
        "<!-- doc-test: needs-gpu -->\n\n```bash\nnvidia-smi\n```\n\n```bash\necho hi\n```\n\n"
        "```\nfairseq-train x\n```\n"
    )
    blocks = db.parse(doc)
    assert [(b.line, b.marker, b.runs) for b in blocks] == [(3, "needs-gpu", False), (7, None, True), (11, None, False)]
    assert len(db.problems(blocks)) == 1 and "x.md:11" in db.problems(blocks)[0]
    doc.write_text("<!-- doc-test: needs-gpus -->\n```bash\nx\n```\n")
    with pytest.raises(ValueError, match="unknown doc-test marker 'needs-gpus'"):
        db.parse(doc)


def python_chain(block):
    """The python source to run for `block`: the block, after the file's earlier python blocks when it
    `continues` them; None when the next python block continues this one (the chain runs there)."""
    same = [b for b in RUN if b.path == block.path and b.kind == "python"]
    k = same.index(block)
    if k + 1 < len(same) and same[k + 1].marker == "continues":
        return None
    start = k
    while same[start].marker == "continues" and start > 0:
        start -= 1
    return "\n".join(b.text for b in same[start : k + 1])


@pytest.mark.timeout(BLOCK_TIMEOUT + 60)
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_doc_block(block, doc_home):
    home = doc_home(block)
    if block.marker == "file":
        target = home / block.argument
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text, encoding="utf-8")
        return
    if block.kind == "python":
        source = python_chain(block)
        if source is None:
            return  # runs with the block that continues it
        script = home / f"_doc_block_{block.line}.py"
        script.write_text(source, encoding="utf-8")
        result = run_bash(f"python {script.name}", home)
    else:
        result = run_bash(block.text, home)
    check(result, f"the block at {block.id}")
