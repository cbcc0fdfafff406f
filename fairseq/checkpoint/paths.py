"""Checkpoint names (upstream's) and retention of old checkpoints.

A checkpoint is either a file `<stem>.pt` or, with --use-sharded-state, a directory `<stem>` written by
torch.distributed.checkpoint. Naming and retention treat both the same way.
"""

import math
import os
import re
import shutil
from typing import List, Optional, Tuple

import torch

from fairseq.checkpoint.io import checkpoint_file_looks_intact
from fairseq.checkpoint.sharded import METADATA, resolve_sharded


def checkpoint_stems(
    ckpt_cfg,
    epoch: int,
    updates: int,
    end_of_epoch: bool,
    is_best: bool,
    val_loss: Optional[float] = None,
    among_kept_best: bool = False,
) -> List[str]:
    """Stems (names without `.pt`) to write for this save point, most specific first.

    `among_kept_best`: `val_loss` ranks among the --keep-best-checkpoints best (see `enters_kept_best`)."""
    suffix = ckpt_cfg.checkpoint_suffix
    stems = []
    if end_of_epoch and not ckpt_cfg.no_epoch_checkpoints and epoch % ckpt_cfg.save_interval == 0:
        stems.append(f"checkpoint{epoch}{suffix}")
    if not end_of_epoch and ckpt_cfg.save_interval_updates > 0 and updates % ckpt_cfg.save_interval_updates == 0:
        stems.append(f"checkpoint_{epoch}_{updates}{suffix}")
    if is_best:
        stems.append(f"checkpoint_best{suffix}")
    if among_kept_best and ckpt_cfg.keep_best_checkpoints > 0 and val_loss is not None:
        stems.append(f"checkpoint.best_{ckpt_cfg.best_checkpoint_metric}_{val_loss:.4f}{suffix}")
    if not ckpt_cfg.no_last_checkpoints:
        stems.append(f"checkpoint_last{suffix}")  # last, so it always points at a complete save
    return stems


def _entries(save_dir: str, pattern: str):
    """(match, path) for checkpoint files and sharded directories whose stem matches `pattern`."""
    if not os.path.isdir(save_dir):
        return []
    regex = re.compile(pattern + r"(\.pt)?$")
    found = []
    for name in os.listdir(save_dir):
        m = regex.fullmatch(name)
        if m and not name.startswith("."):
            found.append((m, os.path.join(save_dir, name)))
    return found


def _kept_best_entries(ckpt_cfg, save_dir: str):
    """(value, path) of the --keep-best-checkpoints files in `save_dir`, best first."""
    metric = re.escape(ckpt_cfg.best_checkpoint_metric)
    suffix = re.escape(ckpt_cfg.checkpoint_suffix)
    entries = [
        (float(m.group(1)), path)
        for m, path in _entries(save_dir, rf"checkpoint\.best_{metric}_(-?\d+(?:\.\d+)?){suffix}")
    ]
    entries.sort(key=lambda e: e[0], reverse=ckpt_cfg.maximize_best_checkpoint_metric)
    return entries


def enters_kept_best(ckpt_cfg, save_dir: str, val_loss: Optional[float]) -> bool:
    """True when `val_loss` belongs among the --keep-best-checkpoints best of those kept in `save_dir`: fewer
    than N are kept, or it is strictly better than the worst kept (so the N best values seen are kept, not
    only the N most recent records)."""
    keep = ckpt_cfg.keep_best_checkpoints
    if keep <= 0 or val_loss is None or not math.isfinite(val_loss):
        return False
    values = [value for value, _ in _kept_best_entries(ckpt_cfg, save_dir)]
    named = float(f"{val_loss:.4f}")  # compared as named: the file names carry 4 decimals
    if named in values:  # an equal result is kept already; its name would overwrite that file
        return False
    if len(values) < keep:
        return True
    worst = values[keep - 1]
    return named > worst if ckpt_cfg.maximize_best_checkpoint_metric else named < worst


def remove_checkpoint(path: str):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def prune_checkpoints(ckpt_cfg, save_dir: str) -> List[str]:
    """Apply --keep-interval-updates, --keep-last-epochs and --keep-best-checkpoints; returns removed paths."""
    suffix = re.escape(ckpt_cfg.checkpoint_suffix)
    removed = []
    if ckpt_cfg.keep_interval_updates > 0:
        entries = _entries(save_dir, rf"checkpoint_\d+_(\d+){suffix}")
        pattern = ckpt_cfg.keep_interval_updates_pattern
        if pattern > 0:  # multiples of the pattern are kept apart from the newest N (upstream's rule)
            entries = [e for e in entries if int(e[0].group(1)) % pattern != 0]
        entries.sort(key=lambda e: int(e[0].group(1)), reverse=True)
        removed += [path for _, path in entries[ckpt_cfg.keep_interval_updates :]]
    if ckpt_cfg.keep_last_epochs > 0:
        entries = _entries(save_dir, rf"checkpoint(\d+){suffix}")
        entries.sort(key=lambda e: int(e[0].group(1)), reverse=True)
        removed += [path for _, path in entries[ckpt_cfg.keep_last_epochs :]]
    if ckpt_cfg.keep_best_checkpoints > 0:
        removed += [path for _, path in _kept_best_entries(ckpt_cfg, save_dir)[ckpt_cfg.keep_best_checkpoints :]]
    for path in removed:
        remove_checkpoint(path)
    return removed


def resolve_restore_path(ckpt_cfg) -> str:
    """--restore-file relative to --save-dir unless it is a path of its own (upstream's rule)."""
    restore = ckpt_cfg.restore_file
    if restore == "checkpoint_last.pt":
        return os.path.join(ckpt_cfg.save_dir, f"checkpoint_last{ckpt_cfg.checkpoint_suffix}.pt")
    if os.path.dirname(restore) == "" and not os.path.exists(restore):
        return os.path.join(ckpt_cfg.save_dir, restore)
    return restore


def intact_checkpoints(save_dir: str, exclude: Optional[str] = None) -> List[str]:
    """Checkpoints in `save_dir` that pass a cheap integrity check (`looks_intact`), the most trained first: what
    a user can resume from when checkpoint_last is damaged."""
    found = [
        path
        for _, path in _entries(save_dir, r"checkpoint.*?")
        if not path.endswith((".tmp", ".old"))
        and looks_intact(path)
        and not (exclude and os.path.abspath(path) == os.path.abspath(exclude))
    ]
    # By training progress, not modification time (a `touch` or a copy of the directory changes that); among
    # checkpoints of the same progress, by name (checkpoint_E_U before the aliases best/last).
    progress = {path: training_progress(path) for path in found}
    return sorted(sorted(found, key=os.path.basename), key=lambda p: progress[p], reverse=True)


def looks_intact(path: str) -> bool:
    """A complete zip file `x.pt`, or a sharded directory with both metadata files (cheap: no tensor is read)."""
    if os.path.isdir(path):
        complete = resolve_sharded(path) == path and os.path.isfile(os.path.join(path, ".metadata"))
        return complete and checkpoint_file_looks_intact(os.path.join(path, METADATA))
    return path.endswith(".pt") and checkpoint_file_looks_intact(path)


def newer_than_last(save_dir: str, suffix: str, last: Optional[str]) -> Optional[Tuple[str, str]]:
    """(checkpoint, why) to resume instead of `last`, the run's checkpoint_last (None: missing): the most
    trained intact checkpoint of this --checkpoint-suffix in `save_dir`, when it stores more progress (updates,
    then epoch) than `last`. A save killed after writing checkpoint_E_U but before its copy to checkpoint_last
    renamed leaves checkpoint_last behind (or absent, at the first save). None when `last` is the most trained,
    or is damaged (resuming it then fails naming the intact ones: damage is not what our saves leave)."""
    if last is not None and not last.endswith(".old") and not looks_intact(last):
        return None
    own = re.compile(r"checkpoint(\d+|_\d+_\d+|_best|_last|\.best_.+)" + re.escape(suffix) + r"(\.pt)?")
    candidates = [
        path
        for path in intact_checkpoints(save_dir)
        if own.fullmatch(os.path.basename(path)) and "checkpoint_last" not in os.path.basename(path)
    ]
    if not candidates:
        return None
    newest = candidates[0]
    progress = training_progress(newest)
    name = f"{os.path.basename(newest)} (update {progress[0]})"
    if last is None:
        return newest, f"there is no checkpoint_last{suffix} but {name} is intact"
    stored = training_progress(last)
    if progress <= stored:
        return None
    return newest, f"{os.path.basename(last)} is at update {stored[0]} but {name} is newer and intact"


def training_progress(path: str) -> Tuple[int, int]:
    """(updates, epoch) of a checkpoint file or sharded directory: what its state stores (extra_state's trainer
    and train_iterator, or upstream's optimizer_history), else what its name says (checkpoint_E_U,
    checkpointN); -1 for what neither tells. Reads no tensor data (the file is memory-mapped)."""
    updates = epoch = -1
    try:
        state = torch.load(
            os.path.join(path, METADATA) if os.path.isdir(path) else path,
            map_location="cpu",
            weights_only=True,
            mmap=True,
        )
        extra = state.get("extra_state") or {}
        history = state.get("optimizer_history") or [{}]
        trainer = extra.get("trainer") or (history[-1] if isinstance(history[-1], dict) else {})
        updates = int(trainer.get("num_updates", -1))
        epoch = int((extra.get("train_iterator") or {}).get("epoch", -1))
    except Exception:  # unreadable past the cheap check, or another layout: the name is all there is
        pass
    name = re.fullmatch(r"checkpoint(?:_(\d+)_(\d+)|(\d+))(?:\.pt)?", os.path.basename(path.rstrip(os.sep)))
    if name is not None:
        updates = updates if updates >= 0 else int(name.group(2) or -1)
        epoch = epoch if epoch >= 0 else int(name.group(1) or name.group(3))
    return updates, epoch


def existing_checkpoint(path: str) -> Optional[str]:
    """The file `x.pt`, or the sharded directory `x`, whichever exists (file preferred)."""
    if os.path.isfile(path):
        return path

    stem = path[:-3] if path.endswith(".pt") else path
    return resolve_sharded(stem)
