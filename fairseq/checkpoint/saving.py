"""The tensors of a save and the write of each checkpoint layout, for fairseq.checkpoint.manager: the state is
staged by the run's CheckpointWriter (fairseq.checkpoint.staging), and the returned Write puts it on disk."""

import time
from typing import Any, Dict, List, Tuple

from fairseq.checkpoint import sharded
from fairseq.checkpoint.io import atomic_copy, check_plain, torch_save_temporary
from fairseq.checkpoint.staging import Staged
from fairseq.checkpoint.writer import CheckpointWriter, Write
from fairseq.distributed.utils import get_rank


def _staged_tensors(writer: CheckpointWriter, path: str, trainer, single_file: bool, with_optimizer: bool) -> Staged:
    """Model, optimizer (as `with_optimizer`) and EMA state of the save to `path`, checked to be plain data (the
    exact object handed to the stager: the same layout on every rank, so all stop there) and staged
    (collective)."""
    start = time.perf_counter()
    model_state, optim_state = trainer.model_and_optimizer_state(full=False)  # sharded: DTensors
    tensors = {"model": model_state}
    if with_optimizer:
        tensors["last_optimizer_state" if single_file else "optimizer"] = optim_state
    if trainer.ema is not None:  # --store-ema: extra_state["ema"] (upstream's key)
        tensors.update(trainer.ema.state_dict())
    seconds = time.perf_counter() - start
    check_plain(tensors, path)
    staged = writer.stage(tensors, single_file=single_file, optimizer=trainer.optimizer)
    staged.times.state_dict = seconds
    return staged


def sharded_checkpoint_write(
    writer: CheckpointWriter, paths: List[str], trainer, metadata: Dict[str, Any], with_optimizer: bool
) -> Tuple[Staged, Write]:
    """Collective: each rank's shards staged (or, synchronously, as they are) and the write of the directory
    `paths[0]` with `metadata` (rank 0's metadata.pt), then its copies to the other paths."""
    check_plain(metadata, paths[0], where=sharded.METADATA)
    staged = _staged_tensors(writer, paths[0], trainer, single_file=False, with_optimizer=with_optimizer)
    group = writer.group()
    write = sharded.sharded_write(paths[0], staged.state, metadata, group)

    def write_bytes():
        staged.wait()
        write.bytes()

    def publish():
        write.publish()
        for path in paths[1:]:
            sharded.copy_sharded(paths[0], path, group=group)

    return staged, Write(write_bytes, publish)


def single_file_checkpoint_write(
    writer: CheckpointWriter, paths: List[str], trainer, state: Dict[str, Any], with_optimizer: bool
) -> Tuple[Staged, Write]:
    """Collective (sharded state is gathered to rank 0): the tensors staged in host memory and rank 0's write of
    `state` with them (model, last_optimizer_state, the EMA's groups in extra_state) to `paths[0]`, then its
    copies to the other paths."""
    check_plain(state, paths[0])
    staged = _staged_tensors(writer, paths[0], trainer, single_file=True, with_optimizer=with_optimizer)
    if get_rank() != 0:
        return staged, Write(lambda: None, lambda: None)
    pending = []

    def write_bytes():
        staged.wait()
        host = dict(staged.state)
        state["model"] = host.pop("model")
        if "last_optimizer_state" in host:
            state["last_optimizer_state"] = host.pop("last_optimizer_state")
        state["extra_state"].update(host)  # the EMA's groups
        pending.append(torch_save_temporary(state, paths[0]))

    def publish():
        pending.pop().commit()
        for path in paths[1:]:
            atomic_copy(paths[0], path)

    return staged, Write(write_bytes, publish)
