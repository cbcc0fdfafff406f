"""`from_pretrained`: the checkpoint(s) of a local model directory, loaded with their task, for the hub interface
(fairseq.hub.hub_utils.GeneratorHubInterface). Local directories only: nothing is downloaded. A transformers OPT
or XGLM directory is imported first (fairseq.export.hf_import); the --bpe files come from the caller, the model
directory or the checkpoint (fairseq.checkpoint.vocabulary.resolve_bpe).
"""

import atexit
import logging
import os
import shutil
import tempfile
from typing import Any, Dict, Optional

from fairseq.checkpoint.inference import load_checkpoint_to_cpu, load_model_ensemble_and_task, transformers_model_type
from fairseq.checkpoint.vocabulary import BPE_FILES, carried, resolve_bpe
from fairseq.export.hf_import import CHECKPOINT_NAME, import_hf
from fairseq.export.hf_names import FORK_TOKENIZER_FILES
from fairseq.registry import import_user_module

logger = logging.getLogger("fairseq.hub_utils")  # upstream's logger name: log lines read as its

# Encoder files found in a model directory -> the --bpe option that names them (applied when the chosen scheme
# has that option and it is not given; a checkpoint's carried file is used from there when the bytes are the
# same). Upstream's sentencepiece name, and GPT-2's two files (upstream fetches those from a URL); the export to
# transformers writes them under the same names.
MODEL_DIR_FILES = FORK_TOKENIZER_FILES


def from_pretrained(
    model_name_or_path: str,
    checkpoint_file: str = "model.pt",
    data_name_or_path: str = ".",
    archive_map: Optional[Dict[str, Any]] = None,
    **kwargs,
) -> Dict[str, Any]:
    """{"args": cfg, "task": task, "models": [model, ...]} for the checkpoint(s) `checkpoint_file`
    (':'-separated for an ensemble) in directory `model_name_or_path`.

    `data_name_or_path` is the directory of the dictionary (dict.txt): relative to the model directory when
    it starts with "." (upstream's convention), else a path of its own. Other keyword arguments override the
    checkpoint's options as `arg_overrides` (`bpe="gpt2"`, `gpt2_encoder_json=...`, `tokenizer="space"`,
    `max_tokens=...`); `trust_legacy_checkpoint=True` reads an upstream fairseq file, which unpickles code.
    A transformers OPT or XGLM directory (config.json, no `checkpoint_file`) is imported first (hf_import)."""
    if archive_map is not None:
        model_name_or_path = archive_map.get(model_name_or_path, model_name_or_path)
        if data_name_or_path is not None:
            data_name_or_path = archive_map.get(data_name_or_path, data_name_or_path)
        if isinstance(model_name_or_path, dict):  # upstream: an entry may also set default overrides
            for key, value in model_name_or_path.items():
                if key == "checkpoint_file":
                    checkpoint_file = value
                elif key != "path":
                    kwargs.setdefault(key, value)
            model_name_or_path = model_name_or_path["path"]
    model_path = _local_directory(model_name_or_path, "model_name_or_path", checkpoint_file)
    if _is_transformers_directory(model_path, checkpoint_file, data_name_or_path):
        return _from_transformers_directory(model_path, kwargs)
    if data_name_or_path.startswith("."):
        kwargs["data"] = os.path.abspath(os.path.join(model_path, data_name_or_path))
    else:
        kwargs["data"] = _local_directory(data_name_or_path, "data_name_or_path", "dict.txt")
    trust_legacy = bool(kwargs.pop("trust_legacy_checkpoint", False))
    if kwargs.get("user_dir"):
        import_user_module(kwargs["user_dir"])

    paths = [os.path.join(model_path, name) for name in checkpoint_file.split(os.pathsep)]
    state = load_checkpoint_to_cpu(paths[0], trust_legacy_checkpoint=trust_legacy)
    kwargs.update(_bpe_files(state, kwargs, model_path, paths[0]))
    models, cfg, task = load_model_ensemble_and_task(
        paths, arg_overrides=kwargs, state=state if len(paths) == 1 else None, trust_legacy_checkpoint=trust_legacy
    )
    return {"args": cfg, "task": task, "models": models}


def _is_transformers_directory(model_path: str, checkpoint_file: str, data_name_or_path: str) -> bool:
    """A transformers model directory (config.json with a model_type) that holds no `checkpoint_file`."""
    return (
        data_name_or_path == "."
        and not os.path.exists(os.path.join(model_path, checkpoint_file.split(os.pathsep)[0]))
        and transformers_model_type(model_path) is not None
    )


def _from_transformers_directory(model_path: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """from_pretrained on a transformers OPT or XGLM directory: imported (fairseq.export.hf_import) into a private
    directory, loaded from there. The imported weights file is removed once loaded; the small files (dict.txt, the
    --bpe files) stay until the process ends."""
    work = tempfile.mkdtemp(prefix="fairseq-from-transformers-")
    atexit.register(shutil.rmtree, work, True)
    imported = os.path.join(work, "model")
    logger.info(
        f"{model_path} is a transformers directory: importing it (scripts/import_hf.py does the same once, to disk)"
    )
    import_hf(model_path, imported)
    try:
        return from_pretrained(imported, CHECKPOINT_NAME, ".", **kwargs)
    finally:
        os.remove(os.path.join(imported, CHECKPOINT_NAME))


def _bpe_files(state, kwargs: Dict[str, Any], model_path: str, checkpoint: str) -> Dict[str, str]:
    """The --bpe file options from_pretrained passes on: the caller's keyword arguments, with files found in the
    model directory for those not given; without either, the checkpoint's --bpe and the files it carries
    (fairseq.checkpoint.vocabulary.resolve_bpe). Every file named exists, else a one-line error."""
    saved = state["cfg"].get("bpe") or {}
    name = kwargs.get("bpe", saved.get("_name"))
    options = BPE_FILES.get(name, ())
    found = {
        option: os.path.join(model_path, filename)
        for filename, option in MODEL_DIR_FILES.items()
        if option in options and os.path.isfile(os.path.join(model_path, filename))
    }
    if any(option in kwargs for option in options) or name != saved.get("_name"):  # the caller's choice
        given = {
            "_name": name,
            **(saved if name == saved.get("_name") else {}),
            **found,
            **{option: kwargs[option] for option in options if option in kwargs},
        }
        chosen = resolve_bpe(given, None, None, checkpoint, keywords=True)
    else:
        chosen = resolve_bpe(
            None,
            dict(saved, **found) if saved else None,
            carried(state),
            checkpoint,
            keywords=True,
            also_look_in=found.values(),
        )
    return {option: chosen[option] for option in options if chosen and chosen.get(option)}


def _local_directory(path: str, argument: str, expected: str) -> str:
    if os.path.isdir(path):
        return path
    if os.path.isfile(path) and path.endswith((".tar.gz", ".tgz", ".tar", ".zip")):
        raise ValueError(
            f"from_pretrained: {argument}={path!r} is an archive; extract it and pass the directory "
            f"that holds {expected}"
        )
    raise ValueError(
        f"from_pretrained: {argument}={path!r} is not a local directory; this fairseq loads models "
        f"from disk only (no downloads): pass the directory that holds {expected}"
    )
