"""Upstream's `fairseq.checkpoint_utils` loading functions, for scripts and notebooks written against upstream:

    from fairseq import checkpoint_utils
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        ["checkpoints/checkpoint_best.pt"], arg_overrides={"data": "data-bin"})

A path is a checkpoint file or a sharded checkpoint directory (`--use-sharded-state`). Checkpoints hold only
tensors and plain values; an upstream fairseq file pickles Python objects and is read only with
`trust_legacy_checkpoint=True` (the --trust-legacy-checkpoint flag), since unpickling can run code.
Models come back on the CPU, in fp32 and in eval mode. Loading is `fairseq.checkpoint.inference`; this module
only keeps upstream's names and signatures.
"""

import os
from typing import Any, Dict, List, Optional, Tuple

from fairseq.checkpoint.inference import apply_overrides, load_model, read_checkpoint_state


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
