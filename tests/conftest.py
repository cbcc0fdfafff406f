"""Fixtures for integration tests: a tiny corpus preprocessed by the real fairseq-preprocess."""

import random

import pytest


def write_corpus(path, num_lines, seed, vocab=60, min_len=3, max_len=25):
    """Deterministic pseudo-text: words drawn from a skewed vocabulary so a model can learn something."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)]
    weights = [1.0 / (i + 1) for i in range(vocab)]
    with open(path, "w") as f:
        for _ in range(num_lines):
            n = rng.randint(min_len, max_len)
            f.write(" ".join(rng.choices(words, weights, k=n)) + "\n")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A preprocessed language-modeling data directory (train/valid/test) made by fairseq-preprocess."""
    from fairseq_cli.preprocess import cli_main

    root = tmp_path_factory.mktemp("tiny")
    text = root / "text"
    text.mkdir()
    write_corpus(text / "train.txt", 400, seed=1)
    write_corpus(text / "valid.txt", 40, seed=2)
    write_corpus(text / "test.txt", 40, seed=3)
    dest = root / "data-bin"
    cli_main([
        "--only-source", "--trainpref", str(text / "train.txt"), "--validpref", str(text / "valid.txt"),
        "--testpref", str(text / "test.txt"), "--destdir", str(dest), "--workers", "1",
    ])
    return dest
