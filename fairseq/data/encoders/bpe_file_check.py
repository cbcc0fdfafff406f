"""Whether the content of a --bpe file loads: fairseq-train checks its --bpe files at start-up (every checkpoint
carries a copy of them), and a consumer checks the copy a checkpoint carries before using it."""

import json
from typing import Optional

from fairseq.data.encoders.gpt2_bpe_files import load_encoder_json, load_vocab_bpe

WHAT = {
    "gpt2_encoder_json": "GPT-2 BPE encoder.json",
    "gpt2_vocab_bpe": "GPT-2 BPE vocab.bpe",
    "sentencepiece_model": "sentencepiece .model file",
}


def bpe_file_problem(option: str, path: str) -> Optional[str]:
    """What keeps the readable file `path`, given as the --bpe option `option`, from loading as that file: a
    short reason without a fix (the caller knows which fix applies); None when it loads."""
    if option == "sentencepiece_model":
        return _sentencepiece_problem(path)
    if option not in ("gpt2_encoder_json", "gpt2_vocab_bpe"):
        return None
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 text ({e.reason} at byte {e.start})"
    if not text.strip():
        return "empty"
    if option == "gpt2_encoder_json":
        try:
            if not isinstance(json.loads(text), dict):
                return "not one JSON object (token -> id)"
        except json.JSONDecodeError as e:
            return f"not valid JSON ({e})"
    elif not text.startswith("#"):
        return f"does not start with a '#version: 0.2' line (got {text.splitlines()[0][:40]!r})"
    try:
        (load_encoder_json if option == "gpt2_encoder_json" else load_vocab_bpe)(path)
    except ValueError as e:
        return str(e)
    return None


def _sentencepiece_problem(path: str) -> Optional[str]:
    try:
        import sentencepiece as spm  # deferred: optional (absent: the encoder's loader says to install it)
    except ImportError:  # the encoder's own loader says how to install it
        return None
    try:
        spm.SentencePieceProcessor().Load(path)
    except (OSError, RuntimeError) as e:
        reason = str(e).strip() or type(e).__name__
        return f"sentencepiece cannot load it ({reason}); a .model file written by spm_train is needed, not the .vocab"
    return None
