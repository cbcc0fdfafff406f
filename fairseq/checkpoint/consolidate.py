"""Sharded checkpoint directory -> one single-file checkpoint (no model code or process group needed)."""

import os
import shutil
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fairseq.checkpoint import sharded
from fairseq.checkpoint.io import atomic_torch_save


def consolidate(checkpoint_dir: str, output: str, include_optimizer: bool = True) -> None:
    path = sharded.resolve_sharded(checkpoint_dir)
    if path is None:
        raise FileNotFoundError(f"{checkpoint_dir} is not a complete sharded checkpoint (no {sharded.METADATA})")
    state = sharded.read_metadata(path)
    tmp_dir = tempfile.mkdtemp(prefix="consolidate.")
    try:
        tmp = os.path.join(tmp_dir, "full.pt")
        dcp_to_torch_save(path, tmp)  # reads every shard, writes full tensors
        full = torch.load(tmp, map_location="cpu", weights_only=True)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    state["model"] = full["model"]
    if include_optimizer and "optimizer" in full:
        state["last_optimizer_state"] = full["optimizer"]
    atomic_torch_save(state, output)
