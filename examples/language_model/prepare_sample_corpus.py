#!/usr/bin/env python3
"""Write a small language-modeling corpus (train.txt, valid.txt, test.txt) from text shipped with Python.

The source is the standard library's `pydoc_data.topics` (the help texts behind `help("if")`, ...), so
no download is needed and no third-party text is committed. Each output line is one paragraph,
lowercased, with punctuation split from words. The output is byte-identical from run to run for a given
Python version (the help texts themselves change between versions).

Usage: python examples/language_model/prepare_sample_corpus.py OUTDIR
"""

import argparse
import os
import re
import sys

TOKEN = re.compile(r"\w+|[^\w\s]")
PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
# Every 10th paragraph goes to valid, the next one to test: spread evenly over all topics.
HELD_OUT_EVERY = 10


def paragraphs():
    from pydoc_data.topics import topics

    for name in sorted(topics):
        for para in PARAGRAPH_BREAK.split(topics[name]):
            tokens = TOKEN.findall(para.lower())
            if tokens:
                yield " ".join(tokens)


def split_of(i: int) -> str:
    if i % HELD_OUT_EVERY == 0:
        return "valid"
    if i % HELD_OUT_EVERY == 1:
        return "test"
    return "train"


def write_corpus(outdir: str) -> dict:
    """Write the three files; returns {split: number of lines}."""
    os.makedirs(outdir, exist_ok=True)
    lines = {"train": [], "valid": [], "test": []}
    for i, para in enumerate(paragraphs()):
        lines[split_of(i)].append(para)
    for split, rows in lines.items():
        path = os.path.join(outdir, f"{split}.txt")
        tmp = path + ".part"
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write("\n".join(rows) + "\n")
        os.replace(tmp, path)
    return {split: len(rows) for split, rows in lines.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", help="directory to write train.txt, valid.txt and test.txt into")
    args = parser.parse_args(argv)
    counts = write_corpus(args.outdir)
    for split, n in counts.items():
        print(f"{os.path.join(args.outdir, split + '.txt')}: {n} lines")


if __name__ == "__main__":
    sys.exit(main())
