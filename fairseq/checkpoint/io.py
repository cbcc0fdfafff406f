"""Reading and writing single-file checkpoints safely.

Writes are atomic (temporary file in the same directory, fsync, rename), so a process killed during a save
leaves the previous checkpoint intact. Reads never unpickle code (`weights_only=True`) unless the user
passed --trust-legacy-checkpoint for an upstream fairseq file.
"""

import glob
import logging
import os
import pickle
import shutil
import tempfile
from typing import Any, Dict

import torch

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    pass


def _fsync_dir(path: str):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: str):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    prefix = f".{os.path.basename(path)}."
    for stale in glob.glob(os.path.join(glob.escape(directory), glob.escape(prefix) + "*.tmp")):
        os.remove(stale)  # left by a save that was killed; one writer per path, so none is in use
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def atomic_copy(src: str, dst: str):
    """Give `dst` the content of `src` atomically; a hard link when possible (no extra disk space)."""
    directory = os.path.dirname(os.path.abspath(dst))
    tmp = os.path.join(directory, f".{os.path.basename(dst)}.{os.getpid()}.tmp")
    if os.path.lexists(tmp):
        os.remove(tmp)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, dst)
    _fsync_dir(directory)


def load_checkpoint_file(path: str, trust_legacy: bool = False) -> Dict[str, Any]:
    """Load a single-file checkpoint onto the CPU.

    Files written by this project hold only tensors and plain containers and load with weights_only=True.
    Upstream fairseq files pickle argparse/omegaconf objects; they load only with `trust_legacy`.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not trust_legacy:
            raise CheckpointError(
                f"{path} contains pickled Python objects (an upstream fairseq checkpoint?), which can run "
                "arbitrary code when loaded. If you trust this file, pass --trust-legacy-checkpoint. "
                f"(torch said: {str(e).splitlines()[0]})"
            ) from None
    except (RuntimeError, EOFError, OSError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"cannot read checkpoint {path}: {type(e).__name__}: {e}. The file is truncated or not a checkpoint."
        ) from e
    logger.warning(f"loading {path} with pickle because --trust-legacy-checkpoint was given")
    return torch.load(path, map_location="cpu", weights_only=False)
