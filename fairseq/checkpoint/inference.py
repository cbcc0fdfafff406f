"""Load a trained model (single file, sharded directory, or trusted upstream file) for evaluation."""

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch

from fairseq import registry
from fairseq.checkpoint import sharded
from fairseq.checkpoint.io import load_checkpoint_file
from fairseq.checkpoint.legacy import is_legacy_checkpoint, upgrade_legacy_checkpoint
from fairseq.checkpoint.manager import check_architecture
from fairseq.dataclass.utils import config_from_dict


@dataclass
class ShardedCheckpoint:
    """Stands for a sharded directory's state until its shards are read into a model (load_model_weights)."""

    path: str  # the resolved directory
    trust_legacy: bool = False  # --trust-legacy-checkpoint: read it with plain pickle


def read_checkpoint_config(path: str, trust_legacy: bool = False
                           ) -> Tuple[Dict[str, Any], Union[Dict, ShardedCheckpoint]]:
    """(saved cfg as a plain dict, full state of a file or a ShardedCheckpoint for a sharded directory)."""
    if os.path.isdir(path):
        resolved = sharded.resolve_sharded(path)
        if resolved is None:
            raise FileNotFoundError(f"{path} is not a complete sharded checkpoint (no {sharded.METADATA})")
        cfg = sharded.read_metadata(resolved, trust_legacy=trust_legacy)["cfg"]
        return cfg, ShardedCheckpoint(resolved, trust_legacy)
    state = load_checkpoint_file(path, trust_legacy=trust_legacy)
    if is_legacy_checkpoint(state):
        state = upgrade_legacy_checkpoint(state)
    return state["cfg"], state


def build_from_saved_config(saved_cfg: Dict[str, Any], task_cfg, model_overrides: Optional[dict] = None):
    """The task from `task_cfg` (the command line's), the model from the checkpoint's model config."""
    task = registry.TASK_REGISTRY.get(task_cfg._name).setup_task(task_cfg)
    model_values = dict(saved_cfg["model"])
    model_values.update(model_overrides or {})
    arch = model_values.get("_name")
    model_cls = registry.arch_model(arch)
    model_cfg = config_from_dict(registry.dataclass_of(model_cls), model_values, name=arch)
    return task, task.build_model(model_cfg)


def load_model_weights(model: torch.nn.Module, path: str, state: Union[Dict, ShardedCheckpoint, None]) -> None:
    """Fill `model` from a single-file state or from the shards of directory `path` (any world size; None
    stands for ShardedCheckpoint(path), read without trusting pickles)."""
    if state is None or isinstance(state, ShardedCheckpoint):
        shards = state or ShardedCheckpoint(sharded.resolve_sharded(path))
        model_state = model.state_dict()
        sharded.load_sharded(shards.path, model_state, trust_legacy=shards.trust_legacy)
        model.load_state_dict(model_state)
    else:
        check_architecture(path, state, model.state_dict())
        model.load_state_dict(state["model"], strict=True)
