"""Reading torch.distributed.checkpoint (DCP) directories without running pickled code.

A sharded checkpoint directory holds `metadata.pt` (ours: read with weights_only=True), DCP's index
`.metadata` and the shards `*.distcp`. DCP writes the index with plain `pickle` and its FileSystemReader reads
it with `pickle.load`, so a tampered index runs arbitrary code. `SafeFileSystemReader` reads it with
`RestrictedUnpickler`, which resolves only the globals DCP writes there (`allowed_globals`) and refuses any
other with a CheckpointError.

In the shards, tensors are raw bytes that DCP reads with `torch.load(weights_only=True)`; non-tensor values
(optimizer hyperparameters, plain values of a state dict) are torch.save'd, and DCP's planners load them
with `torch.load(weights_only=False)`. The safe reader loads each such value with weights_only=True first and
hands the planner a re-serialization of the plain value it got, so no planner unpickles file bytes.

With --trust-legacy-checkpoint, `storage_reader` returns DCP's own reader (and logs a warning).
"""

import builtins
import collections
import io
import logging
import os
import pathlib
import pickle
import re
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from fairseq.checkpoint.io import CheckpointError, CorruptCheckpointError

logger = logging.getLogger(__name__)

INDEX = ".metadata"  # DCP's file name for the index (filesystem._metadata_fn)

# The classes DCP pickles into `.metadata` (torch 2.11 to 2.13): Metadata holds state_dict_metadata
# {fqn: TensorStorageMetadata | BytesStorageMetadata}, planner_data {fqn: path tuple}, storage_data
# {MetadataIndex: filesystem._StorageInfo}, storage_meta (StorageMeta; its checkpoint_id is the writer's
# pathlib path) and version. TensorStorageMetadata holds TensorProperties (dtype, layout through
# torch.serialization._get_layout, memory format as _MEM_FORMAT_ENCODING), torch.Size and
# ChunkStorageMetadata.
_DCP_METADATA_CLASSES = (
    "Metadata",
    "StorageMeta",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "_MEM_FORMAT_ENCODING",
)
# Constructors pickle itself uses for plain values under some protocol (none appears under DCP's protocol 4/5,
# they are admitted so that the reader does not depend on the protocol); nothing that imports, calls
# arbitrary code or touches files.
_PLAIN_BUILTINS = ("set", "frozenset", "bytearray", "complex", "range", "slice")

_allowed: Optional[Dict[Tuple[str, str], Any]] = None


def allowed_globals() -> Dict[Tuple[str, str], Any]:
    """{(module, name) as a pickle names it: the object it resolves to}: everything the restricted
    unpickler admits."""
    global _allowed
    if _allowed is not None:
        return _allowed
    allowed: Dict[Tuple[str, str], Any] = {}
    for name in _DCP_METADATA_CLASSES:
        if hasattr(dcp_metadata, name):
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(dcp_metadata, name)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    for name, value in vars(torch).items():  # torch.float32, torch.strided, torch.contiguous_format, ...
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    if hasattr(torch.serialization, "_get_layout"):  # how torch.layout pickles (copyreg)
        allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for name in _PLAIN_BUILTINS:
        allowed[("builtins", name)] = getattr(builtins, name)
    # StorageMeta.checkpoint_id: the writer's path. Python 3.13 names the module pathlib._local. A path of the
    # other OS family cannot be instantiated here, so it becomes the pure path of that family.
    posix, windows = os.name != "nt", os.name == "nt"
    paths = {
        "PurePath": pathlib.PurePath,
        "PurePosixPath": pathlib.PurePosixPath,
        "PureWindowsPath": pathlib.PureWindowsPath,
        "Path": pathlib.Path,
        "PosixPath": pathlib.PosixPath if posix else pathlib.PurePosixPath,
        "WindowsPath": pathlib.WindowsPath if windows else pathlib.PureWindowsPath,
    }
    for module in ("pathlib", "pathlib._local"):
        for name, cls in paths.items():
            allowed[(module, name)] = cls
    _allowed = allowed
    return allowed


class ForbiddenGlobal(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only `allowed_globals()` (exact module and name, no attribute paths); no persistent ids."""

    def find_class(self, module, name):
        try:
            return allowed_globals()[(module, name)]
        except KeyError:
            raise ForbiddenGlobal(module, name) from None

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids do not occur in a DCP index")


def _refusal(source: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{source} refers to {what}, which a torch.distributed.checkpoint file written by this project never "
        "contains: unpickling it could run arbitrary code (the checkpoint may have been tampered with), so it "
        "was not loaded. Pass --trust-legacy-checkpoint only if you trust this file; it is then read with plain "
        "pickle."
    )


def load_metadata(file, source: str):
    """A DCP index (`Metadata`) from the open binary `file`, through the restricted unpickler; `source` names
    the file in errors."""
    try:
        metadata = RestrictedUnpickler(file).load()
    except ForbiddenGlobal as e:
        raise _refusal(source, f"the Python global {e.module}.{e.name}") from None
    except Exception as e:  # garbage makes the unpickler fail in any way; each is a damaged index
        raise CorruptCheckpointError(
            f"cannot read {source}: {type(e).__name__}: {str(e)[:200]}. The file is truncated or damaged, or not the "
            "index of a torch.distributed.checkpoint directory"
        ) from None
    _check_index(metadata, source)
    return metadata


def _check_index(metadata, source: str) -> None:
    """Shape checks of what was unpickled: a Metadata whose storage entries name files inside the directory."""
    bad = None
    if not isinstance(metadata, dcp_metadata.Metadata):
        bad = f"it holds a {type(metadata).__name__}"
    elif not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        bad = "it has no state_dict_metadata"
    elif metadata.storage_data is not None:
        if not isinstance(metadata.storage_data, dict):
            bad = "its storage_data is not a dict"
        else:
            for info in metadata.storage_data.values():
                rel = getattr(info, "relative_path", None)
                if not isinstance(info, dcp_filesystem._StorageInfo) or not isinstance(rel, str):
                    bad = f"a storage entry is a {type(info).__name__}"
                elif os.path.isabs(rel) or ".." in re.split(r"[\\/]", rel):
                    bad = f"a storage entry points outside the directory ({rel!r})"
                if bad:
                    break
    if bad:
        raise CheckpointError(f"{source} is not a torch.distributed.checkpoint index: {bad}")


class _SafeValues:
    """Stands in for the load planner during `read_data`: a non-tensor value is unpickled with
    weights_only=True and reaches the planner re-serialized from the plain value, so the planner's own
    torch.load(weights_only=False) reads only bytes made here. Everything else goes to the planner."""

    def __init__(self, planner, reader: "SafeFileSystemReader"):
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = self._reader._load_value(read_item, value)
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's FileSystemReader, but nothing read from the directory is unpickled beyond plain data."""

    def _index_path(self, rank: Optional[int]):
        if hasattr(self, "_get_metadata_path"):
            return self._get_metadata_path(rank)
        name = INDEX if rank is None else f"__{rank}{INDEX}"
        return self.fs.concat_path(self.path, name)

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._index_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f, str(path))
        # As DCP's reader does: a StorageMeta carrying this load's id.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, _SafeValues(planner, self))

    def _load_value(self, read_item, value: io.BytesIO):
        fqn = read_item.storage_index.fqn
        info = self.storage_data.get(read_item.storage_index)
        source = str(self.fs.concat_path(self.path, info.relative_path)) if info is not None else str(self.path)
        try:
            return torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            what = f"the Python global {found.group(1)}" if found else "pickled Python objects"
            raise _refusal(source, f"{what} (in the value of {fqn})") from None
        except (RuntimeError, EOFError, ValueError, KeyError, OSError) as e:
            raise CheckpointError(
                f"cannot read the value of {fqn} from {source}: {type(e).__name__}: {str(e).splitlines()[0]}. "
                "The shard is truncated or damaged"
            ) from None


def storage_reader(path: str, trust_legacy: bool = False) -> dcp.FileSystemReader:
    """The reader for sharded checkpoint directory `path`: safe, or with `trust_legacy` DCP's plain one."""
    if trust_legacy:
        logger.warning(f"reading sharded checkpoint {path} with pickle because --trust-legacy-checkpoint was given")
        return dcp.FileSystemReader(path)
    return SafeFileSystemReader(path)


def read_dcp_metadata(path: str, trust_legacy: bool = False):
    """DCP's index of directory `path` (raises CheckpointError for a refused or unreadable one)."""
    return storage_reader(path, trust_legacy).read_metadata()


def checkpoint_error_in(err: BaseException) -> Optional[CheckpointError]:
    """The CheckpointError that a DCP CheckpointException (a BaseException wrapping each rank's failure)
    carries, if any."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            exc = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exc, CheckpointError):
                return exc
    return None


def dcp_load(state: Dict[str, Any], reader: dcp.FileSystemReader, planner=None) -> None:
    """dcp.load(state) through `reader`; our refusals come out as the CheckpointError, not wrapped."""
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except BaseException as err:  # noqa: B036 (CheckpointException is a BaseException)
        found = checkpoint_error_in(err)
        if found is None:
            raise
        raise CheckpointError(str(found)) from None
