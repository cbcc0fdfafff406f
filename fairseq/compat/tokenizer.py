"""Upstream's `fairseq.tokenizer`: the whitespace tokenizer of dict.txt building and binarization."""

import re

from fairseq.data.dictionary import tokenize_line  # noqa: F401 (the one implementation)

SPACE_NORMALIZER = re.compile(r"\s+")
