"""Only plain data is saved (fairseq.checkpoint.io.check_plain, run on the exact object handed to the stager and on
the rest of what is written): tensors, dict/list/tuple and int/float/bool/str/bytes/None; anything else is refused
naming the entry."""

import dataclasses
import enum
from collections import OrderedDict, namedtuple

import pytest
import torch

from fairseq.checkpoint.io import CheckpointSaveError, check_plain, non_plain_entries


class Mode(enum.IntEnum):
    TRAIN = 1


@dataclasses.dataclass
class Position:
    epoch: int = 1


Pair = namedtuple("Pair", "a b")


@pytest.mark.parametrize(
    "value, named",
    [
        (torch.float32, "state.extra_state.trainer.value is of type torch.dtype (torch.float32)"),
        (int, "state.extra_state.trainer.value is a class (<class 'int'>)"),
        (Mode.TRAIN, f"state.extra_state.trainer.value is of type {__name__}.Mode (<Mode.TRAIN: 1>)"),
        (Position(), f"state.extra_state.trainer.value is of type {__name__}.Position (Position(epoch=1))"),
        (Pair(1, 2), f"state.extra_state.trainer.value is of type {__name__}.Pair (Pair(a=1, b=2))"),
        ({1.5: 0}, "state.extra_state.trainer.value has the key 1.5 of type float"),
        ({1, 2}, "state.extra_state.trainer.value is of type builtins.set ({1, 2})"),
    ],
)
def test_a_state_that_is_not_plain_is_refused_naming_the_entry(value, named):
    state = {"model": OrderedDict(w=torch.zeros(2)), "extra_state": {"trainer": {"num_updates": 3, "value": value}}}
    assert non_plain_entries(state) == [named]
    with pytest.raises(CheckpointSaveError, match="cannot save ck/checkpoint_1_2.pt: " + named.split(" (")[0]):
        check_plain(state, "ck/checkpoint_1_2.pt")


def test_tensors_plain_containers_and_scalars_are_plain():
    state = {
        "model": OrderedDict(w=torch.zeros(2)),
        "optimizer": {
            "state": {0: {"step": torch.tensor(1.0)}},
            "param_groups": [{"betas": (0.9, 0.98), "lr": 1e-3, "amsgrad": False, "foreach": None}],
        },
        "cfg": {"name": "x", "raw": b"\x00", "steps": [1, 2.5, True]},
    }
    assert non_plain_entries(state) == []
    check_plain(state, "ck/checkpoint_last.pt")
