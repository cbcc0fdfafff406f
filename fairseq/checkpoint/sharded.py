"""Sharded checkpoints: one directory per checkpoint, written by torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the model and optimizer; rank 0 adds `metadata.pt` (config, scheduler,
iterator position: plain values). A save goes to `<stem>.tmp` and is renamed into place only once every
rank has finished, so a crash mid-save leaves the previous checkpoint untouched. DCP reshards on load, so a
checkpoint saved by N ranks resumes on M.
"""

import contextlib
import logging
import os
import shutil
from typing import Any, Dict, Optional

import torch

# torch.distributed.checkpoint (and safe_dcp, built on it) are imported by the functions that read or write
# shards: importing it costs ~1.5 s, which every process importing fairseq.checkpoint.manager would pay.
from fairseq.checkpoint.io import (
    CheckpointError,
    CheckpointSaveError,
    _fsync_dir,
    atomic_copy,
    atomic_torch_save,
    load_checkpoint_file,
    save_error,
)
from fairseq.checkpoint.writer import Write
from fairseq.distributed.mesh import ParallelLayout
from fairseq.distributed.utils import barrier, broadcast_from_master, get_rank, get_world_size

logger = logging.getLogger(__name__)

METADATA = "metadata.pt"


def _swap_into_place(tmp: str, path: str):
    """Replace directory `path` by `tmp` (a directory cannot be atomically replaced when non-empty:
    the old one is moved aside first, and `resolve_sharded` falls back to it if we die in between)."""
    old = path + ".old"
    if os.path.isdir(old):
        shutil.rmtree(old)
    if os.path.isdir(path):
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if os.path.isdir(old):
        shutil.rmtree(old)


def sharded_write(path: str, state: Dict[str, Any], metadata: Dict[str, Any], group=None) -> Write:
    """The write of a sharded checkpoint, collective over `group` (None: all ranks, default group): its bytes
    are the shards of `state` ({"model", "optimizer" (optional), and extra groups such as the EMA's "ema" and
    "ema_fp32_params", which load_sharded reads back into metadata["extra_state"]}; live or staged in host
    memory) in `<path>.tmp` and rank 0's
    `metadata.pt` there (`metadata` must not change until they are written); its publication renames the
    directory into place."""
    tmp = path + ".tmp"

    def write_bytes() -> None:
        import torch.distributed.checkpoint as dcp  # deferred: startup (~1.5 s to import)

        if get_rank() == 0 and os.path.isdir(tmp):
            shutil.rmtree(tmp)  # leftover of an interrupted save
        barrier(group)
        failure = None
        try:
            with _save_errors(path, tmp):
                dcp.save(state, checkpoint_id=tmp, process_group=group)
                if get_rank() == 0:
                    atomic_torch_save(metadata, os.path.join(tmp, METADATA))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: B036 (DCP's CheckpointException is a BaseException)
            failure = err
        # DCP reports a failure of the shards to every rank; metadata.pt is rank 0's alone: its error reaches
        # every rank, so that none waits for a rename that will not come.
        message = broadcast_from_master(str(failure) if failure is not None else None, group)
        if failure is not None:
            raise failure
        if message is not None:
            raise CheckpointSaveError(message)

    def publish() -> None:
        if get_rank() == 0:
            _swap_into_place(tmp, path)
        barrier(group)

    return Write(write_bytes, publish)


@contextlib.contextmanager
def _save_errors(path: str, tmp: str):
    """A failed write of the shards as one CheckpointSaveError naming `path` (when an OSError is behind it), the
    half-written `tmp` removed. DCP reports a failure to every rank once all have stopped writing; the
    metadata.pt that rank 0 writes after the shards is its alone."""
    try:
        yield
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if get_rank() == 0 and not isinstance(err, (KeyboardInterrupt, SystemExit)):
            # On a full disk the half-written directory holds the space the next save needs.
            shutil.rmtree(tmp, ignore_errors=True)
        os_error = None if isinstance(err, CheckpointError) else _os_error_in(err)
        if os_error is None:
            raise
        raise save_error(path, os_error) from None


def _os_error_in(err: BaseException) -> Optional[OSError]:
    """The OSError behind a failed DCP save (it wraps each rank's exception), if any."""
    seen = set()
    pending = [err]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            pending += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
        pending += [e.__cause__, e.__context__]
    return None


def copy_sharded(src: str, dst: str, group=None) -> None:
    """Collective (over `group`, default all ranks): give `dst` the content of `src` as independent files (never
    hard links: writing to one name must not change another), atomically. Each rank copies its share of the
    files, in the kernel (reflinks where the file system has them), so the copy runs as parallel as the save did."""
    tmp = dst + ".tmp"
    if get_rank() == 0:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    barrier(group)
    rank, world = get_rank(), get_world_size()
    for i, name in enumerate(sorted(os.listdir(src))):
        if i % world == rank:
            atomic_copy(os.path.join(src, name), os.path.join(tmp, name))
    barrier(group)
    if get_rank() == 0:
        _swap_into_place(tmp, dst)
    barrier(group)


def resolve_sharded(path: str) -> Optional[str]:
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    if os.path.isfile(os.path.join(path + ".old", METADATA)):
        return path + ".old"  # a save died between moving the old copy aside and renaming the new one
    return None


def read_metadata(path: str, trust_legacy: bool = False) -> Dict[str, Any]:
    """`metadata.pt` of directory `path`, read as any single checkpoint file is (plain values, weights_only=True;
    with `trust_legacy` a file that needs pickle is read with it; an empty or cut-short file is a
    CorruptCheckpointError naming it)."""
    meta = os.path.join(path, METADATA)
    if not os.path.isfile(meta):
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint (no {METADATA})")
    return load_checkpoint_file(meta, trust_legacy=trust_legacy)


def load_sharded(
    path: str, model_state, optim_state=None, trust_legacy: bool = False, extra_shards: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """Fill `model_state` (and `optim_state`, and the groups of `extra_shards` that the checkpoint has, which
    go to metadata["extra_state"]) in place from the shards; works on any world size.

    DCP's index and the shards' non-tensor values are read without unpickling code (safe_dcp); a file that
    would need more raises CheckpointError, unless `trust_legacy` (--trust-legacy-checkpoint) is given."""
    from fairseq.checkpoint import safe_dcp  # deferred: startup (safe_dcp imports torch.distributed.checkpoint)

    metadata = read_metadata(path, trust_legacy=trust_legacy)
    reader = safe_dcp.storage_reader(path, trust_legacy=trust_legacy)
    index = reader.read_metadata()  # a refused index fails here, before DCP's collectives
    stored = index.state_dict_metadata
    check_readable(path, index, model_state)
    saved_layout = _saved_layout(metadata)
    if saved_layout:
        logger.info(f"{path} was saved by {saved_layout}; DCP reshards it to this run's layout")
    state = {"model": model_state}
    if optim_state is not None:
        state["optimizer"] = optim_state
        if not any(k.startswith("optimizer") for k in stored):
            raise FileNotFoundError(f"{path} has no optimizer state; pass --reset-optimizer to start a new one")
    present = {
        name: group for name, group in (extra_shards or {}).items() if any(k.startswith(name + ".") for k in stored)
    }
    state.update(present)
    safe_dcp.dcp_load(state, reader)
    metadata["model"] = state["model"]
    metadata["last_optimizer_state"] = state.get("optimizer")
    if present:
        metadata.setdefault("extra_state", {}).update(present)
    return metadata


def check_readable(path: str, index, model_state) -> None:
    """Whether this run can read its model from the checkpoint whatever layout wrote it: every tensor it
    expects is stored at the same full size, and every shard file the index names is there. DCP reshards any
    layout (tensor-parallel, sharded or replicated) by those full sizes and offsets; what it cannot read is a
    tensor of another size (another model or dictionary) or a missing file. Checked on every rank before
    DCP's collectives, so each rank stops with this one-line error instead of inside a collective."""
    stored = index.state_dict_metadata
    for key, value in model_state.items():
        meta = stored.get(f"model.{key}")
        if meta is None:
            raise CheckpointError(
                f"{path} has no parameter {key}: it holds another architecture; resume from a "
                "checkpoint of this model, or pass --reset-optimizer --finetune-from-model"
            )
        size = getattr(meta, "size", None)
        if size is not None and isinstance(value, torch.Tensor) and tuple(size) != tuple(value.shape):
            raise CheckpointError(
                f"{path}: {key} is stored as {list(size)} but this model's is {list(value.shape)}"
                " (another model size or dictionary); train with the flags and data it was saved "
                "with"
            )
    names = {info.relative_path for info in (index.storage_data or {}).values()}
    missing = sorted(name for name in names if not os.path.isfile(os.path.join(path, name)))
    if missing:
        raise CheckpointError(
            f"{path} is incomplete: shard file(s) {', '.join(missing[:3])} named by its index are "
            "missing; copy the whole directory, or resume from another checkpoint"
        )


def _saved_layout(metadata: Dict[str, Any]) -> Optional[str]:
    """'4 rank(s) (TP 2 x FSDP 2)' from the saved config, if it says."""
    dt = (metadata.get("cfg") or {}).get("distributed_training") or {}
    world = dt.get("distributed_world_size")
    if not world:
        return None
    try:
        layout = ParallelLayout.from_flags(
            world, dt.get("model_parallel_size") or 1, dt.get("fsdp_shard_group_size") or 0, dt.get("ddp_backend")
        )
        return f"{world} rank(s) ({layout.describe()})"
    except ValueError:
        return None
