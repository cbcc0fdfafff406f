"""What a checkpoint carries about its text: its dictionary's fingerprint and its --bpe files themselves.

Every checkpoint the trainer writes (a single file, or a sharded directory's metadata.pt) has the top-level key
`vocabulary`, plain values only (it loads with `torch.load(weights_only=True)`):

    {"dictionary_sha256": sha256 of the dictionary's symbols in order, "dictionary_size": int,
     "bpe": None or {"_name": "gpt2", "files": {"gpt2_encoder_json": {"name": "encoder.json",
                                                                      "path": its absolute path at training,
                                                                      "content": bytes}, ...}}}

Consumers (generate, interactive, eval-lm, validate, the hub, the export, resume) compare the dictionary they
read with the fingerprint (`check_dictionary`) and take the checkpoint's --bpe through `resolve_bpe`, the one
place that falls back to it: the carried files are used, so a checkpoint moved alone keeps its tokenizer.
Checkpoints without the key (older ones, upstream's) keep the size check and their saved paths.
"""

import atexit
import dataclasses
import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any, Dict, Iterable, Optional

from fairseq.checkpoint.io import CheckpointError
from fairseq.registry import config_name
from fairseq.data.encoders.bpe_file_check import WHAT, bpe_file_problem

KEY = "vocabulary"

# The options of each --bpe scheme that name a file (what a checkpoint carries).
BPE_FILES = {"gpt2": ("gpt2_encoder_json", "gpt2_vocab_bpe"), "sentencepiece": ("sentencepiece_model",)}


def flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def bpe_options(cfg) -> Optional[Dict[str, Any]]:
    """A --bpe config as a plain dict (`_name` and its options), None when no scheme is chosen: the one reading of
    the shapes it comes in (a config dataclass, a dict or DictConfig of keyword arguments or a saved config, an
    argparse namespace)."""
    if cfg is None:
        return None
    if dataclasses.is_dataclass(cfg):
        options = {**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, "_name": config_name(cfg)}
    elif isinstance(cfg, Mapping):
        options = {key: cfg.get(key) for key in cfg.keys()}
    else:
        name = config_name(cfg)
        options = {"_name": name, **{o: vars(cfg).get(o) for o in BPE_FILES.get(name, ())}}
    return None if options.get("_name") in (None, "none") else options


# ------------------------------------------------------------------------------------------ files


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{what}: no such file (relative paths are read from {os.getcwd()}); "
            "pass the file the data was encoded with"
        ) from None
    except OSError as e:
        raise ValueError(f"{what}: cannot be read ({e.strerror}); pass a readable file") from None


def check_bpe_flags(bpe: Optional[Dict[str, Any]]) -> None:
    """A chosen --bpe (`bpe_options` of the command line's or keyword arguments; None: none) names each file it
    needs (validate(cfg): no file is read). One-line error naming the flag and the fix."""
    name = (bpe or {}).get("_name")
    for option in BPE_FILES.get(name, ()):
        if not bpe.get(option):
            raise ValueError(f"--bpe {name} needs {flag(option)} PATH (the file the data was encoded with)")


def check_bpe_files(cfg) -> None:
    """Start-up check of a chosen --bpe (a config, as `bpe_options` reads it): each file it needs is named,
    readable and loads (checkpoints carry the files: a bad one would break every consumer). One-line error
    naming the flag, the path and the fix."""
    bpe = bpe_options(cfg)
    check_bpe_flags(bpe)
    for option in BPE_FILES.get((bpe or {}).get("_name"), ()):
        path = bpe[option]
        _read(str(path), f"{flag(option)} {path}")
        problem = bpe_file_problem(option, str(path))
        if problem:
            raise ValueError(
                f"{flag(option)} {path}: not a usable {WHAT[option]}: {problem}; pass the "
                f"{WHAT[option]} the data was encoded with"
            )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------ the record


def dictionary_sha256(dictionary) -> str:
    """The fingerprint of a dictionary: sha256 of its symbols in id order (counts do not matter)."""
    digest = hashlib.sha256()
    for symbol in dictionary.symbols:
        digest.update(symbol.encode("utf-8") + b"\n")
    return digest.hexdigest()


def make_record(dictionary, bpe_cfg) -> Dict[str, Any]:
    """The `vocabulary` entry of the checkpoints of a run: the dictionary's fingerprint and the content of
    the --bpe files (read once, at start-up: later changes to the files do not reach the checkpoints)."""
    record: Dict[str, Any] = {"dictionary_sha256": None, "dictionary_size": None, "bpe": None}
    if dictionary is not None:
        record.update(dictionary_sha256=dictionary_sha256(dictionary), dictionary_size=len(dictionary))
    bpe = bpe_options(bpe_cfg) or {}
    name = bpe.get("_name")
    if name in BPE_FILES:
        files = {}
        for option in BPE_FILES[name]:
            path = str(bpe.get(option))
            files[option] = {
                "name": os.path.basename(path),
                "path": os.path.abspath(path),
                "content": _read(path, f"{flag(option)} {path}"),
            }
        record["bpe"] = {"_name": name, "files": files}
    return record


def carried(state) -> Optional[Dict[str, Any]]:
    """The `vocabulary` entry of a checkpoint's state (or of a ShardedCheckpoint), None when it has none."""
    record = state.get(KEY) if isinstance(state, dict) else getattr(state, KEY, None)
    return record if isinstance(record, dict) else None


def check_dictionary(checkpoint: str, record: Optional[Dict[str, Any]], dictionary) -> None:
    """A dictionary other than the one `checkpoint` was trained with (same size or not) is an error naming
    both; a checkpoint without a fingerprint is not checked here (the embedding sizes still are)."""
    expected = (record or {}).get("dictionary_sha256")
    if not expected or dictionary is None or dictionary_sha256(dictionary) == expected:
        return

    size, here = record.get("dictionary_size"), len(dictionary)
    detail = (
        f"both have {here:,} entries, but the symbols or their order differ"
        if size == here
        else f"{size:,} entries there, {here:,} here"
    )
    where = getattr(dictionary, "path", None) or "the dictionary given"
    raise CheckpointError(
        f"{where} is not the dictionary {checkpoint} was trained with ({detail}), so its ids "
        "would name other words; use the dict.txt the model was trained with"
    )


# ------------------------------------------------------------------------------------------ the one fallback


def _how_to_pass(name: str, keywords: bool) -> str:
    options = BPE_FILES.get(name, ())
    if keywords:
        return ", ".join([f"bpe={name!r}"] + [f"{o}=PATH" for o in options])
    return " ".join([f"--bpe {name}"] + [f"{flag(o)} PATH" for o in options])


def resolve_bpe(
    given,
    saved_bpe,
    record: Optional[Dict[str, Any]],
    checkpoint: str,
    keywords: bool = False,
    also_look_in: Iterable[str] = (),
) -> Optional[Dict[str, Any]]:
    """The --bpe (a dict: `_name` and options) a consumer of `checkpoint` uses: `given` (the command line's or
    keyword arguments) when set; else the checkpoint's saved --bpe `saved_bpe` with the files it carries
    (`record`), else (older checkpoints) with its saved paths; None when it has none. Every file named exists,
    else a one-line FileNotFoundError naming it and how to pass one (`keywords`: as from_pretrained's keyword
    arguments). A carried file is used from the saved path or a path in `also_look_in` that holds the same
    bytes, else from a private copy written for this process."""
    if given is not None:
        check_bpe_files(given)
        return bpe_options(given)
    saved = bpe_options(saved_bpe)
    if saved is None:
        return None
    name = saved["_name"]
    carried_bpe = (record or {}).get("bpe") or {}
    files = (carried_bpe.get("files") or {}) if carried_bpe.get("_name") == name else {}
    for option in BPE_FILES.get(name, ()):
        path = saved.get(option)
        if option in files:
            saved[option] = _materialized(files[option], [path, *also_look_in])
            _check_carried(checkpoint, option, files[option], saved[option], _how_to_pass(name, keywords))
        elif not path or not os.path.isfile(str(path)):
            raise FileNotFoundError(
                f"{checkpoint} was trained with --bpe {name} and {flag(option)} {path}, which is not found from "
                f"{os.getcwd()} (the checkpoint stores its path, not the file); pass {_how_to_pass(name, keywords)}"
            )
    return saved


def _check_carried(checkpoint: str, option: str, entry: Dict[str, Any], path: str, how: str) -> None:
    problem = bpe_file_problem(option, path)
    if problem:
        raise ValueError(
            f"{checkpoint} carries a bad {flag(option)} file ({entry.get('name')}, from "
            f"{entry.get('path')} at training: {problem}), so its copy cannot be used; "
            f"override it: pass {how} (the {WHAT[option]} the data was encoded with)"
        )


_private_dir: Optional[str] = None


def _materialized(entry: Dict[str, Any], candidates: Iterable[Optional[str]]) -> str:
    content = bytes(entry["content"])
    digest = _sha256(content)
    for candidate in candidates:
        if candidate and os.path.isfile(str(candidate)) and _file_sha256(str(candidate)) == digest:
            return str(candidate)
    global _private_dir
    if _private_dir is None:  # one directory per process, removed when it ends
        _private_dir = tempfile.mkdtemp(prefix="fairseq-tokenizer-")
        atexit.register(shutil.rmtree, _private_dir, True)
    directory = os.path.join(_private_dir, digest[:16])
    path = os.path.join(directory, os.path.basename(entry.get("name") or "file"))
    if not os.path.isfile(path):
        os.makedirs(directory, exist_ok=True)
        with open(path, "wb") as f:
            f.write(content)
    return path


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
