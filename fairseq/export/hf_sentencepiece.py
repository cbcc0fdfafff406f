"""A sentencepiece model as a `tokenizers.Tokenizer` with fairseq dictionary ids (see hf_tokenizer.py).

The .model file is a protobuf `ModelProto`; the few fields needed are read here with a small wire-format
reader (no protobuf package):

- pieces (field 1): piece text (1), score (2), type (3: 1 normal, 2 unknown, 3 control, 4 user-defined,
  5 unused, 6 byte);
- trainer_spec (2): model_type (3: 1 unigram, 2 bpe), treat_whitespace_as_suffix (24), byte_fallback (35);
- normalizer_spec (3): precompiled_charsmap (2), add_dummy_prefix (3), remove_extra_whitespaces (4),
  escape_whitespaces (5); the three flags default to true.

Encoding as sentencepiece's BPE does it: the charsmap normalization, leading/trailing spaces removed and
runs of spaces made one, a space put in front, spaces written as U+2581; then the pieces are formed by
repeatedly merging the adjacent pair whose concatenation is the best-scoring piece (written as merges ranked by
that score: each piece's splits into two pieces); a run of unknown characters is one <unk>. fairseq then
splits the pieces' text on whitespace (`str.split`): an unknown whitespace character (U+2028, U+0085, ...)
vanishes, which the tokenizer does by splitting the text there.

Refused: unigram models (transformers' Unigram breaks ties between equally scored segmentations, e.g. in runs
of one character, unlike sentencepiece's), user-defined pieces, byte fallback, whitespace as suffix, unescaped
whitespace, and whitespace characters inside pieces.
"""

import struct
from typing import Dict, List, Tuple

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from fairseq.data.dictionary import Dictionary
from fairseq.export.hf_vocab import missing_error, special_symbols

SPACE = "\u2581"
NORMAL, USER_DEFINED = 1, 4  # piece types
UNIGRAM, BPE = 1, 2


def _fields(data: bytes):
    """(field number, wire type, value) of one protobuf message; value: int, bytes or raw fixed-size bytes."""
    i, n = 0, len(data)

    def varint():
        nonlocal i
        shift = result = 0
        while True:
            b = data[i]
            i += 1
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result
            shift += 7

    while i < n:
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, wire, varint()
        elif wire == 1:
            yield number, wire, data[i : i + 8]
            i += 8
        elif wire == 2:
            size = varint()
            yield number, wire, data[i : i + size]
            i += size
        elif wire == 5:
            yield number, wire, data[i : i + 4]
            i += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def read_model(path: str) -> dict:
    """The fields of a sentencepiece .model file that the tokenizer needs."""
    with open(path, "rb") as f:
        data = f.read()
    model = {
        "pieces": [],
        "model_type": UNIGRAM,
        "byte_fallback": False,
        "whitespace_suffix": False,
        "charsmap": b"",
        "dummy_prefix": True,
        "remove_extra_whitespaces": True,
        "escape_whitespaces": True,
    }
    try:
        for number, _, value in _fields(data):
            if number == 1:
                piece, score, kind = "", 0.0, NORMAL
                for n, _, v in _fields(value):
                    if n == 1:
                        piece = v.decode("utf-8")
                    elif n == 2:
                        score = struct.unpack("<f", v)[0]
                    elif n == 3:
                        kind = v
                model["pieces"].append((piece, score, kind))
            elif number == 2:
                for n, _, v in _fields(value):
                    if n == 3:
                        model["model_type"] = v
                    elif n == 24:
                        model["whitespace_suffix"] = bool(v)
                    elif n == 35:
                        model["byte_fallback"] = bool(v)
            elif number == 3:
                for n, _, v in _fields(value):
                    key = {2: "charsmap", 3: "dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}
                    if n in key:
                        model[key[n]] = v if n == 2 else bool(v)
    except (IndexError, UnicodeDecodeError, ValueError, struct.error) as e:
        raise ValueError(f"--sentencepiece-model {path} is not a sentencepiece model file ({e})") from None
    if not model["pieces"]:
        raise ValueError(f"--sentencepiece-model {path} holds no pieces; is it a sentencepiece .model file?")
    return model


def _refuse(path: str, what: str) -> ValueError:
    return ValueError(
        f"--sentencepiece-model {path}: {what} has no exact transformers tokenizer here; export with --no-tokenizer"
    )


def sentencepiece_tokenizer(path: str, dictionary: Dictionary):
    """(tokenizers.Tokenizer, special symbols) for sentencepiece model `path` with `dictionary` ids.

    Every normal piece must be a dict.txt entry (fairseq looks pieces up there); the unknown piece is <unk>;
    dict.txt entries that are not pieces would be surface text that sentencepiece passes through for unknown
    characters, which fairseq gives their own id and a tokenizer cannot: both are refused."""
    model = read_model(path)
    _check_supported(path, model)
    specials = special_symbols(dictionary)
    ids, normal = _piece_ids(path, model, dictionary, specials)
    unk = dictionary[dictionary.unk()]  # sentencepiece's unknown piece: fairseq finds no such entry
    tokenizer = Tokenizer(
        models.BPE(vocab=ids, merges=_merges(normal), unk_token=unk, fuse_unk=True, dropout=None, byte_fallback=False)
    )
    _set_text_steps(tokenizer, path, model, normal)
    # fairseq's decoding: pieces joined, U+2581 read as a space, the ends stripped.
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.Fuse(), decoders.Strip(" ", 1, 1)])
    return tokenizer, specials


def _check_supported(path: str, model: dict) -> None:
    """A one-line refusal for what no transformers tokenizer reproduces exactly (the module's docstring)."""
    if model["model_type"] == UNIGRAM:
        raise _refuse(
            path,
            "a unigram model (transformers' Unigram breaks ties between equally scored "
            "segmentations differently from sentencepiece, e.g. in runs of one character)",
        )
    if model["model_type"] != BPE:
        raise _refuse(path, f"model type {model['model_type']} (word or char)")
    for flag, refused in (
        ("--byte_fallback", model["byte_fallback"]),
        ("--treat_whitespace_as_suffix", model["whitespace_suffix"]),
        ("escape_whitespaces off", not model["escape_whitespaces"]),
    ):
        if refused:
            raise _refuse(path, flag)
    if any(kind == USER_DEFINED for _, _, kind in model["pieces"]):
        raise _refuse(path, "a user-defined piece")


def _piece_ids(path: str, model: dict, dictionary: Dictionary, specials: List[str]):
    """(piece or special symbol -> its dictionary id, normal piece -> its score); every normal piece must be a
    dict.txt entry and every entry a piece or a special symbol."""
    ids: Dict[str, int] = {}
    missing: List[Tuple[str, str]] = []
    normal = {}
    for piece, score, kind in model["pieces"]:
        if kind == NORMAL:
            normal[piece] = score
            if piece in dictionary.indices:
                ids[piece] = dictionary.index(piece)
            else:
                missing.append((piece, piece))
    if missing:
        raise missing_error("the sentencepiece model", missing, len(normal), dictionary.path)
    strays = [s for s in dictionary.symbols if s not in ids and s not in specials]
    if strays:
        raise ValueError(
            f"dict.txt entry {strays[0]!r} ({len(strays)} in all) is no piece of {path}: fairseq gives "
            "such text (unknown characters sentencepiece passes through) its own id, a transformers "
            "tokenizer gives <unk>; export with --no-tokenizer, or use a dict.txt made from the "
            "model's pieces"
        )
    for symbol in specials:  # in the vocabulary so that they decode; never produced from text
        ids[symbol] = dictionary.index(symbol)
    return ids, normal


def _merges(normal: Dict[str, float]) -> List[Tuple[str, str]]:
    """Each piece's splits into two pieces, ranked by the piece's score (best first)."""
    ranked = []
    for piece, score in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, left, right))
    return [(left, right) for _, left, right in sorted(ranked)]


def _set_text_steps(tokenizer, path: str, model: dict, normal: Dict[str, float]) -> None:
    """The tokenizer's normalizer (sentencepiece's, as the model's flags say) and its split at the whitespace
    fairseq splits pieces on."""
    steps = []
    if model["charsmap"]:
        steps.append(normalizers.Precompiled(model["charsmap"]))
    if model["remove_extra_whitespaces"]:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if model["dummy_prefix"]:
        steps.append(normalizers.Prepend(" "))
    if model["escape_whitespaces"]:
        steps.append(normalizers.Replace(" ", SPACE))
    if steps:
        tokenizer.normalizer = normalizers.Sequence(steps)
    # Whitespace (for str.split) other than the escaped space: not inside any piece, so always unknown text.
    spaces = [c for c in map(chr, range(0x110000)) if c.isspace() and c != " "]
    inside = next((p for p in normal if any(c in p for c in spaces)), None)
    if inside is not None:
        raise _refuse(path, f"the piece {inside!r}, which holds whitespace that fairseq splits on,")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[" + "".join(spaces) + "]"), behavior="removed")
