"""JSONL corpora for the streaming-task tests: DATA/{train,valid}/00/<corpus>.jsonl of pseudo-text documents."""

import json
import random


def write_jsonl_corpora(
    root, corpora=("web", "books"), docs=200, valid_docs=10, seed=0, vocab=40, max_lines=4, max_words=12
):
    """Documents of 1..max_lines lines of w<i> words; also DATA/dict.txt listing the words (no --bpe)."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)]

    def doc():
        return "\n".join(
            " ".join(rng.choices(words, k=rng.randint(1, max_words))) for _ in range(rng.randint(1, max_lines))
        )

    for split, n in (("train", docs), ("valid", valid_docs)):
        (root / split / "00").mkdir(parents=True, exist_ok=True)
        for corpus in corpora:
            with open(root / split / "00" / f"{corpus}.jsonl", "w") as f:
                for _ in range(n):
                    f.write(json.dumps({"text": doc()}) + "\n")
    (root / "dict.txt").write_text("".join(f"{w} 1\n" for w in words))
    return root
