"""The code blocks of the project's markdown files, and how the docs tier runs them.

Every fenced block of README.md, docs/*.md and examples/*/README.md is collected. A block in ```bash or
```python runs unless the line before its fence (blank lines skipped) is a marker saying why not:

    <!-- doc-test: needs-gpu -->            CUDA GPUs
    <!-- doc-test: needs-network -->        downloads (pip, wget)
    <!-- doc-test: needs-gpt2-files -->     GPT-2's own encoder.json/vocab.bpe (fetched with network)
    <!-- doc-test: needs-slurm -->          sbatch / a SLURM cluster
    <!-- doc-test: needs-your-data -->      the reader's own corpus, checkpoints or paths (/data/..., DATA)
    <!-- doc-test: benchmark -->            a measurement's command (minutes of a machine; its figures name it)
    <!-- doc-test: illustration -->         a fragment, a template with placeholders, or an output record
    <!-- doc-test: setup -->                the docs tier runs it as its set-up (the quickstart)

and two markers change how a block runs:

    <!-- doc-test: continues -->            a python block run after the file's previous python blocks, in
                                            one process (it uses their names)
    <!-- doc-test: file PATH -->            the block's text is written to PATH (a plug-in, a config)

Text after the reason is a free comment. A block in another language (text, yaml, json, ...) is not code;
a block without a language is an error, so that a new command cannot slip past the tier unmarked.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[2]
SKIP_REASONS = {
    "needs-gpu",
    "needs-network",
    "needs-gpt2-files",
    "needs-slurm",
    "needs-your-data",
    "benchmark",
    "illustration",
    "setup",
}
RUN_MODES = {"continues", "file"}
CODE = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "bash", "python": "python", "py": "python"}
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(\S+)\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+)\s*([\w+-]*)\s*$")


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # the opening fence's line number, from 1
    lang: str  # "bash", "python", "" (none given) or another language
    text: str
    marker: Optional[str] = None  # a reason or a run mode
    argument: str = ""  # the marker's free text (the path of `file`)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def kind(self) -> Optional[str]:
        return CODE.get(self.lang.lower())

    @property
    def runs(self) -> bool:
        return self.kind is not None and self.marker not in SKIP_REASONS


def doc_files() -> List[Path]:
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) + sorted(ROOT.glob("examples/*/README*.md"))
    return [f for f in files if f.is_file()]


def parse(path: Path) -> List[Block]:
    """The fenced blocks of one markdown file, in order, with their markers; raises ValueError on an unclosed
    fence or an unknown marker."""
    rel = str(path.relative_to(ROOT))
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{fence}\s*$", lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(f"{rel}:{i + 1}: unclosed code fence")
        body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : j]]
        block = Block(rel, i + 1, lang, "\n".join(body) + "\n")
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mark = MARKER.match(lines[k]) if k >= 0 else None
        if mark:
            block.marker, block.argument = mark.group(1), mark.group(2)
            if block.marker not in SKIP_REASONS | RUN_MODES:
                raise ValueError(
                    f"{rel}:{k + 1}: unknown doc-test marker {block.marker!r}; one of "
                    f"{sorted(SKIP_REASONS | RUN_MODES)}"
                )
            if block.marker == "file" and not block.argument:
                raise ValueError(f"{rel}:{k + 1}: `doc-test: file` needs the path to write the block to")
        blocks.append(block)
        i = j + 1
    return blocks


def all_blocks() -> List[Block]:
    return [b for f in doc_files() for b in parse(f)]


def problems(blocks: List[Block]) -> List[str]:
    """What makes blocks neither runnable nor marked: no language, or a marker on a block that is not code."""
    out = []
    for b in blocks:
        if not b.lang:
            out.append(
                f"{b.id}: a code block without a language: write ```bash or ```python (run by "
                "tests/docs, or marked `<!-- doc-test: REASON -->` when it cannot run here), or ```text"
            )
        elif b.marker and b.kind is None:
            out.append(f"{b.id}: a doc-test marker on a ```{b.lang} block, which is never run")
        elif b.marker == "continues" and b.kind != "python":
            out.append(f"{b.id}: `doc-test: continues` is for python blocks")
    return out
