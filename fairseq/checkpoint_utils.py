"""Upstream's `fairseq.checkpoint_utils` loading functions, for scripts and notebooks written against upstream:

    from fairseq import checkpoint_utils
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        ["checkpoints/checkpoint_best.pt"], arg_overrides={"data": "data-bin"})

A path is a checkpoint file or a sharded checkpoint directory (`--use-sharded-state`). Checkpoints hold only
tensors and plain values; an upstream fairseq file pickles Python objects and is read only with
`trust_legacy_checkpoint=True` (the --trust-legacy-checkpoint flag), since unpickling can run code.
Models come back on the CPU, in fp32 and in eval mode. Loading is `fairseq.checkpoint.inference`; this module
only keeps upstream's names and signatures.

Upstream's training loop from Python (docs/upstream_api.md), over `fairseq.training.trainer.Trainer`:

    extra_state, epoch_itr = checkpoint_utils.load_checkpoint(cfg.checkpoint, trainer)
    ...  # train on epoch_itr with trainer.train_step
    checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, val_loss)
"""

import logging
import os
import types
from typing import Any, Dict, List, Optional, Tuple

from fairseq.checkpoint.inference import apply_overrides, load_model, read_checkpoint_state

logger = logging.getLogger(__name__)


def load_checkpoint_to_cpu(path: str, arg_overrides: Optional[Dict[str, Any]] = None,
                           load_on_all_ranks: bool = False, trust_legacy_checkpoint: bool = False) -> Dict[str, Any]:
    """The checkpoint's state in upstream's layout: "cfg" (a plain dict of config groups, `arg_overrides`
    applied), "model" (the full state dict, also of a sharded directory), and the training state that was
    saved with it. `load_on_all_ranks` is accepted for upstream compatibility: every caller reads the file."""
    state = read_checkpoint_state(path, trust_legacy=trust_legacy_checkpoint)
    state["cfg"] = apply_overrides(state.get("cfg") or {}, arg_overrides)
    return state


def _checkpoint_path(filename: str, suffix: str) -> str:
    # upstream's --checkpoint-suffix: checkpoint_best.pt -> checkpoint_best{suffix}.pt
    return filename[: -len(".pt")] + suffix + ".pt" if suffix and filename.endswith(".pt") else filename + suffix


def load_model_ensemble_and_task(filenames: List[str], arg_overrides: Optional[Dict[str, Any]] = None, task=None,
                                 strict: bool = True, suffix: str = "", num_shards: int = 1,
                                 state: Optional[Dict[str, Any]] = None, trust_legacy_checkpoint: bool = False
                                 ) -> Tuple[list, Any, Any]:
    """(models, cfg, task) for the checkpoints `filenames` (an ensemble of one model per file).

    `cfg` is the first checkpoint's config (a FairseqConfig with `generation` and `interactive` groups) after
    `arg_overrides` ({"data": "data-bin"}: the dictionary's directory when the data moved since training);
    `task` is the given one or set up from that config. With `strict=False` parameters that do not match the
    model are skipped instead of an error. `state`: the single checkpoint's already loaded state.
    `num_shards` > 1 (upstream's one-file-per-rank checkpoints) does not exist here: a sharded checkpoint is a
    directory, passed as the path."""
    if num_shards != 1:
        raise ValueError(f"num_shards={num_shards}: checkpoints split into one file per rank are upstream's "
                         "format; a sharded checkpoint here is one directory (--use-sharded-state): pass its path")
    if isinstance(filenames, str):
        filenames = [filenames]
    if state is not None and len(filenames) != 1:
        raise ValueError("state= is the state of one checkpoint; pass exactly one filename with it")
    models, cfg = [], None
    for filename in filenames:
        path = _checkpoint_path(filename, suffix)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Model file not found: {path}")
        loaded = load_model(path, task=task, overrides=arg_overrides, trust_legacy=trust_legacy_checkpoint,
                            strict=strict, state=state)
        loaded.model.eval()
        models.append(loaded.model)
        task = loaded.task  # every member of an ensemble shares the first one's task (its dictionary)
        cfg = cfg if cfg is not None else loaded.cfg
    return models, cfg, task


def load_model_ensemble(filenames: List[str], arg_overrides: Optional[Dict[str, Any]] = None, task=None,
                        strict: bool = True, suffix: str = "", num_shards: int = 1,
                        state: Optional[Dict[str, Any]] = None, trust_legacy_checkpoint: bool = False
                        ) -> Tuple[list, Any]:
    """(models, cfg): load_model_ensemble_and_task without the task."""
    models, cfg, _ = load_model_ensemble_and_task(filenames, arg_overrides, task, strict, suffix, num_shards,
                                                  state, trust_legacy_checkpoint)
    return models, cfg


# ----------------------------------------------------------------------------- saving, EMA (--store-ema)


def torch_persistent_save(obj, filename: str, async_write: bool = False) -> None:
    """Upstream's save: `obj` to `filename` with torch.save, atomically (a temporary file renamed into place,
    as every checkpoint here is written). `async_write` is accepted for upstream callers; the write is
    synchronous."""
    from fairseq.checkpoint.io import atomic_torch_save

    atomic_torch_save(obj, filename)


def load_ema_from_checkpoint(fpath: str, trust_legacy_checkpoint: bool = False) -> Dict[str, Any]:
    """The checkpoint's state with "model" replaced by its EMA weights (extra_state["ema"], written with
    --store-ema; fp16 weights in fp32), as upstream: e.g. to save them as a model of their own. A sharded
    directory's EMA shards are read whole."""
    import collections

    import torch

    if os.path.isdir(fpath):
        from fairseq.checkpoint import sharded
        from fairseq.checkpoint.consolidate import read_full_state

        path = sharded.resolve_sharded(fpath)
        if path is None:
            raise FileNotFoundError(f"{fpath} is not a complete sharded checkpoint (no {sharded.METADATA})")
        state = sharded.read_metadata(path, trust_legacy=trust_legacy_checkpoint)
        ema = read_full_state(path, keys=["ema"], trust_legacy=trust_legacy_checkpoint).get("ema")
    else:
        from fairseq.checkpoint.io import load_checkpoint_file

        state = load_checkpoint_file(fpath, trust_legacy=trust_legacy_checkpoint)
        ema = (state.get("extra_state") or {}).get("ema")
    if not ema:
        raise ValueError(f"{fpath} holds no EMA weights (extra_state['ema']); was the model trained with --store-ema?")
    state["model"] = collections.OrderedDict(
        (key, (value.float() if value.dtype == torch.float16 else value).clone()) for key, value in ema.items())
    return state


# ----------------------------------------------------------------------------- resuming and saving training

FINETUNE_WITH_RESETS = ("--finetune-from-model can not be set together with either --reset-optimizer or "
                        "reset_lr_scheduler or reset_meters or reset_dataloader")  # upstream's words (its test)


def load_checkpoint(cfg, trainer, **passthrough_args):
    """Upstream's resume: load the checkpoint to continue from into `trainer` and return (extra_state, epoch_itr),
    the training iterator at the saved data position (`passthrough_args` go to `trainer.get_train_iterator`).

    `cfg` is the checkpoint options (`cfg.checkpoint`); keys it lacks take the defaults. The default
    --restore-file (checkpoint_last.pt) is save_dir/checkpoint_last{suffix}.pt; on a first launch (it does not
    exist) --finetune-from-model's checkpoint is loaded with optimizer, scheduler, meters and data position
    reset. Another --restore-file must exist (unlike upstream, which would start from scratch). The restore
    itself is `trainer.load_checkpoint` (fairseq.checkpoint.manager, as fairseq-train resumes), and as there a
    checkpoint written at an epoch's end gets the scheduler step `trainer.lr_step(epoch, val_loss)` that the
    uninterrupted run took after writing it (upstream steps with the next epoch and no loss instead)."""
    from fairseq.checkpoint.manager import (iterator_state_for_world_size, missing_restore_file,
                                            parse_optimizer_overrides, written_at_epoch_end)
    from fairseq.checkpoint.paths import existing_checkpoint, resolve_restore_path
    from fairseq.distributed.utils import get_data_parallel_world_size
    from fairseq.file_io import PathManager

    reset_optimizer = getattr(cfg, "reset_optimizer", False)
    reset_lr_scheduler = getattr(cfg, "reset_lr_scheduler", False)
    reset_meters = getattr(cfg, "reset_meters", False)
    reset_dataloader = getattr(cfg, "reset_dataloader", False)
    restore_file = getattr(cfg, "restore_file", "checkpoint_last.pt")
    save_dir = getattr(cfg, "save_dir", "checkpoints")
    finetune = getattr(cfg, "finetune_from_model", None)
    optimizer_overrides = parse_optimizer_overrides(getattr(cfg, "optimizer_overrides", "{}"))
    if finetune is not None and (reset_optimizer or reset_lr_scheduler or reset_meters or reset_dataloader):
        raise ValueError(f"{FINETUNE_WITH_RESETS}: fine-tuning resets them all; drop the --reset-* flags")
    if restore_file != "checkpoint_last.pt" and finetune:
        raise ValueError(f"--finetune-from-model and --restore-file (non-default value) can not be specified "
                         f"together (--restore-file {restore_file}, --finetune-from-model {finetune}): drop one")

    if restore_file == "checkpoint_last.pt":
        checkpoint_path = os.path.join(save_dir, f"checkpoint_last{trainer.checkpoint_suffix}.pt")
        # A file, or a sharded directory (checkpoint_last/, or checkpoint_last.old/ after an interrupted save).
        last_dir = os.path.join(save_dir, f"checkpoint_last{trainer.checkpoint_suffix}")
        first_launch = not (PathManager.exists(checkpoint_path) or PathManager.exists(last_dir)
                            or PathManager.exists(last_dir + ".old"))
        if finetune is not None and first_launch:
            found = existing_checkpoint(finetune)
            if found is None:
                raise FileNotFoundError(f"--finetune-from-model {finetune}: no such checkpoint (a .pt file or a "
                                        "complete sharded checkpoint directory)")
            checkpoint_path = found
            reset_optimizer = reset_lr_scheduler = reset_meters = reset_dataloader = True
            logger.info(f"loading pretrained model from {finetune}: optimizer, lr scheduler, meters, dataloader "
                        "will be reset")
    else:
        # the options resolve_restore_path reads, from a config that may lack them
        options = types.SimpleNamespace(restore_file=restore_file, save_dir=save_dir,
                                        checkpoint_suffix=trainer.checkpoint_suffix)
        checkpoint_path = resolve_restore_path(options)
        if existing_checkpoint(checkpoint_path) is None:
            raise missing_restore_file(restore_file, checkpoint_path)

    extra_state = trainer.load_checkpoint(checkpoint_path, reset_optimizer, reset_lr_scheduler, optimizer_overrides,
                                          reset_meters=reset_meters)
    position = None if extra_state is None or reset_dataloader else extra_state.get("train_iterator")
    epoch_itr = trainer.get_train_iterator(epoch=1 if position is None else position["epoch"], load_dataset=True,
                                           **passthrough_args)
    if position is not None:
        epoch_itr.load_state_dict(iterator_state_for_world_size(
            position, extra_state.get("data_parallel_size"), get_data_parallel_world_size()))
        if written_at_epoch_end(position, extra_state.get("val_loss")):
            trainer.lr_step(epoch_itr.epoch - 1, extra_state["val_loss"])
    return extra_state, epoch_itr


def save_checkpoint(cfg, trainer, epoch_itr, val_loss: Optional[float]) -> List[str]:
    """Upstream's save: write the checkpoints due now (checkpoint{epoch}.pt at an epoch's end, checkpoint_E_U.pt
    every --save-interval-updates, checkpoint_best.pt, checkpoint_last.pt; retention as configured) with
    `trainer`'s state, `epoch_itr`'s data position and the meters, as fairseq-train writes them (one
    CheckpointManager, `trainer.checkpoint_manager`, which also tracks the best `val_loss`). `cfg` is the
    trainer's checkpoint options (`trainer.cfg.checkpoint`). Every rank calls it. Returns the paths written."""
    from fairseq.logging import metrics

    if cfg is not trainer.cfg.checkpoint and cfg != trainer.cfg.checkpoint:
        raise ValueError("save_checkpoint(cfg, trainer, ...): cfg differs from the trainer's checkpoint options; "
                         "pass trainer.cfg.checkpoint (the Trainer writes with the config it was built with)")
    return trainer.checkpoint_manager.save(trainer, epoch_itr, val_loss, end_of_epoch=epoch_itr.end_of_epoch(),
                                           metrics_state=metrics.state_dict())
