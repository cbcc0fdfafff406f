"""Reading and writing single-file checkpoints safely.

Writes are atomic (temporary file in the same directory, fsync, rename), so a process killed during a save
leaves the previous checkpoint intact; a failed write (disk full, file-size limit, permissions) becomes one
CheckpointSaveError naming the path and the errno. Reads never unpickle code (`weights_only=True`) unless the
user passed --trust-legacy-checkpoint for an upstream fairseq file, and tell a truncated file, a file that is
not a checkpoint at all and an upstream pickle apart. What is saved is plain data (`check_plain`), so that it
loads that way.
"""

import errno
import glob
import logging
import os
import pickle
import tempfile
import zipfile
from collections import OrderedDict
from typing import Any, Dict, List, Optional

import torch

from fairseq.data.encoders._write_errors import os_error_message  # noqa: F401 (its importers)
from fairseq.runtime.errors import UserError

logger = logging.getLogger(__name__)

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6
PICKLE_MAGIC = b"\x80"  # torch's format before 1.6 (old upstream checkpoints): a pickle, protocol >= 2


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be read or written: the message names the file and what to do."""


class CorruptCheckpointError(CheckpointError):
    """The file exists but is truncated or damaged (as opposed to: of another kind, or untrusted)."""


class NotACheckpointError(CheckpointError):
    """The file is neither a zip archive nor a pickle: garbage, or the wrong path."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed; the checkpoint previously at that path is intact."""


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


def default_file_mode() -> int:
    """The mode an ordinary `open(path, "w")` would give (0666 less the umask): checkpoint files and DCP shards
    get the same permissions, not mkstemp's private 0600."""
    try:  # read without changing it: os.umask(0) would briefly affect files other threads create
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0)
        os.umask(mask)
    return 0o666 & ~mask


def save_error(
    path: str,
    err: OSError,
    previous_intact: bool = True,
    what: str = "cannot write checkpoint",
    flag: str = "--save-dir",
) -> CheckpointSaveError:
    """A failed checkpoint write as one CheckpointSaveError (os_error_message; `flag` names the path's option)."""
    kept = "; the checkpoint previously at that path is intact" if previous_intact else ""
    return CheckpointSaveError(os_error_message(path, err, what, flag, kept))


class _ErrorRecordingWriter:
    """A file wrapper that remembers the first OSError of a write: torch.save turns it into an unreadable
    'unexpected pos' RuntimeError, and the errno is what the user needs to see."""

    def __init__(self, f):
        self.f = f
        self.error: Optional[OSError] = None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self):
        return self.f.flush()


def _make_dirs(directory: str, path: str, flag: str):
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise save_error(path, err, previous_intact=False, flag=flag) from None


def _remove_stale_temporaries(directory: str, prefix: str):
    # Left by a save that was killed; the --save-dir lock guarantees one writer, so none is in use.
    for stale in glob.glob(os.path.join(glob.escape(directory), glob.escape(prefix) + "*.tmp")):
        try:
            os.remove(stale)
        except OSError:
            pass


class PendingFile:
    """A file written under a temporary name beside `path` (fsynced), not yet in place: `commit()` renames it
    into place; `discard()` removes it. A save's bytes and its publication are two steps
    (fairseq.checkpoint.writer.Write)."""

    def __init__(self, path: str, tmp: str, flag: str):
        self.path, self.tmp, self.flag = path, tmp, flag

    def commit(self) -> None:
        try:
            os.replace(self.tmp, self.path)
        except BaseException as err:
            self.discard()
            if isinstance(err, OSError) and err.errno is not None:
                raise save_error(self.path, err, flag=self.flag) from None
            raise
        _fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def discard(self) -> None:
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def write_temporary(path: str, write_fn, flag: str = "--save-dir") -> PendingFile:
    """Create a temporary file beside `path` and let `write_fn(file)` fill it, then fsync it; returns it pending
    (its rename into place is the caller's `commit()`)."""
    directory = os.path.dirname(os.path.abspath(path))
    _make_dirs(directory, path, flag)
    prefix = f".{os.path.basename(path)}."
    _remove_stale_temporaries(directory, prefix)
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
    except OSError as err:
        raise save_error(path, err, flag=flag) from None
    writer = None
    try:
        os.fchmod(fd, default_file_mode())
        with os.fdopen(fd, "wb") as f:
            writer = _ErrorRecordingWriter(f)
            write_fn(writer)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        os_error = (writer.error if writer is not None else None) or (err if isinstance(err, OSError) else None)
        if os_error is not None and os_error.errno is not None:
            raise save_error(path, os_error, flag=flag) from None
        raise
    return PendingFile(path, tmp, flag)


def _write_atomically(path: str, write_fn, flag: str = "--save-dir"):
    """Create a temporary file beside `path`, let `write_fn(file)` fill it, fsync and rename it into place."""
    write_temporary(path, write_fn, flag).commit()


def torch_save_temporary(obj: Any, path: str, flag: str = "--save-dir") -> PendingFile:
    """torch.save `obj` beside `path` under a temporary name; `commit()` puts it in place (`flag`: the option
    that named `path`, for the error of a failed write)."""
    return write_temporary(path, lambda f: torch.save(obj, f), flag)


# What a checkpoint holds: tensors (DTensors included) in these containers, and these scalars. Exact types: an
# IntEnum is an int and a namedtuple a tuple, but both pickle as objects of their class, which weights_only=True
# refuses (and torch 2.11's checkpoint stager cannot copy). OrderedDict is what nn.Module.state_dict() returns.
PLAIN_SCALARS = (int, float, bool, str, bytes, type(None))
PLAIN_CONTAINERS = (dict, OrderedDict, list, tuple)


def non_plain_entries(state: Any, where: str = "state", limit: int = 5) -> List[str]:
    """'where is what' for the first `limit` entries of `state` (depth first) that are neither tensors, plain
    containers nor plain scalars, or dict keys other than str and int; [] when the whole state is plain."""
    found: List[str] = []
    pending = [(where, state)]
    while pending and len(found) < limit:
        path, value = pending.pop()
        kind = type(value)
        if isinstance(value, torch.Tensor) or kind in PLAIN_SCALARS:
            continue
        if kind in (dict, OrderedDict):
            for key in reversed(list(value)):
                if type(key) not in (str, int):
                    found.append(f"{path} has the key {key!r} of type {type(key).__qualname__}")
                pending.append((f"{path}.{key}", value[key]))
        elif kind in (list, tuple):
            pending += [(f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value)))]
        else:
            what = "a class" if isinstance(value, type) else f"of type {kind.__module__}.{kind.__qualname__}"
            found.append(f"{path} is {what} ({value!r:.60})")
    return found[:limit]


def check_plain(state: Any, path: str, where: str = "state") -> None:
    """Refuse to save `state` to `path` (CheckpointSaveError naming the entries, `where` their root) unless it
    is plain data."""
    bad = non_plain_entries(state, where)
    if bad:
        raise CheckpointSaveError(
            f"cannot save {path}: {'; '.join(bad)}. A checkpoint holds tensors, dict/list/tuple and "
            "int/float/bool/str/bytes/None only (it loads with weights_only=True): the state_dict() that returned "
            "these entries must return plain values"
        )


def atomic_torch_save(obj: Any, path: str, flag: str = "--save-dir"):
    """torch.save `obj` to `path` atomically; `flag`: the option that named `path`, for the error of a failed
    write."""
    torch_save_temporary(obj, path, flag).commit()


def torch_save_raising_os_errors(obj: Any, path: str) -> None:
    """torch.save `obj` to `path` (in place: for a file of a directory assembled aside and renamed whole); a
    failed write raises its OSError (torch reports it as an "unexpected pos" RuntimeError), for the caller to
    word naming its own output."""
    with open(path, "wb") as f:
        writer = _ErrorRecordingWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise


def atomic_copy(src: str, dst: str):
    """Give `dst` the content of `src` atomically, as an independent file (never a hard link: writing to one
    name must not change another). The bytes are copied in the kernel (copy_file_range), which on file
    systems with reflinks (XFS, btrfs, ...) shares blocks copy-on-write and costs no extra space or time."""

    def copy(writer):
        with open(src, "rb") as source:
            out = writer.f
            out.flush()
            size = os.fstat(source.fileno()).st_size
            copied = 0
            try:
                while copied < size:
                    n = os.copy_file_range(source.fileno(), out.fileno(), size - copied)
                    if n == 0:
                        break
                    copied += n
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP) or copied:
                    writer.error = err
                    raise
                copied = 0  # not supported between these files: copy through user space
            if copied < size:
                source.seek(copied)
                out.seek(copied)
                while True:
                    chunk = source.read(1 << 24)
                    if not chunk:
                        break
                    writer.write(chunk)

    _write_atomically(dst, copy)


def _head(path: str, n: int = 4) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _corrupt(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"cannot read checkpoint {path}: {what}")


def checkpoint_file_looks_intact(path: str) -> bool:
    """Cheap check without reading the tensors: a complete zip archive (its central directory, written last, is
    present) with torch's pickle inside."""
    try:
        if _head(path) != ZIP_MAGIC:
            return False
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def load_checkpoint_file(path: str, trust_legacy: bool = False) -> Dict[str, Any]:
    """Load a single-file checkpoint onto the CPU.

    Files written by this project hold only tensors and plain containers and load with weights_only=True.
    Upstream fairseq files pickle argparse/omegaconf objects; they load only with `trust_legacy`.
    Raises CorruptCheckpointError for a truncated or damaged file, NotACheckpointError for one that is not a
    checkpoint and CheckpointError for one that needs --trust-legacy-checkpoint.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if os.path.getsize(path) == 0:
        raise _corrupt(path, "the file is empty (truncated: a save that did not finish, or a failed copy)")
    head = _head(path)
    if head == ZIP_MAGIC:
        if not zipfile.is_zipfile(path):  # the central directory is written last: a truncated archive lacks it
            raise _corrupt(
                path,
                "the file is truncated (its zip archive has no end); it was cut short by a failed copy or a full disk",
            )
    elif not head.startswith(PICKLE_MAGIC):
        raise NotACheckpointError(
            f"{path} is not a checkpoint: it starts with bytes {head!r}, neither a zip archive (torch.save since "
            "torch 1.6) nor a pickle (older torch); check the path"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not trust_legacy:
            raise CheckpointError(
                f"{path} contains pickled Python objects (an upstream fairseq checkpoint?), which can run "
                "arbitrary code when loaded. If you trust this file, pass --trust-legacy-checkpoint. "
                f"(torch said: {str(e).splitlines()[0]})"
            ) from None
    except (RuntimeError, EOFError, OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise _corrupt(
            path, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. The file is damaged or truncated"
        ) from e
    logger.warning(f"loading {path} with pickle because --trust-legacy-checkpoint was given")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise _corrupt(path, f"{type(e).__name__}: {e}. The file is damaged or truncated") from e
