"""Upstream's `fairseq.checkpoint_utils` (the module `fairseq.checkpoint_utils` is this one), for scripts and
notebooks written against upstream:

    from fairseq import checkpoint_utils
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        ["checkpoints/checkpoint_best.pt"], arg_overrides={"data": "data-bin"})

Loading is `fairseq.checkpoint.inference` (the core's: fairseq-validate, the hub), re-exported here under
upstream's names. Upstream's training loop from Python (docs/upstream_api.md), over upstream's Trainer
(`fairseq.trainer.Trainer`):

    extra_state, epoch_itr = checkpoint_utils.load_checkpoint(cfg.checkpoint, trainer)
    ...  # train on epoch_itr with trainer.train_step
    checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, val_loss)

File access goes through this module's `PathManager` (fairseq.file_io's) where upstream's does, so patching
`fairseq.checkpoint_utils.PathManager` (or its methods), as upstream's tests do, or registering an iopath handler
reaches it: `torch_persistent_save` (`opena` with async_write, `open` for a handler's path), `load_ema_from_checkpoint`
(`open`, then `torch.load` on the file), `load_checkpoint_to_cpu` (`get_local_path`), `load_checkpoint`
(`exists`).
"""

import dataclasses
import logging
import os
import types
from typing import List, Optional

import torch

from fairseq.checkpoint import inference as _inference
from fairseq.checkpoint.inference import (  # noqa: F401 (upstream's names)
    load_model_ensemble,
    load_model_ensemble_and_task,
)
from fairseq.checkpoint.io import atomic_torch_save, load_checkpoint_file
from fairseq.checkpoint.manager import (
    choose_restore,
    iterator_state_for_world_size,
    parse_optimizer_overrides,
    written_at_epoch_end,
)
from fairseq.checkpoint.paths import existing_checkpoint
from fairseq.compat.file_io import PathManager
from fairseq.distributed.utils import get_data_parallel_world_size
from fairseq.logging import metrics

logger = logging.getLogger("fairseq.checkpoint_utils")  # upstream's module name: log lines unchanged


def torch_persistent_save(obj, filename: str, async_write: bool = False) -> None:
    """Upstream's save of `obj` to `filename` with torch.save: with `async_write`, into the file
    `PathManager.opena` gives (iopath's asynchronous writer; without iopath a plain file); on a path of a
    registered iopath handler, into `PathManager.open`'s; a local file atomically (a temporary file renamed into
    place, as every checkpoint here is written)."""
    if async_write:
        with PathManager.opena(filename, "wb") as f:
            _torch_persistent_save(obj, f)
    elif PathManager.path_requires_pathmanager(filename):
        with PathManager.open(filename, "wb") as f:
            _torch_persistent_save(obj, f)
    else:
        atomic_torch_save(obj, filename)


def _torch_persistent_save(obj, f) -> None:
    """torch.save into the open file `f` (a path is opened through PathManager)."""
    if isinstance(f, str):
        with PathManager.open(f, "wb") as h:
            torch.save(obj, h)
        return
    torch.save(obj, f)


def _read_checkpoint_file(path: str, trust_legacy: bool) -> dict:
    """Upstream's read: the file through `PathManager.open(path, "rb")`, then `torch.load` on it (weights only:
    plain containers and tensors). What that cannot read (a damaged file, pickled objects of an upstream
    checkpoint) is read again by the core's safe loader, which names the problem (and unpickles with
    `trust_legacy`)."""
    try:
        with PathManager.open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except Exception:
        if PathManager.path_requires_pathmanager(path):
            raise
    return load_checkpoint_file(path, trust_legacy=trust_legacy)


def load_checkpoint_to_cpu(
    path: str,
    arg_overrides: Optional[dict] = None,
    load_on_all_ranks: bool = False,
    trust_legacy_checkpoint: bool = False,
) -> dict:
    """fairseq.checkpoint.inference.load_checkpoint_to_cpu on `PathManager.get_local_path(path)` (a registered
    handler's file is fetched first, as upstream's)."""
    return _inference.load_checkpoint_to_cpu(
        PathManager.get_local_path(path), arg_overrides, load_on_all_ranks, trust_legacy_checkpoint
    )


def load_ema_from_checkpoint(fpath: str, trust_legacy_checkpoint: bool = False) -> dict:
    """The checkpoint's state with "model" replaced by its EMA weights (extra_state["ema"], written with
    --store-ema; fp16 weights in fp32), read as upstream reads it (`_read_checkpoint_file`); a sharded directory's
    through the core (fairseq.checkpoint.inference.load_ema_from_checkpoint)."""
    if os.path.isdir(fpath):
        return _inference.load_ema_from_checkpoint(fpath, trust_legacy_checkpoint)
    state = _read_checkpoint_file(fpath, trust_legacy_checkpoint)
    return _inference.with_ema_as_model(state, (state.get("extra_state") or {}).get("ema"), fpath)


# ----------------------------------------------------------------------------- resuming and saving training

FINETUNE_WITH_RESETS = (
    "--finetune-from-model can not be set together with either --reset-optimizer or "
    "reset_lr_scheduler or reset_meters or reset_dataloader"
)  # upstream's words (its test)


# The checkpoint options load_checkpoint reads, with the defaults a partial config falls back to.
_RESUME_DEFAULTS = {
    "reset_optimizer": False,
    "reset_lr_scheduler": False,
    "reset_meters": False,
    "reset_dataloader": False,
    "restore_file": "checkpoint_last.pt",
    "save_dir": "checkpoints",
    "finetune_from_model": None,
    "optimizer_overrides": "{}",
    "no_last_checkpoints": False,
}


def load_checkpoint(cfg, trainer, **passthrough_args):
    """Upstream's resume: load the checkpoint to continue from into `trainer` and return (extra_state, epoch_itr),
    the training iterator at the saved data position (`passthrough_args` go to `trainer.get_train_iterator`).

    `cfg` is the checkpoint options (`cfg.checkpoint`); keys it lacks take the defaults. The default
    --restore-file (checkpoint_last.pt) is save_dir/checkpoint_last{suffix}.pt; on a first launch (it does not
    exist) --finetune-from-model's checkpoint is loaded with optimizer, scheduler, meters and data position
    reset. Another --restore-file must exist (unlike upstream, which would start from scratch). The restore
    itself is `trainer.load_checkpoint` (fairseq.checkpoint.manager, as fairseq-train resumes), and as there a
    checkpoint written at an epoch's end gets the scheduler step `trainer.lr_step(epoch, val_loss)` that the
    uninterrupted run took after writing it (upstream steps with the next epoch and no loss instead). Which
    checkpoint, with which resets, is fairseq-train's rule (`fairseq.checkpoint.manager.choose_restore`)."""
    ck = _resume_options(cfg, trainer.checkpoint_suffix)
    choice = choose_restore(ck, _first_launch(ck) if ck.restore_file == "checkpoint_last.pt" else None)
    checkpoint_path, resets = choice.path, choice.resets
    if choice.finetune:
        checkpoint_path = _finetune_checkpoint(ck.finetune_from_model)
    extra_state = trainer.load_checkpoint(
        checkpoint_path,
        resets.optimizer,
        resets.lr_scheduler,
        parse_optimizer_overrides(ck.optimizer_overrides),
        reset_meters=resets.meters,
    )
    position = None if extra_state is None or resets.dataloader else extra_state.get("train_iterator")
    epoch_itr = trainer.get_train_iterator(
        epoch=1 if position is None else position["epoch"], load_dataset=True, **passthrough_args
    )
    if position is not None:
        _restore_position(trainer, epoch_itr, position, extra_state)
    return extra_state, epoch_itr


def _resume_options(cfg, checkpoint_suffix: str) -> types.SimpleNamespace:
    """The options choose_restore reads, from a config that may lack them (upstream's test passes a partial one),
    checked: --finetune-from-model goes with no --reset-* flag and the default --restore-file only."""
    ck = types.SimpleNamespace(
        **{name: getattr(cfg, name, default) for name, default in _RESUME_DEFAULTS.items()},
        checkpoint_suffix=checkpoint_suffix,
    )
    finetune, restore_file = ck.finetune_from_model, ck.restore_file
    if finetune is not None and (ck.reset_optimizer or ck.reset_lr_scheduler or ck.reset_meters or ck.reset_dataloader):
        raise ValueError(f"{FINETUNE_WITH_RESETS}: fine-tuning resets them all; drop the --reset-* flags")
    if restore_file != "checkpoint_last.pt" and finetune:
        raise ValueError(
            f"--finetune-from-model and --restore-file (non-default value) can not be specified "
            f"together (--restore-file {restore_file}, --finetune-from-model {finetune}): drop one"
        )
    return ck


def _first_launch(ck: types.SimpleNamespace) -> bool:
    """Whether save_dir holds no checkpoint_last: upstream's probe, through PathManager, of a file or a sharded
    directory (checkpoint_last/, or checkpoint_last.old/ after an interrupted save)."""
    last_file = os.path.join(ck.save_dir, f"checkpoint_last{ck.checkpoint_suffix}.pt")
    last_dir = os.path.join(ck.save_dir, f"checkpoint_last{ck.checkpoint_suffix}")
    return not (PathManager.exists(last_file) or PathManager.exists(last_dir) or PathManager.exists(last_dir + ".old"))


def _finetune_checkpoint(finetune: str) -> str:
    """--finetune-from-model's checkpoint (a file or a complete sharded directory), else a one-line error."""
    checkpoint_path = existing_checkpoint(finetune)
    if checkpoint_path is None:
        raise FileNotFoundError(
            f"--finetune-from-model {finetune}: no such checkpoint (a .pt file or a "
            "complete sharded checkpoint directory)"
        )
    logger.info(f"loading pretrained model from {finetune}: optimizer, lr scheduler, meters, dataloader will be reset")
    return checkpoint_path


def _restore_position(trainer, epoch_itr, position: dict, extra_state: dict) -> None:
    """`epoch_itr` at the saved data position (re-split for this data-parallel size), and the scheduler step the
    uninterrupted run took after a checkpoint written at an epoch's end."""
    epoch_itr.load_state_dict(
        iterator_state_for_world_size(position, extra_state.get("data_parallel_size"), get_data_parallel_world_size())
    )
    if written_at_epoch_end(position, extra_state.get("val_loss")):
        trainer.lr_step(epoch_itr.epoch - 1, extra_state["val_loss"])


def save_checkpoint(cfg, trainer, epoch_itr, val_loss: Optional[float]) -> List[str]:
    """Upstream's save: write the checkpoints due now (checkpoint{epoch}.pt at an epoch's end, checkpoint_E_U.pt
    every --save-interval-updates, checkpoint_best.pt, checkpoint_last.pt; retention as configured) with
    `trainer`'s state, `epoch_itr`'s data position and the meters, as fairseq-train writes them (one
    CheckpointManager, `trainer.checkpoint_manager`, which also tracks the best `val_loss`). `cfg` is the
    checkpoint options that decide where and what (save_dir, the intervals, names and retention, as upstream's
    `cfg`): the trainer's `trainer.cfg.checkpoint`, or others (a partial config: the keys it lacks are the
    trainer's). The file holds the trainer's config, as upstream's. Every rank calls it. Returns the paths
    written, complete (with --write-checkpoints-asynchronously too: a script has no later point where a failed
    background write could be reported)."""
    manager = trainer.checkpoint_manager
    options = _checkpoint_options(cfg, manager.ckpt_cfg)
    writer = manager if options is manager.ckpt_cfg else manager.with_checkpoint_config(options)
    paths = writer.save(
        trainer, epoch_itr, val_loss, end_of_epoch=epoch_itr.end_of_epoch(), metrics_state=metrics.state_dict()
    )
    writer.wait_for_write("before save_checkpoint returns")  # the views share the run's one background writer
    if writer is not manager:
        manager.best = writer.best  # one best value across calls, whatever the options (upstream's)
    return paths


def _checkpoint_options(cfg, own):
    """The checkpoint options `cfg` gives (a config, DictConfig, namespace or dict), the trainer's `own` for the
    keys it lacks; `own` itself when they are the same."""
    if cfg is own or not dataclasses.is_dataclass(own):
        return own if cfg is own else cfg
    missing = object()
    given = {}
    for field in dataclasses.fields(own):
        value = cfg.get(field.name, missing) if isinstance(cfg, dict) else getattr(cfg, field.name, missing)
        if value is not missing:
            given[field.name] = value
    options = dataclasses.replace(own, **given)
    return own if options == own else options
