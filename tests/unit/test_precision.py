"""fairseq.training.precision: upstream's dynamic loss scaler, compute dtypes, autocast and the fp16 scale window."""

import io
import random

import pytest
import torch

from fairseq.dataclass.configs import CommonConfig
from fairseq.training.precision import DynamicLossScaler, Precision, compute_dtype

CUDA = torch.device("cuda")  # only its type is read when building Precision; no CUDA call is made
CPU = torch.device("cpu")


def scales_after(scaler, outcomes):
    """The loss scale after each update (True = overflow)."""
    out = []
    for overflow in outcomes:
        scaler.update(overflow)
        out.append(scaler.loss_scale)
    return out


# ----------------------------------------------------------------------------- DynamicLossScaler


def test_scale_doubles_after_exactly_scale_window_clean_updates():
    scaler = DynamicLossScaler(init_scale=4.0, scale_window=3)
    # upstream: doubles when (iter - last_overflow_iter) % window == 0, last_overflow_iter starting at -1
    assert scales_after(scaler, [False] * 7) == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]


def test_update_returns_whether_to_skip():
    scaler = DynamicLossScaler(init_scale=4.0, scale_window=3)
    assert scaler.update(False) is False
    assert scaler.update(True) is True


def test_overflow_halves_and_restarts_the_window():
    scaler = DynamicLossScaler(init_scale=16.0, scale_window=3)
    # two clean updates, overflow (halve), then the window counts from the overflow: 3 clean updates to double
    outcomes = [False, False, True, False, False, False, False, False, False]
    assert scales_after(scaler, outcomes) == [16.0, 16.0, 8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 32.0]


def test_consecutive_overflows_halve_each_time_with_zero_tolerance():
    scaler = DynamicLossScaler(init_scale=64.0, scale_window=1000)
    assert scales_after(scaler, [True, True, True]) == [32.0, 16.0, 8.0]


def test_tolerance_counts_overflows_since_the_last_rescale():
    scaler = DynamicLossScaler(init_scale=64.0, scale_window=1000, tolerance=0.25)
    # iter 0: 1 overflow / 1 iteration since the (initial) rescale >= 0.25 -> halve, rescale at iter 0
    assert scales_after(scaler, [True]) == [32.0]
    scales_after(scaler, [False] * 7)  # iters 1..7
    # iter 8: 1/8 < 0.25 keep; iter 9: 2/9 < 0.25 keep; iter 10: 3/10 >= 0.25 halve
    assert scales_after(scaler, [True, True, True]) == [32.0, 32.0, 16.0]
    # the counter restarted at iter 10: iter 11 has 1/1 -> halve at once
    assert scales_after(scaler, [True]) == [8.0]


def test_tolerated_overflow_is_still_skipped_and_restarts_the_window():
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=3, tolerance=0.5)
    scales_after(scaler, [True])  # iter 0: 1/1 -> 4.0, rescale at 0
    scales_after(scaler, [False])  # iter 1: (1 - 0) % 3 != 0
    assert scaler.update(True) is True  # iter 2: 1/2 >= 0.5 -> halve to 2.0
    assert scaler.loss_scale == 2.0
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=3, tolerance=0.6)
    scales_after(scaler, [True, False])  # 4.0, rescale at iter 0
    assert scaler.update(True) is True  # iter 2: 1/2 < 0.6: tolerated, but the update is still skipped
    assert scaler.loss_scale == 4.0
    # the window counts from that tolerated overflow (iter 2): doubles at iter 5, not at iter 3
    assert scales_after(scaler, [False, False, False]) == [4.0, 4.0, 8.0]


def test_threshold_is_a_floor_when_decreasing_not_a_ceiling():
    scaler = DynamicLossScaler(init_scale=4.0, scale_window=1, threshold=1.5)
    assert scales_after(scaler, [True, True, True]) == [2.0, 1.5, 1.5]
    # raising is not capped by the threshold (upstream: "threshold FP16 loss scale from below")
    assert scales_after(scaler, [False, False]) == [3.0, 6.0]


def test_min_loss_scale_raises_and_restores_the_previous_scale():
    scaler = DynamicLossScaler(init_scale=1.0, scale_window=1000, min_loss_scale=0.25)
    assert scales_after(scaler, [True]) == [0.5]
    with pytest.raises(FloatingPointError, match="minimum loss scale reached"):
        scaler.update(True)  # 0.25 <= min_loss_scale
    assert scaler.loss_scale == 0.5


def test_default_min_loss_scale_is_reached_at_the_21st_overflow():
    scaler = DynamicLossScaler()  # init 2**7, min 1e-4
    for _ in range(20):
        scaler.update(True)
    assert scaler.loss_scale == 2.0**7 / 2**20  # 1.22e-4 > 1e-4
    with pytest.raises(FloatingPointError):
        scaler.update(True)  # 6.1e-5 <= 1e-4
    assert scaler.loss_scale == 2.0**7 / 2**20


def test_threshold_above_min_loss_scale_never_raises():
    scaler = DynamicLossScaler(init_scale=1.0, scale_window=1000, threshold=0.5, min_loss_scale=0.25)
    assert scales_after(scaler, [True] * 50)[-1] == 0.5


def _sequence(seed, n):
    rng = random.Random(seed)
    return [rng.random() < 0.3 for _ in range(n)]


def test_state_dict_round_trip_continues_identically():
    kwargs = dict(init_scale=2.0**10, scale_window=4, tolerance=0.3, threshold=None, min_loss_scale=1e-8)
    # midpoint: 3 clean updates since the last overflow and rescale (a fresh scaler would have 0)
    first = [True, False, False, False, False, True, False, False]
    rest = [False, False] + _sequence(1, 200)
    a = DynamicLossScaler(**kwargs)
    midpoint_scale = scales_after(a, first)[-1]
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)  # plain values: loadable with weights_only=True
    buf.seek(0)
    b = DynamicLossScaler(**kwargs)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b.loss_scale == a.loss_scale == midpoint_scale
    expected = scales_after(a, rest)
    assert scales_after(b, rest) == expected
    # the test is sensitive to the counters: a scaler given only the scale diverges
    c = DynamicLossScaler(**dict(kwargs, init_scale=midpoint_scale))
    assert scales_after(c, rest) != expected


# ----------------------------------------------------------------------------- Precision


def common(**kw):
    return CommonConfig(**kw)


def test_compute_dtype():
    assert compute_dtype(common()) == torch.float32
    assert compute_dtype(common(bf16=True)) == torch.bfloat16
    assert compute_dtype(common(fp16=True)) == torch.float16


def test_fp16_on_cpu_is_a_clear_value_error():
    with pytest.raises(ValueError, match=r"--fp16 needs a CUDA device"):
        Precision(common(fp16=True), CPU, sharded=False)


@pytest.mark.parametrize("dp, uf, expected", [(1, 1, 2**14), (4, 2, 2048), (3, 1, 5461), (2**15, 1, 1)])
def test_default_scale_window_is_2_pow_14_over_replicas_and_update_freq(dp, uf, expected):
    p = Precision(common(fp16=True), CUDA, sharded=False, data_parallel_size=dp, update_freq=uf)
    assert p.scaler.scale_window == expected


def test_fp16_scaler_takes_the_command_line_values():
    cfg = common(
        fp16=True,
        fp16_scale_window=100,
        fp16_init_scale=8.0,
        fp16_scale_tolerance=0.25,
        threshold_loss_scale=0.5,
        min_loss_scale=0.01,
    )
    p = Precision(cfg, CUDA, sharded=True, data_parallel_size=8, update_freq=4)
    s = p.scaler
    assert (s.scale_window, s.loss_scale, s.tolerance, s.threshold, s.min_loss_scale) == (100, 8.0, 0.25, 0.5, 0.01)
    assert p.loss_scale == 8.0
    assert p.scale_loss(torch.tensor(3.0)).item() == 24.0
    assert p.state_dict()["loss_scale"] == 8.0


@pytest.mark.parametrize(
    "kw, sharded, expected",
    [(dict(), False, False), (dict(), True, False), (dict(bf16=True), False, True), (dict(bf16=True), True, False)],
)
def test_autocast_only_when_not_sharded_and_not_fp32_cpu(kw, sharded, expected):
    p = Precision(common(**kw), CPU, sharded=sharded)
    assert p.use_autocast is expected
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with p.autocast():
        out = a @ b
    assert out.dtype == (torch.bfloat16 if expected else torch.float32)


@pytest.mark.parametrize("sharded, expected", [(False, True), (True, False)])
def test_fp16_autocast_flag(sharded, expected):
    assert Precision(common(fp16=True), CUDA, sharded=sharded).use_autocast is expected


def test_without_fp16_there_is_no_scaling():
    p = Precision(common(bf16=True), CPU, sharded=False)
    assert p.scaler is None and p.loss_scale == 1.0
    loss = torch.tensor(3.5)
    assert p.scale_loss(loss) is loss
    assert p.state_dict() == {}
    p.load_state_dict({})  # accepted, nothing to restore


def test_precision_state_round_trip():
    a = Precision(common(fp16=True, fp16_scale_window=2), CUDA, sharded=False)
    for overflow in [True, False, False, False]:
        a.scaler.update(overflow)
    b = Precision(common(fp16=True, fp16_scale_window=2), CUDA, sharded=False)
    b.load_state_dict(a.state_dict())
    assert b.loss_scale == a.loss_scale == 128.0  # 64 after the overflow, doubled after 2 clean ones
    assert b.state_dict() == a.state_dict()
