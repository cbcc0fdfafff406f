"""Sharded checkpoint directory -> one single-file checkpoint (no model code or process group needed)."""

from typing import Any, Dict, List, Optional

from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from fairseq.checkpoint import safe_dcp, sharded
from fairseq.checkpoint.io import CheckpointError, atomic_torch_save


# Sharded groups beside model and optimizer (fairseq.models.ema), kept in extra_state of a single file.
EXTRA_SHARDS = ("ema", "ema_fp32_params")


def read_full_state(path: str, keys: Optional[List[str]] = None, trust_legacy: bool = False) -> Dict[str, Any]:
    """Every tensor of DCP directory `path` at its full size (or only the top-level `keys`), read in this
    process through the safe reader (what torch's dcp_to_torch_save reads, without its plain-pickle reader)."""
    reader = safe_dcp.storage_reader(path, trust_legacy=trust_legacy)
    reader.read_metadata()  # a refused index fails here with its own message
    full: Dict[str, Any] = {}
    try:
        _load_state_dict(full, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    except BaseException as err:  # noqa: B036 (DCP's CheckpointException is a BaseException)
        found = safe_dcp.checkpoint_error_in(err)
        if found is None:
            raise
        raise CheckpointError(str(found)) from None
    return full


def consolidate(checkpoint_dir: str, output: str, include_optimizer: bool = True, trust_legacy: bool = False) -> None:
    path = sharded.resolve_sharded(checkpoint_dir)
    if path is None:
        raise FileNotFoundError(f"{checkpoint_dir} is not a complete sharded checkpoint (no {sharded.METADATA})")
    state = sharded.read_metadata(path, trust_legacy=trust_legacy)
    full = read_full_state(
        path, keys=None if include_optimizer else ["model"] + list(EXTRA_SHARDS), trust_legacy=trust_legacy
    )
    state["model"] = full["model"]
    for group in EXTRA_SHARDS:  # --store-ema's weights: extra_state, as in a single-file checkpoint
        if group in full:
            state.setdefault("extra_state", {})[group] = full[group]
    if include_optimizer and "optimizer" in full:
        state["last_optimizer_state"] = full["optimizer"]
    atomic_torch_save(state, output)
