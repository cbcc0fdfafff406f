"""NormFormer's --scale-attn under tensor parallelism (its layer norm joins the plan as a norm of the
sequence-split stream): TP 2 on 2 CPU processes (gloo, fp32, dropout 0, DP 1) trains the same losses as one
process with the same global batch. The options the plan does not cover are refused (tests/unit/
test_upstream_lm_api.py)."""

import pytest

from tests.distributed.test_tensor_parallel import LOSS_RTOL, train_updates
from tests.train_fixtures import spawn_scenarios

pytestmark = pytest.mark.timeout(600)

UPDATES = 3
NORMFORMER = ["--scale-attn", "--decoder-normalize-before"]
TP2 = ["--ddp-backend", "fully_sharded", "--model-parallel-size", "2", "--update-freq", "4"]


def scenarios(rank, data):
    return {"tp2": lambda: train_updates(data, *TP2, *NORMFORMER, updates=UPDATES)}


def test_scale_attn_under_tensor_parallelism_trains_as_one_process(tiny_data, tmp_path):
    runs = spawn_scenarios(scenarios, tmp_path, 2, tiny_data, timeout_s=120)
    result = runs[0]["tp2"]
    if isinstance(result, Exception):
        raise result
    losses, state = result
    assert any(".attn_ln." in key for key in state)
    want, _ = train_updates(tiny_data, "--update-freq", "4", *NORMFORMER, updates=UPDATES)
    for got, expected in zip(losses, want):
        assert got == pytest.approx(expected, rel=LOSS_RTOL)
