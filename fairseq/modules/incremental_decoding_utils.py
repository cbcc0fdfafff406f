"""Per-module entries of an incremental (step-by-step) decoding state, under upstream fairseq's names.

An incremental state is one dict per decoding run, `Dict[str, Dict[str, Optional[Tensor]]]`: every module
that caches something (an attention layer's keys and values, a decoder's count of tokens seen) keeps one
entry in it, under a key made of the module's unique id and a name, so several modules (and several models
of an ensemble, each with its own dict) never collide. This fork's modules also keep plain ints in their
entries (fill lengths), which upstream's TorchScript typing would not allow; nothing reads another module's
entry.
"""

import uuid
from typing import Dict, Optional

from torch import Tensor

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


class FairseqIncrementalState(object):
    """Mixin giving a module `get_incremental_state` / `set_incremental_state` for its own entries."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.init_incremental_state()

    def init_incremental_state(self) -> None:
        self._incremental_state_id = str(uuid.uuid4())

    def _get_full_incremental_state_key(self, key: str) -> str:
        return f"{self._incremental_state_id}.{key}"

    def get_incremental_state(
        self, incremental_state: Optional[IncrementalState], key: str
    ) -> Optional[Dict[str, Optional[Tensor]]]:
        """This module's entry `key`, or None when there is none (or no state at all)."""
        if incremental_state is None:
            return None
        return incremental_state.get(self._get_full_incremental_state_key(key))

    def set_incremental_state(
        self, incremental_state: Optional[IncrementalState], key: str, value: Dict[str, Optional[Tensor]]
    ) -> Optional[IncrementalState]:
        """Store this module's entry `key` (a no-op without a state); returns the state."""
        if incremental_state is not None:
            incremental_state[self._get_full_incremental_state_key(key)] = value
        return incremental_state


def with_incremental_state(cls):
    """Class decorator (upstream's): make `cls` a FairseqIncrementalState as well, first in its bases."""
    if issubclass(cls, FairseqIncrementalState):
        return cls
    cls.__bases__ = (FairseqIncrementalState,) + tuple(b for b in cls.__bases__ if b is not FairseqIncrementalState)
    return cls
