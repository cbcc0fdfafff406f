"""GPT-2's two BPE files, read and checked: `encoder.json` (token -> id) and `vocab.bpe` (the merges in rank
order), with where to download GPT-2's own. The byte-level BPE over them is gpt2_bpe_utils (which re-exports
these names). Standard library only, so the data-preparation scripts can load it on its own.
"""

import json
import logging
import os
from typing import Dict, List, Tuple

# the name the warnings had before the readers moved here (log lines unchanged)
logger = logging.getLogger(__name__.replace("gpt2_bpe_files", "gpt2_bpe_utils"))

ENCODER_JSON_URL = "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/encoder.json"
VOCAB_BPE_URL = "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/vocab.bpe"
DICT_TXT_URL = "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/dict.txt"
DOWNLOAD_HINT = (
    f"download GPT-2's BPE files first, e.g. `mkdir -p gpt2_bpe && wget -O gpt2_bpe/encoder.json {ENCODER_JSON_URL}"
    f" && wget -O gpt2_bpe/vocab.bpe {VOCAB_BPE_URL}`, and pass their local paths"
)


def _read_text(path, what: str) -> str:
    if path is None or path == "":
        raise ValueError(f"no path given for GPT-2 BPE {what}: {DOWNLOAD_HINT}")
    path = os.fspath(path)
    if path.startswith(("http://", "https://")):
        raise ValueError(f"GPT-2 BPE {what} {path!r} is a URL; files are not downloaded here: {DOWNLOAD_HINT}")
    if not os.path.isfile(path):
        # the user's own file is missing: no advice to fetch GPT-2's, which would encode other ids
        raise FileNotFoundError(
            f"GPT-2 BPE {what} {path!r} does not exist (relative paths are read from "
            f"{os.getcwd()}); pass the {what} the data was encoded with"
        )
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(
            f"GPT-2 BPE {what} {path!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
            f"is it the right file? {DOWNLOAD_HINT}"
        ) from None


def load_encoder_json(path) -> Dict[str, int]:
    """encoder.json: one JSON object mapping each byte-level BPE token to its id (distinct ids >= 0)."""
    text = _read_text(path, "encoder.json")
    try:
        encoder = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"GPT-2 BPE encoder.json {path!r} is not valid JSON ({e}); re-download it: {ENCODER_JSON_URL}"
        ) from None
    if not isinstance(encoder, dict):
        raise ValueError(
            f"GPT-2 BPE encoder.json {path!r} must hold one JSON object (token -> id), "
            f"not a {type(encoder).__name__}; is it the right file? ({ENCODER_JSON_URL})"
        )
    seen: Dict[int, str] = {}
    for token, idx in encoder.items():
        if type(idx) is not int or not 0 <= idx < 2**32 - 1:
            raise ValueError(
                f"GPT-2 BPE encoder.json {path!r}: token {token!r} has id {idx!r}; ids must be "
                f"integers from 0 to 2**32 - 2 ({ENCODER_JSON_URL} is the expected format)"
            )
        if idx in seen:
            raise ValueError(
                f"GPT-2 BPE encoder.json {path!r}: id {idx} is given to both {seen[idx]!r} and "
                f"{token!r}; each id must name one token"
            )
        seen[idx] = token
    return encoder


def load_vocab_bpe(path) -> List[Tuple[str, str]]:
    """vocab.bpe: a `#version: ...` line, then one merge `A B` per line, in rank order.

    As upstream reads it, the text is split on newlines and the first and the last element are dropped:
    a file that does not end with a newline loses its last merge (a warning says so here). Blank lines
    are skipped; a line that is not two space-separated tokens is an error.
    """
    text = _read_text(path, "vocab.bpe")
    lines = text.split("\n")
    if not lines[0].startswith("#"):
        raise ValueError(
            f"GPT-2 BPE vocab.bpe {path!r} does not start with a '#version: 0.2' line; got "
            f"{lines[0][:80]!r}. Is it the right file? ({VOCAB_BPE_URL})"
        )
    if lines[-1] != "":
        logger.warning(
            f"GPT-2 BPE vocab.bpe {path!r} does not end with a newline: its last line "
            f"{lines[-1][:80]!r} is ignored, as upstream's reader ignores it"
        )
    merges = []
    for lineno, line in enumerate(lines[1:-1], start=2):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise ValueError(
                f"GPT-2 BPE vocab.bpe {path!r}, line {lineno}: expected two space-separated BPE "
                f"tokens (a merge), got {line[:80]!r}. Is it the right file? ({VOCAB_BPE_URL})"
            )
        merges.append((parts[0], parts[1]))
    return merges
