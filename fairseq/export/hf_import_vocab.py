"""The vocabulary of a transformers OPT / XGLM directory as this fork reads it: dict.txt and the --bpe files
(for fairseq.export.hf_import).

OPT and XGLM were trained by fairseq/metaseq, and their transformers tokenizers number tokens as those fairseq
dictionaries do: <s> <pad> </s> <unk> at 0-3, then dict.txt's lines from 4. The export (hf.py) writes the same
layout (transformers id = fairseq id). So the way back keeps every id, and what it makes is dict.txt: line i
(id i + 4) names the token of transformers id i + 4 as the fork's --bpe writes that token:

- GPT-2 BPE (OPT): transformers' `vocab.json` + `merges.txt` (or a byte-level BPE `tokenizer.json`) become
  `encoder.json` + `vocab.bpe`. The fork's BPE writes a token as its encoder.json number, which dict.txt maps
  to an id; so encoder.json gives each token its transformers id as that number and dict.txt line i is the
  number i + 4. (With a dict.txt in the directory, as the export writes one, its lines are kept, and encoder.json
  gives each token the number of its line: the GPT-2 ids the model was trained with.)
- sentencepiece (XGLM): the model file is copied as `sentencepiece.bpe.model`; transformers' XGLM gives the
  model's pieces after its first three (<unk> <s> </s>) the ids from 4, as fairseq's dict.txt made from the
  model's .vocab (upstream's `tail -n +4`) does: dict.txt lists those pieces.

Embedding rows past the tokenizer's ids are the dictionary's padding (`madeupword0000` ..., count 0, the names
fairseq-preprocess pads with; XGLM's `<madeupword0>` ... are such rows). A directory the export wrote (dict.txt
with encoder.json + vocab.bpe or sentencepiece.bpe.model) is read back as it is; dict.txt and no tokenizer file is
a model trained without --bpe.
"""

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from fairseq.data.dictionary import Dictionary
from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode, producible_tokens
from fairseq.export.hf_names import FORK_TOKENIZER_FILES, PAD
from fairseq.export.hf_sentencepiece import read_model

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq's ids 0-3, the released tokenizers' too
SPM_FILE = "sentencepiece.bpe.model"
PAD_ROWS = 128  # rows past the tokenizer's ids accepted as the padding libraries add (to a multiple of 8 .. 128)
_UNKNOWN, _CONTROL = 2, 3  # sentencepiece piece types


@dataclass
class Vocabulary:
    dictionary: Dictionary
    bpe: Optional[str]  # "gpt2", "sentencepiece" or None (a model without --bpe)
    files: Dict[str, bytes] = field(default_factory=dict)  # FORK_TOKENIZER_FILES name -> content
    source: str = ""  # the files it was made from, for the log


def read_vocabulary(hf_dir: str, model_type: str, rows: int, pad_id: int, eos_id: int) -> Vocabulary:
    """dict.txt and the --bpe files for the model of `hf_dir` whose embedding has `rows` rows. One-line errors
    name the file and what to do."""

    def path(name):
        return os.path.join(hf_dir, name)

    if (pad_id, eos_id) != (PAD, 2):
        raise ValueError(
            f"{path('config.json')}: pad_token_id {pad_id} and eos_token_id {eos_id}, where fairseq's "
            f"dictionary (and OPT's and XGLM's) has <pad> at {PAD} and </s> at 2; this model was not "
            "trained with a fairseq dictionary, which the import needs"
        )
    fork_files = {name: _read_bytes(path(name)) for name in FORK_TOKENIZER_FILES if os.path.isfile(path(name))}
    if os.path.isfile(path("dict.txt")):
        dictionary = Dictionary.load(path("dict.txt"))
        _check_rows(path("dict.txt"), len(dictionary), rows, exact=True)
        if "encoder.json" in fork_files and "vocab.bpe" in fork_files:
            return Vocabulary(
                dictionary,
                "gpt2",
                {k: fork_files[k] for k in ("encoder.json", "vocab.bpe")},
                "dict.txt, encoder.json, vocab.bpe",
            )
        if SPM_FILE in fork_files:
            return Vocabulary(dictionary, "sentencepiece", {SPM_FILE: fork_files[SPM_FILE]}, f"dict.txt, {SPM_FILE}")
        if _gpt2_source(hf_dir) is None:
            return Vocabulary(dictionary, None, {}, "dict.txt (no tokenizer files: a model without --bpe)")
        return _gpt2_vocabulary(hf_dir, rows, dictionary)
    if model_type == "opt":
        return _gpt2_vocabulary(hf_dir, rows, None)
    return _xglm_vocabulary(hf_dir, rows)


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _check_rows(where: str, size: int, rows: int, exact: bool = False) -> None:
    """The tokenizer's `size` ids fit the embedding's `rows` (up to the padding libraries add)."""
    padded = -(-size // PAD_ROWS) * PAD_ROWS
    if size > rows or (exact and size != rows) or rows > padded:
        raise ValueError(
            f"{where} has {size:,} entries but the model's embedding has {rows:,} rows (config.json "
            "vocab_size): the tokenizer files are not this model's; put the tokenizer files of the same "
            "release beside its config.json"
        )


def _dictionary(symbols: Dict[int, str], rows: int, where: str) -> Dictionary:
    """The Dictionary whose id i >= 4 is `symbols[i]`, padding rows (madeupwordNNNN, count 0) where none."""
    dictionary = Dictionary()
    fill = 0
    for i in range(len(SPECIALS), rows):
        if i in symbols:
            dictionary.add_symbol(symbols[i], 1)
        else:
            dictionary.add_symbol(f"madeupword{fill:04d}", 0)
            fill += 1
        if len(dictionary) != i + 1:
            raise ValueError(
                f"{where}: the token {symbols.get(i)!r} of id {i} is listed twice; the tokenizer files are damaged"
            )
    return dictionary


# ------------------------------------------------------------------------------------------------ GPT-2 (OPT)


def _gpt2_source(hf_dir: str) -> Optional[str]:
    for names in (("vocab.json", "merges.txt"), ("tokenizer.json",)):
        if all(os.path.isfile(os.path.join(hf_dir, n)) for n in names):
            return " + ".join(names)
    return None


def _gpt2_vocabulary(hf_dir: str, rows: int, dictionary: Optional[Dictionary]) -> Vocabulary:
    source = _gpt2_source(hf_dir)
    if source is None:
        raise FileNotFoundError(
            f"{hf_dir} has no GPT-2 tokenizer files (vocab.json + merges.txt, or tokenizer.json), "
            "which the import turns into --bpe gpt2's encoder.json and vocab.bpe; copy the "
            "tokenizer files of the same release beside config.json"
        )
    where = os.path.join(hf_dir, source.split(" + ")[0])
    vocab, merges = _read_hf_bpe(hf_dir, source)
    by_id = _tokens_by_id(vocab, where)
    _check_rows(where, max(by_id) + 1, rows)
    if tuple(by_id.get(i) for i in range(len(SPECIALS))) != (tuple(dictionary.symbols[:4]) if dictionary else SPECIALS):
        found = [by_id.get(i) for i in range(len(SPECIALS))]
        raise ValueError(
            f"{where}: ids 0-3 are {found}, not fairseq's {list(SPECIALS)}: the tokenizer was not made "
            "from a fairseq dictionary (OPT's is); the import needs one"
        )
    ranks = {tuple(m): r for r, m in enumerate(merges)}
    alphabet = list(bytes_to_unicode().values())
    lacking = [
        t for t in alphabet + list(producible_tokens(ranks, sorted(ranks, key=ranks.get), alphabet)) if t not in vocab
    ]
    if lacking:
        raise ValueError(
            f"{where} lacks {len(lacking)} token(s) its merges can output (e.g. {lacking[0]!r}): the "
            "vocabulary and merges are not one tokenizer's; copy both files of the same release"
        )
    number = (lambda i: dictionary[i]) if dictionary is not None else str
    encoder = {
        t: int(number(i))
        for t, i in vocab.items()
        if i >= len(SPECIALS) and number(i).isascii() and number(i).isdigit()
    }
    if dictionary is None:
        dictionary = _dictionary({i: number(i) for i in by_id if i >= len(SPECIALS)}, rows, where)
    files = {
        "encoder.json": json.dumps(encoder, ensure_ascii=False).encode("utf-8"),
        "vocab.bpe": ("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)).encode("utf-8"),
    }
    return Vocabulary(dictionary, "gpt2", files, source)


def _tokens_by_id(vocab: Dict[str, int], where: str) -> Dict[int, str]:
    """id -> token; each id an integer >= 0 naming one token (two tokens of one id would make dict.txt name an id
    twice, which every reader of the import refuses)."""
    by_id: Dict[int, str] = {}
    for token, i in vocab.items():
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError(
                f"{where}: token {token!r} has id {json.dumps(i)}; ids are integers >= 0: copy the "
                "tokenizer files of the same release again"
            )
        if i in by_id:
            raise ValueError(
                f"{where}: tokens {by_id[i]!r} and {token!r} share id {i}; each id names one token: "
                "copy the tokenizer files of the same release again"
            )
        by_id[i] = token
    return by_id


def _read_hf_bpe(hf_dir: str, source: str) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """(token -> id, merges in rank order) of transformers' GPT-2 tokenizer files, as `tokenizers` reads them
    (every merges.txt line but `#version` ones and blank ones; added tokens join the vocabulary)."""

    def path(name):
        return os.path.join(hf_dir, name)

    config = _json(path("tokenizer_config.json")) if os.path.isfile(path("tokenizer_config.json")) else {}
    if config.get("add_prefix_space"):
        raise ValueError(
            f"{path('tokenizer_config.json')}: add_prefix_space is set (a space put before the text), "
            "which --bpe gpt2 does not do; the ids would differ"
        )
    if source.startswith("vocab.json"):
        vocab = dict(_json(path("vocab.json")))
        with open(path("merges.txt"), encoding="utf-8") as f:
            lines = [line for line in f.read().split("\n") if line.strip() and not line.startswith("#version")]
        merges = [tuple(line.split(" ")) for line in lines]
        for token_id, token in (config.get("added_tokens_decoder") or {}).items():
            vocab.setdefault(token["content"] if isinstance(token, dict) else str(token), int(token_id))
    else:
        data = _json(path("tokenizer.json"))
        model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
        byte_level = (
            model.get("type") == "BPE"
            and pre.get("type") == "ByteLevel"
            and not pre.get("add_prefix_space")
            and pre.get("use_regex", True)
            and data.get("normalizer") is None
            and not model.get("dropout")
            and not model.get("continuing_subword_prefix")
            and not model.get("end_of_word_suffix")
        )
        if not byte_level:
            normalizer = (data.get("normalizer") or {}).get("type")
            raise ValueError(
                f"{path('tokenizer.json')} is not GPT-2's byte-level BPE (model {model.get('type')}, "
                f"pre-tokenizer {pre.get('type')}, normalizer {normalizer}), which --bpe gpt2 cannot "
                "reproduce; the import maps OPT's tokenizer only"
            )
        vocab = dict(model.get("vocab") or {})
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
        for token in data.get("added_tokens") or []:
            vocab.setdefault(token["content"], int(token["id"]))
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise ValueError(f"{hf_dir} ({source}): merge {' '.join(bad)!r} is not two tokens; copy the files again")
    return vocab, merges


def _json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); copy the file again") from None


# ------------------------------------------------------------------------------------------------ XGLM


def _xglm_vocabulary(hf_dir: str, rows: int) -> Vocabulary:
    path = os.path.join(hf_dir, SPM_FILE)
    if not os.path.isfile(path):
        also = (
            " (tokenizer.json alone is not enough: --bpe sentencepiece reads the model file)"
            if os.path.isfile(os.path.join(hf_dir, "tokenizer.json"))
            else ""
        )
        raise FileNotFoundError(
            f"{path}: no such file{also}; copy the model's {SPM_FILE} of the same release beside config.json"
        )
    pieces = read_model(path)["pieces"]
    kinds = tuple(kind for _, _, kind in pieces[:3])
    if kinds != (_UNKNOWN, _CONTROL, _CONTROL):
        raise ValueError(
            f"{path} does not start with <unk> <s> </s> as XGLM's does (piece types {kinds}); the ids "
            "transformers' XGLM gives its pieces would not be fairseq's"
        )
    _check_rows(path, len(pieces) + 1, rows)
    symbols = {i + 1: piece for i, (piece, _, _) in enumerate(pieces) if i >= 3}
    return Vocabulary(_dictionary(symbols, rows, path), "sentencepiece", {SPM_FILE: _read_bytes(path)}, SPM_FILE)
