"""The tensor-parallel ranks' agreement (fairseq.serving.tensor_parallel.run_call / run_step) on 2 spawned gloo
ranks: a call that one rank's check refuses runs on no rank and fails on both, naming that rank; a call or step
that fails on one rank fails on both (a step: the server stops, OutOfStep); an error every rank meets alike stays
the request's; a rank that fails before a collective the other waits in stops within the agreement's wait.

The served model is a stand-in here (each rank's check and call answer as a test scenario says, the call's
collective is a real all-reduce over a gloo "model" group): what differs between ranks in a real server (each
GPU's free memory, an out-of-memory on one GPU) does not happen on one CPU. The real server's stops are in
tests/integration/test_serve_tensor_parallel_faults.py."""

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fairseq.serving.tensor_parallel import OutOfStep, _apply, run_call, run_step
from tests.train_fixtures import spawn_scenarios

AGREE_S, MODEL_TIMEOUT_S = 2.0, 10.0


class Model:
    """A rank's stand-in model: `precheck` answers `refusal`; `beam` runs one all-reduce over the model group
    (the collectives of a real forward), raising `error` before or after it."""

    def __init__(self, group, refusal=None, error=None, before=False):
        self.group, self.refusal, self.error, self.before = group, refusal, error, before
        self.ran = 0

    def precheck(self, name, args):
        return self.refusal

    def beam(self, value):
        self.ran += 1
        if self.error is not None and self.before:
            raise self.error
        total = torch.tensor([value])
        dist.all_reduce(total, group=self.group)
        if self.error is not None:
            raise self.error
        return total.item()

    def step(self):  # the backend's, for run_step
        return self.beam(1)


def outcome(run):
    """(result or exception type, its message, seconds)."""
    started = time.monotonic()
    try:
        result = run()
    except Exception as err:
        return type(err).__name__, str(err), time.monotonic() - started
    return "ok", result, time.monotonic() - started


def rank_scenarios(rank):
    model_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=MODEL_TIMEOUT_S))
    tp = SimpleNamespace(
        rank=rank, size=2, agree_s=AGREE_S, agreement=dist.new_group(backend="gloo", timeout=timedelta(seconds=AGREE_S))
    )
    on_one = lambda err: err if rank == 1 else None  # noqa: E731
    refused = Model(model_group, refusal="no room on this GPU" if rank == 1 else None)
    models = {
        "ok": Model(model_group),
        "refused": refused,
        "one_fails_after": Model(model_group, error=on_one(RuntimeError("boom after"))),
        "all_fail_alike": Model(model_group, error=ValueError("bad input")),
        "step_one_fails": Model(model_group, error=on_one(RuntimeError("step boom"))),
        "step_all_fail_alike": Model(model_group, error=ValueError("bad row")),
        # last: it leaves the groups broken
        "one_fails_before": Model(model_group, error=on_one(torch.OutOfMemoryError("out of memory")), before=True),
    }

    def call(model):
        return lambda: (outcome(lambda: run_call(tp, model, "beam", (rank + 1,))), model.ran)

    def step(model):
        return lambda: (outcome(lambda: run_step(tp, model)), model.ran)

    return {name: (step if name.startswith("step") else call)(model) for name, model in models.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_scenarios(rank_scenarios, tmp_path_factory.mktemp("agreement"), 2, timeout_s=30)


def test_a_call_every_rank_runs_returns_its_result(ranks):
    assert [r["ok"] for r in ranks] == [(("ok", 3, pytest.approx(0, abs=5)), 1)] * 2


def test_a_call_one_ranks_check_refuses_runs_on_no_rank_and_fails_on_all_naming_it(ranks):
    for r in ranks:
        (kind, message, _), ran = r["refused"]
        assert (kind, message, ran) == ("RuntimeError", "rank 1: no room on this GPU", 0)


def test_a_call_that_fails_on_one_rank_fails_on_all_naming_it(ranks):
    (kind0, message0, _), _ = ranks[0]["one_fails_after"]
    (kind1, message1, _), _ = ranks[1]["one_fails_after"]
    assert (kind0, message0) == ("RuntimeError", "rank 1: RuntimeError: boom after")
    assert (kind1, message1) == ("RuntimeError", "boom after")  # its own error, as before


def test_an_error_every_rank_meets_alike_stays_the_requests(ranks):
    for r in ranks:
        assert r["all_fail_alike"][0][:2] == ("ValueError", "bad input")
        assert r["step_all_fail_alike"][0][:2] == ("ValueError", "bad row")


def test_a_step_that_fails_on_one_rank_stops_every_rank(ranks):
    for r in ranks:
        kind, message, _ = r["step_one_fails"][0]
        assert kind == OutOfStep.__name__
        assert (
            message == "rank 1: RuntimeError: step boom: a decode step failed on some ranks only, stopping the server"
        )


def test_a_rank_that_fails_before_a_collective_stops_within_the_agreements_wait(ranks):
    kind, message, seconds = ranks[1]["one_fails_before"][0]
    assert kind == OutOfStep.__name__ and AGREE_S <= seconds < AGREE_S + 4, (kind, message, seconds)  # not 10 s
    assert message.startswith(
        f"rank 1: beam failed here (OutOfMemoryError: out of memory), and the other ranks did not answer within "
        f"{AGREE_S:g} s after the beam"
    ), message
    # rank 0 waited in the model's collective, for rank 1, which has left: it stops too
    assert ranks[0]["one_fails_before"][0][0] == OutOfStep.__name__, ranks[0]["one_fails_before"]


def test_a_follower_whose_engine_refuses_what_rank_0s_took_is_out_of_step(caplog):
    """Rank 0 sends an add or a cancel only once its own engine took it: failing on a follower, the engines
    differ and the server must stop; a call or step error was agreed on by the ranks and is only logged."""

    def refuses(*args):
        raise ValueError("prompt longer than this engine's rows")

    for operation in ("add", "cancel"):
        with pytest.raises(OutOfStep, match=rf"rank 1: {operation} failed here but not on rank 0 \(ValueError: "):
            _apply(refuses, ("row",), operation, 1)
    _apply(refuses, (), "call", 1)  # agreed: logged
    assert "rank 1: call failed, as the ranks agreed: prompt longer" in caplog.text
