import io
import math
import time

import pytest
import torch

from fairseq.logging import metrics
from fairseq.logging.logging_outputs import LoggingOutputSums
from fairseq.logging.meters import (
    AverageMeter,
    MaxMeter,
    MetersDict,
    MinMeter,
    StopwatchMeter,
    SumMeter,
    TimeMeter,
    safe_round,
)


@pytest.fixture(autouse=True)
def fresh_metrics():
    metrics.reset()
    yield
    metrics.reset()


# ---- meters ----------------------------------------------------------------------------------------


def test_average_meter_is_weighted_and_rounded():
    meter = AverageMeter(round=2)
    meter.update(2.0, 1)
    meter.update(4.0, 3)
    assert meter.avg == 3.5
    meter.update(1.0 / 3.0, 2)  # sum 14 + 2/3 over 6
    assert meter.smoothed_value == 2.44
    assert meter.val == 1.0 / 3.0


def test_average_meter_weight_zero_shows_latest_value_only_until_averaged():
    meter = AverageMeter()
    meter.update(0.001, 0)
    meter.update(0.002, 0)
    assert meter.smoothed_value == 0.002
    meter.update(10.0, 1)
    meter.update(99.0, 0)  # recorded as val, not averaged in
    assert meter.smoothed_value == 10.0
    assert meter.val == 99.0


def test_sum_max_min_meters():
    total, high, low = SumMeter(), MaxMeter(round=1), MinMeter(round=1)
    for value in (3, 7.26, 1.04, 5):
        total.update(value)
        high.update(value)
        low.update(value)
    assert total.smoothed_value == 3 + 7.26 + 1.04 + 5
    assert high.smoothed_value == 7.3
    assert low.smoothed_value == 1.0
    high.reset()
    assert high.smoothed_value is None


def test_safe_round_accepts_tensors_and_leaves_inf():
    assert safe_round(torch.tensor(2.34567), 2) == 2.35
    assert safe_round(float("inf"), 3) == float("inf")
    assert safe_round(None, 3) is None
    assert safe_round(7, None) == 7


def test_time_meter_rate_counts_from_its_start():
    meter = TimeMeter(round=0, start=time.perf_counter() - 4.0)
    meter.update(1000)
    meter.update(1000)
    assert meter.smoothed_value == pytest.approx(500.0, abs=1.0)


def test_time_meter_state_carries_elapsed_time_and_count():
    meter = TimeMeter(start=time.perf_counter() - 10.0)
    meter.update(600)
    restored = TimeMeter()
    restored.load_state_dict(meter.state_dict())
    assert restored.n == 600
    assert restored.init == pytest.approx(10.0, abs=0.5)
    assert restored.avg == pytest.approx(60.0, abs=3.0)


def test_stopwatch_sums_timed_spans_and_ignores_stop_without_start():
    watch = StopwatchMeter(round=1)
    watch.stop()
    assert watch.sum == 0.0
    for _ in range(2):
        watch.start()
        time.sleep(0.05)
        watch.stop(n=0)
    assert 0.1 <= watch.sum < 0.5
    assert watch.n == 0
    assert watch.smoothed_value == round(watch.sum, 1)
    watch.stop(n=0)  # already stopped: nothing added
    assert watch.smoothed_value == round(watch.sum, 1)


def test_meters_dict_orders_by_priority_then_insertion_and_hides_underscore_keys():
    meters = MetersDict()
    meters.add_meter("wps", AverageMeter(), 90)
    meters.add_meter("loss", AverageMeter(), 10)
    meters.add_meter("_hidden", AverageMeter(), 5)
    meters.add_meter("nll_loss", AverageMeter(), 10)
    meters.add_meter("gb_free", AverageMeter(), 1500)
    for key in meters:
        meters[key].update(1.0)
    assert list(meters.get_smoothed_values()) == ["loss", "nll_loss", "wps", "gb_free"]
    with pytest.raises(KeyError):
        meters.add_meter("loss", AverageMeter(), 10)


# ---- metrics aggregation ---------------------------------------------------------------------------


def test_values_go_to_every_active_aggregator():
    with metrics.aggregate("train"):
        with metrics.aggregate("train_inner"):
            metrics.log_scalar("loss", 4.0, weight=2)
        metrics.log_scalar("loss", 1.0, weight=2)
    assert metrics.get_smoothed_value("train_inner", "loss") == 4.0
    assert metrics.get_smoothed_value("train", "loss") == 2.5
    assert metrics.get_smoothed_value("default", "loss") == 2.5
    metrics.log_scalar("loss", 0.0, weight=4)  # outside: only "default" is active
    assert metrics.get_smoothed_value("train", "loss") == 2.5
    assert metrics.get_smoothed_value("default", "loss") == 1.25


def test_new_root_isolates_and_temporary_aggregators_vanish():
    with metrics.aggregate("train"):
        with metrics.aggregate(new_root=True) as valid:
            metrics.log_scalar("loss", 7.0)
            assert valid.get_smoothed_values() == {"loss": 7.0}
        metrics.log_scalar("lr", 0.1, weight=0)
    assert "loss" not in metrics.get_meters("train")
    assert "loss" not in metrics.get_meters("default")
    assert metrics.get_smoothed_values("train") == {"lr": 0.1}
    assert sorted(metrics.state_dict()) == ["default", "train"]


def test_aggregate_restores_active_set_after_an_exception():
    with pytest.raises(RuntimeError):
        with metrics.aggregate("train"):
            raise RuntimeError("boom")
    metrics.log_scalar("loss", 1.0)
    assert "loss" not in metrics.get_meters("train")


def test_derived_value_reads_other_meters_and_perplexity_rounds():
    with metrics.aggregate("valid"):
        metrics.log_scalar("loss", 3.0, weight=10, round=3)
        metrics.log_derived("ppl", lambda meters: metrics.get_perplexity(meters["loss"].avg))
    assert metrics.get_smoothed_values("valid") == {"loss": 3.0, "ppl": 8.0}
    assert metrics.get_perplexity(9.12345) == 557.74
    assert metrics.get_perplexity(5000.0) == float("inf")
    assert metrics.get_perplexity(None) == 0.0


def test_rate_logged_once_per_interval_counts_from_the_window_start():
    with metrics.aggregate("train_inner") as agg:
        agg.window_start -= 2.0  # as if the interval began two seconds ago
        metrics.log_speed("wps", 3000, round=1)
        assert metrics.get_smoothed_value("train_inner", "wps") == pytest.approx(1500.0, abs=5.0)
        metrics.reset_meters("train_inner")  # the next window starts now
        time.sleep(0.1)
        metrics.log_speed("wps", 800)
        before = time.perf_counter()
        rate = metrics.get_smoothed_value("train_inner", "wps")
        after = time.perf_counter()
        assert 800 / (after - agg.window_start) <= rate <= 800 / (before - agg.window_start)


def test_reset_meters_empties_values_but_keeps_keys():
    with metrics.aggregate("train_inner"):
        metrics.log_scalar("loss", 5.0)
        metrics.log_scalar_sum("retries", 2)
    metrics.reset_meters("train_inner")
    assert metrics.get_smoothed_values("train_inner") == {"loss": None, "retries": 0}
    metrics.reset_meters("never_created")  # no-op


def test_state_dict_round_trips_through_weights_only_torch_load():
    with metrics.aggregate("train"):
        metrics.log_scalar("loss", 6.5, weight=3, round=3)
        metrics.log_derived("ppl", lambda meters: metrics.get_perplexity(meters["loss"].avg))
        metrics.log_scalar_sum("tokens", 4096)
        metrics.log_max("max_cuda_gb_reserved", 12.3, priority=1500, round=1)
        metrics.log_speed("wps", 100, priority=90)
        metrics.log_start_time("train_wall", priority=800, round=0)
        metrics.log_stop_time("train_wall")
    buffer = io.BytesIO()
    torch.save({"metrics": metrics.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["metrics"]

    metrics.reset()
    metrics.load_state_dict(state)
    restored = metrics.get_meters("train")
    assert list(restored) == ["loss", "tokens", "wps", "train_wall", "max_cuda_gb_reserved"]  # ppl is derived
    assert (restored["loss"].sum, restored["loss"].count, restored["loss"].round) == (19.5, 3, 3)
    assert restored["tokens"].sum == 4096
    assert restored["max_cuda_gb_reserved"].smoothed_value == 12.3
    assert restored["wps"].n == 100


def test_load_state_dict_reads_upstream_layout_and_skips_unknown_meters():
    upstream_state = {
        "train": [
            (10, "loss", "AverageMeter", {"val": 2.0, "sum": 8.0, "count": 4, "round": 3}),
            (50, "custom", "SomeUpstreamOnlyMeter", {}),
            (800, "train_wall", "StopwatchMeter", {"sum": 12.7, "n": 0, "round": 0}),
        ]
    }
    metrics.load_state_dict(upstream_state)
    assert metrics.get_smoothed_values("train") == {"loss": 2.0, "train_wall": 13.0}


# ---- per-step sums, one host transfer per interval ----------------------------------------------------


def test_logging_output_sums_add_tensors_and_numbers_and_reset():
    sums = LoggingOutputSums()
    step_losses = [torch.tensor(2.5), torch.tensor(0.125), torch.tensor(1.0)]
    for step, loss in enumerate(step_losses):
        sums.add({"loss": loss, "ntokens": 100 + step, "nsentences": torch.tensor(4), "sample_size": 100 + step})
    assert sums.num_steps == 3
    reduced = sums.reduce()
    assert reduced == {"loss": 3.625, "ntokens": 303, "nsentences": 12, "sample_size": 303}
    assert type(reduced["ntokens"]) is int and type(reduced["nsentences"]) is int
    assert type(reduced["loss"]) is float
    assert sums.num_steps == 0 and len(sums) == 0
    assert sums.reduce() == {}


def test_logging_output_sums_accumulate_fp32_steps_in_float64():
    sums = LoggingOutputSums()
    step = torch.tensor(0.1, dtype=torch.float32)
    for _ in range(3):
        sums.add({"loss": step})
    as_double = float(step)
    assert sums.reduce()["loss"] == (as_double + as_double) + as_double


def test_logging_output_sums_reject_non_scalars():
    sums = LoggingOutputSums()
    with pytest.raises(ValueError, match="2 elements"):
        sums.add({"loss": torch.tensor([1.0, 2.0])})
    with pytest.raises(TypeError, match="str"):
        sums.add({"name": "x"})


def test_logging_output_sums_feed_criterion_style_reduction():
    """The reduced dict is what a criterion's reduce_metrics receives at the log boundary."""
    sums = LoggingOutputSums()
    for loss in (torch.tensor(690.0), torch.tensor(693.0)):
        sums.add({"loss": loss, "ntokens": 500, "sample_size": 500})
    output = sums.reduce()
    with metrics.aggregate("train_inner"):
        metrics.log_scalar("loss", output["loss"] / output["sample_size"] / math.log(2), output["sample_size"], round=3)
        metrics.log_derived("ppl", lambda meters: metrics.get_perplexity(meters["loss"].avg))
    assert metrics.get_smoothed_values("train_inner") == {
        "loss": round(1383.0 / 1000 / math.log(2), 3),
        "ppl": round(2 ** (1383.0 / 1000 / math.log(2)), 2),
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logging_output_sums_add_never_waits_for_the_gpu():
    device = torch.device("cuda", torch.cuda.current_device())
    losses = [torch.tensor(float(i), device=device) for i in range(5)]
    one = torch.tensor(1, device=device)
    sums = LoggingOutputSums()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronization raises
    try:
        for loss in losses:
            sums.add({"loss": loss * 2, "ntokens": 10, "nsentences": one})
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sums.reduce() == {"loss": 20.0, "ntokens": 50, "nsentences": 5}
