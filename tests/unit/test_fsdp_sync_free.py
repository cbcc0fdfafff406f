"""The wait logic of --fsdp-sync-free (ReshardEventLimiter) with stand-in events, and the order in which
SyncFreeHooks drive it through forward and backward (on a plain model: FSDP itself is in
tests/distributed/test_fsdp_parallelize.py).

The stand-in GPU never finishes anything on its own: an event completes only when the CPU waits on it
(or on a later one, as events on one stream complete in order). So "full parameters still alive on the
GPU" is exactly "gathered, and the event of its freeing not yet completed", and any missing wait shows
up as more layers alive.
"""

import logging

import pytest
import torch
import torch.nn as nn

from fairseq.distributed.fsdp_prefetch import prefetch_plan
from fairseq.distributed.sync_free import CPU_SYNC_FREE_NOTICE, ReshardEventLimiter, SyncFreeHooks


class SlowStream:
    def __init__(self):
        self.recorded = []
        self.completed_upto = -1
        self.label = None  # what the next recorded event marks, set by the driver
        self.waits = []  # labels of the events the CPU waited on, in order

    def event(self):
        return StandInEvent(self)


class StandInEvent:
    def __init__(self, stream):
        self.stream = stream
        self.index = None
        self.label = None

    def record(self):
        self.index = len(self.stream.recorded)
        self.label = self.stream.label
        self.stream.recorded.append(self)

    def synchronize(self):
        assert self.index is not None, "waited on an event that was never recorded"
        self.stream.waits.append(self.label)
        self.stream.completed_upto = max(self.stream.completed_upto, self.index)

    def query(self):
        return self.index is not None and self.index <= self.stream.completed_upto


class Driver:
    """Calls the limiter in the order FSDP2 plus SyncFreeHooks do, and tracks what is alive on the GPU."""

    def __init__(self, limiter, stream):
        self.limiter = limiter
        self.stream = stream
        self.alive = {}  # layer -> event of its freeing (None until freed), for gathers not yet freed
        self.freed_events = []
        self.max_alive = 0
        self.log = []  # (layer gathered, labels waited on just before)

    def unshard(self, layer):
        waits_before = len(self.stream.waits)
        new = layer not in self.alive
        self.limiter.before_unshard(layer)
        if not new:
            assert len(self.stream.waits) == waits_before, "a layer already gathered must not wait"
            return
        self.alive[layer] = None
        self.log.append((layer, self.stream.waits[waits_before:]))
        # Full parameters exist from the all-gather until the GPU is past the point where they were freed.
        pending = [e for e in self.freed_events if not e.query()]
        self.max_alive = max(self.max_alive, len(self.alive) + len(pending))

    def reshard(self, layer, phase):
        # Mark on the stream where the parameters were freed (FSDP frees them before the limiter's hook
        # runs, so this marker precedes the limiter's event and completes with it).
        marker = self.stream.event()
        marker.record()
        self.freed_events.append(marker)
        del self.alive[layer]
        self.stream.label = f"{phase}{layer}"
        self.limiter.on_reshard(layer)

    def step(self, num_layers, prefetch):
        """One forward and backward, as FSDP2 issues them (see fairseq/distributed/fsdp.py)."""
        plan = prefetch_plan(num_layers, 1, explicit=prefetch)
        self.limiter.start_pass()  # SyncFreeHooks' root pre-forward
        for j in plan.root_forward:
            self.unshard(j)
        for i in range(num_layers):
            self.unshard(i)
            for j in plan.layer_forward[i]:
                self.unshard(j)
            self.reshard(i, "fwd")
        for j in plan.root_backward:
            self.unshard(j)
        for i in reversed(range(num_layers)):
            self.unshard(i)
            for j in plan.layer_backward[i]:
                self.unshard(j)
            self.reshard(i, "bwd")


def make(max_in_flight=2):
    stream = SlowStream()
    return Driver(ReshardEventLimiter(max_in_flight, stream.event), stream), stream


def test_four_layers_forward_then_backward_waits_on_the_layer_two_gathers_back():
    driver, _ = make()
    driver.step(4, prefetch=False)
    assert driver.log == [
        (0, []),
        (1, []),
        (2, ["fwd0"]),
        (3, ["fwd1"]),  # forward: layer i waits for layer i-2
        (3, ["fwd2"]),  # backward: the root gathers the last layer again
        (2, ["fwd3"]),
        (1, ["bwd3"]),
        (0, ["bwd2"]),  # then layer i waits for layer i+2's backward
    ]
    driver.step(4, prefetch=False)  # the sequence runs on into the next iteration
    assert driver.log[8:10] == [(0, ["bwd1"]), (1, ["bwd0"])]
    assert driver.max_alive == 2


def test_with_forward_prefetch_the_wait_moves_to_where_the_prefetch_is_issued():
    driver, _ = make()
    driver.step(4, prefetch=True)
    # Same all-gather order and waits; layer i+1's gather (and wait) now happens in layer i's pre-forward.
    assert driver.log == [
        (0, []),
        (1, []),
        (2, ["fwd0"]),
        (3, ["fwd1"]),
        (3, ["fwd2"]),
        (2, ["fwd3"]),
        (1, ["bwd3"]),
        (0, ["bwd2"]),
    ]
    assert driver.max_alive == 2


@pytest.mark.parametrize("prefetch", [False, True])
def test_never_more_than_two_layers_alive_over_several_steps(prefetch):
    driver, stream = make()
    for _ in range(3):
        driver.step(6, prefetch)
    assert driver.max_alive == 2
    assert len(stream.waits) == 3 * 12 - 2  # every gather but the first two waits on exactly one event


def test_without_waiting_the_gpu_backlog_grows():
    """The measure above can fail: with no events, nothing bounds how many layers are alive."""
    stream = SlowStream()
    driver = Driver(ReshardEventLimiter(2, None), stream)
    driver.step(6, prefetch=False)
    assert stream.waits == []
    assert driver.max_alive == 12  # every gather of the step, forward and backward


def test_deeper_prefetch_needs_a_wider_window():
    driver, _ = make(max_in_flight=3)
    plan = prefetch_plan(5, 2, explicit=True)
    for j in plan.root_forward:
        driver.unshard(j)
    for i in range(5):
        driver.unshard(i)
        for j in plan.layer_forward[i]:
            driver.unshard(j)
        driver.reshard(i, "fwd")
    assert driver.log == [(0, []), (1, []), (2, []), (3, ["fwd0"]), (4, ["fwd1"])]
    assert driver.max_alive == 3


def test_no_reshard_after_forward_keeps_every_layer_and_waits_for_nothing_in_backward():
    driver, stream = make()
    for i in range(4):  # forward: gathered, never freed
        driver.unshard(i)
    for i in reversed(range(4)):  # backward: nothing to gather, each layer freed after its gradient
        driver.unshard(i)
        driver.reshard(i, "bwd")
    assert [waits for _, waits in driver.log] == [[], [], [], []]
    # Next forward: gathers 0..2 must all be freed on the GPU before gather 4; layer 0 was freed last.
    driver.unshard(0)
    assert stream.waits == ["bwd0"]


def relaxed(pressure_by_pass, layers=6):
    """A limiter with the window apply_fsdp gives it (one update's gathers + 2) and a probe that answers, for
    pass k (0-based), pressure_by_pass[k]."""
    stream = SlowStream()
    answers = iter(pressure_by_pass)
    limiter = ReshardEventLimiter(
        2, stream.event, relaxed_in_flight=2 * layers + 2, pressure_probe=lambda: next(answers)
    )
    return Driver(limiter, stream), stream


def test_without_allocator_pressure_the_wait_is_one_update_back():
    driver, stream = relaxed([False] * 3)
    for _ in range(3):
        driver.step(6, prefetch=False)
    # 14 gathers in flight at most (a step of 6 layers gathers 12 times), and every wait is on the event
    # of the gather 14 before: one update and two layers back.
    assert driver.max_alive == 14
    gathers = [layer for layer, _ in driver.log]
    waited = [(i, waits) for i, (_, waits) in enumerate(driver.log) if waits]
    assert [i for i, _ in waited] == list(range(14, 36))
    assert all(len(waits) == 1 for _, waits in waited)
    assert len(stream.waits) == 36 - 14
    assert gathers[14:16] == [2, 3]  # pass 2, forward layers 2 and 3 ...
    assert stream.waits[:2] == ["fwd0", "fwd1"]  # ... wait on pass 1's forward of layers 0 and 1
    assert driver.limiter.pressured_passes == 0 and driver.limiter.window == 14


def test_under_pressure_the_window_closes_to_two_layers_and_opens_again(caplog):
    driver, stream = relaxed([False, True, False, True])
    driver.step(6, prefetch=False)
    assert stream.waits == []  # 12 gathers: none is 14 back yet
    with caplog.at_level(logging.INFO, logger="fairseq.distributed.sync_free"):
        driver.step(6, prefetch=False)  # pressure: the first gather waits for all but the last 2 to be freed
    assert driver.log[12] == (0, ["bwd1"])
    assert [waits for _, waits in driver.log[13:24]] == [
        [w] for w in ["bwd0", "fwd0", "fwd1", "fwd2", "fwd3", "fwd4", "fwd5", "bwd5", "bwd4", "bwd3", "bwd2"]
    ]
    driver.step(6, prefetch=False)  # no pressure: back to 14 gathers in flight, no wait until they build up
    assert [waits for _, waits in driver.log[24:36]] == [[]] * 12
    driver.step(6, prefetch=False)
    assert driver.max_alive == 14
    assert driver.limiter.passes == 4 and driver.limiter.pressured_passes == 2
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "under pressure" in messages[0] and "waiting 2 layers back" in messages[0]


def test_the_relaxed_window_cannot_be_tighter_than_the_pressured_one():
    with pytest.raises(ValueError, match=r"relaxed_in_flight \(1\) must be at least max_in_flight \(2\)"):
        ReshardEventLimiter(2, relaxed_in_flight=1)


def test_max_in_flight_must_be_positive():
    with pytest.raises(ValueError, match="max_in_flight"):
        ReshardEventLimiter(0)


def test_cpu_limiter_waits_for_nothing_and_says_so_once(caplog):
    with caplog.at_level(logging.INFO, logger="fairseq.distributed.sync_free"):
        limiter = ReshardEventLimiter.for_device(torch.device("cpu"))
        stream = SlowStream()
        driver = Driver(limiter, stream)
        for _ in range(2):
            driver.step(4, prefetch=True)
    assert not limiter.waits
    assert stream.waits == []
    assert len(stream.recorded) == 2 * 8  # only the driver's own markers: the limiter recorded nothing
    assert [r.getMessage() for r in caplog.records].count(CPU_SYNC_FREE_NOTICE) == 1
    assert CPU_SYNC_FREE_NOTICE == "--fsdp-sync-free: no CUDA streams on CPU; the wait has nothing to wait for"


# ------------------------------------------------------------------ SyncFreeHooks on a plain model


class RecordingLimiter(ReshardEventLimiter):
    def __init__(self):
        super().__init__(2, None)
        self.calls = []

    def before_unshard(self, layer):
        self.calls.append(("gather", layer))
        super().before_unshard(layer)

    def on_reshard(self, layer):
        self.calls.append(("free", layer))
        super().on_reshard(layer)


class Decoder(nn.Module):
    def __init__(self, num_layers, dim):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Model(nn.Module):
    def __init__(self, num_layers=3, dim=4):
        super().__init__()
        self.decoder = Decoder(num_layers, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        return self.head(self.decoder(x))


@pytest.mark.parametrize("prefetch", [False, True])
def test_hooks_announce_gathers_before_and_frees_after_each_layer_in_backward(prefetch):
    torch.manual_seed(0)
    model = Model(num_layers=3)
    limiter = RecordingLimiter()
    hooks = SyncFreeHooks(limiter, prefetch_plan(3, 1, explicit=prefetch), reshard_after_forward=True)
    hooks.install(model, model.decoder.layers)
    x = torch.randn(2, 4, requires_grad=True)  # as the embeddings' output is
    reference = Model(num_layers=3)
    reference.load_state_dict(model.state_dict())

    out = model(x)
    forward = [
        ("gather", 0),
        ("gather", 1),
        ("free", 0),
        ("gather", 1),
        ("gather", 2),
        ("free", 1),
        ("gather", 2),
        ("free", 2),
    ]
    if not prefetch:
        forward = [("gather", 0), ("free", 0), ("gather", 1), ("free", 1), ("gather", 2), ("free", 2)]
    else:
        forward = [("gather", 0)] + forward  # the root prefetches layer 0
    assert limiter.calls == forward
    del limiter.calls[:]

    out.square().sum().backward()
    # Each layer's pre-backward (its own gather, then the one before it) runs before the layer's
    # gradient, and its free is reported once the gradient has passed through it.
    assert limiter.calls == [
        ("gather", 2),  # the root's backward prefetch
        ("gather", 2),
        ("gather", 1),
        ("free", 2),
        ("gather", 1),
        ("gather", 0),
        ("free", 1),
        ("gather", 0),
        ("free", 0),
    ]
    # Identity in value and gradient.
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)

    with torch.no_grad():  # no backward: nothing routed through autograd, forward order unchanged
        del limiter.calls[:]
        model(x)
    assert limiter.calls == forward
    hooks.remove()
    del limiter.calls[:]
    model(x)
    assert limiter.calls == []


def test_hooks_outputs_can_be_modified_in_place():
    model = Model(num_layers=2)
    SyncFreeHooks(RecordingLimiter(), prefetch_plan(2, 1, False), True).install(model, model.decoder.layers)
    out = model(torch.randn(2, 4))
    out.mul_(2)  # outputs are not views of the hooks' inputs
    out.sum().backward()
    assert model.decoder.layers[0].weight.grad is not None


def test_a_layer_whose_input_needs_no_gradient_is_reported_freed_at_the_next_forward():
    model = Model(num_layers=2)
    limiter = RecordingLimiter()
    SyncFreeHooks(limiter, prefetch_plan(2, 1, False), True).install(model, model.decoder.layers)
    x = torch.randn(2, 4)  # no gradient: FSDP frees layer 0 in its end-of-backward callback
    model(x).sum().backward()
    assert limiter.gathered_layers() == [0]
    del limiter.calls[:]
    model(x)
    assert limiter.calls[:2] == [("free", 0), ("gather", 0)]


class StandInAllocator:
    """torch.cuda's device queries as AllocatorPressure uses them, for this CPU-only tier (the real ones run in
    tests/gpu/test_fsdp_sync_free_gpu.py). Like torch, they refuse a device that names no GPU."""

    def __init__(self, total, fraction):
        self.total, self.fraction = total, fraction
        self.stats = {"num_alloc_retries": 0, "reserved_bytes.all.current": 0}

    @staticmethod
    def _index(device):
        if device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return device.index

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda d: (self._index(d), type("P", (), {"total_memory": self.total}))[1],
        )
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: (self._index(d), self.fraction)[1])
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda d: (self._index(d), dict(self.stats))[1])


def test_allocator_pressure_reads_retries_and_reserved_memory_of_the_current_gpu(monkeypatch):
    from fairseq.distributed.sync_free import AllocatorPressure

    allocator = StandInAllocator(total=1000, fraction=0.5)
    allocator.install(monkeypatch)
    probe = AllocatorPressure(torch.device("cuda"))  # as apply_fsdp passes it: the mesh's type, no index
    assert probe.device == torch.device("cuda", 3) and probe.capacity == 500
    readings = [probe()]
    allocator.stats["reserved_bytes.all.current"] = 475  # 95% of what the process may use
    readings.append(probe())
    allocator.stats["reserved_bytes.all.current"] = 474
    readings.append(probe())
    allocator.stats["num_alloc_retries"] = 1
    readings += [probe(), probe()]  # a retry counts once
    allocator.stats["num_alloc_retries"] = 0  # the accumulated statistics were reset
    readings.append(probe())
    allocator.stats["num_alloc_retries"] = 1
    readings.append(probe())
    assert readings == [False, True, False, True, False, False, True]
