"""Named aggregations of meters, with upstream fairseq's function names.

Values are logged with `log_scalar` & co. into every *active* aggregator: the always-active "default"
one plus those entered with `aggregate(name)`. The training loop keeps "train" (the epoch) and
"train_inner" (the log interval) active, logs once per interval, reads `get_smoothed_values(name)` for
the log line and then calls `reset_meters(name)`.

How this differs from upstream: values arrive once per log interval as Python numbers (summed on the
device step by step and converted in one transfer, see `fairseq.logging.logging_outputs`), so a rate
meter must count from the start of its window, not from its first update. `log_speed` therefore starts a
new `TimeMeter` at the aggregator's `window_start` and counts the first value (upstream drops it).

Usage::

    with metrics.aggregate("train"), metrics.aggregate("train_inner"):
        for ...:
            ...  # steps: device-side sums only
            if at_log_boundary:
                metrics.log_scalar("loss", loss_sum / sample_size / math.log(2), sample_size, round=3)
                metrics.log_speed("wps", ntokens, priority=90, round=1)
                progress.log(metrics.get_smoothed_values("train_inner"), tag="train_inner", step=n)
                metrics.reset_meters("train_inner")
"""

import contextlib
import uuid
from typing import Callable, Dict, Iterator, List, Optional

from .meters import (
    AverageMeter,
    DerivedMeter,
    MaxMeter,
    Meter,
    MetersDict,
    MinMeter,
    StopwatchMeter,
    SumMeter,
    TimeMeter,
    safe_round,
)

DEFAULT = "default"

# name -> MetersDict; "default" observes every logged value.
_aggregators: Dict[str, MetersDict] = {}
# name -> how many times that aggregation is currently entered (nesting the same name is allowed).
_active: Dict[str, int] = {}


def reset() -> None:
    """Forget every aggregator and start again with only "default" active."""
    _aggregators.clear()
    _active.clear()
    _aggregators[DEFAULT] = MetersDict()
    _active[DEFAULT] = 1


reset()


@contextlib.contextmanager
def aggregate(name: Optional[str] = None, new_root: bool = False) -> Iterator[MetersDict]:
    """Make the aggregator `name` active inside the block (created on first use, reused after).

    Without a name, a temporary aggregator is used. With `new_root=True` only this aggregator is
    active inside the block (validation uses this so its values stay out of "train" and "default").
    """
    if name is None:
        name = f"_tmp_{uuid.uuid4().hex}"
        agg = MetersDict()
        temporary = True
    else:
        if name == DEFAULT:
            raise ValueError('"default" is always active; aggregate under another name')
        agg = _aggregators.setdefault(name, MetersDict())
        temporary = False
    saved_active = None
    if new_root:
        saved_active = dict(_active)
        _active.clear()
    if temporary:
        _aggregators[name] = agg
    _active[name] = _active.get(name, 0) + 1
    try:
        yield agg
    finally:
        _active[name] -= 1
        if _active[name] == 0:
            del _active[name]
        if temporary:
            del _aggregators[name]
        if saved_active is not None:
            _active.clear()
            _active.update(saved_active)


def get_active_aggregators() -> List[MetersDict]:
    return [_aggregators[name] for name in _active]


def _meter_in(agg: MetersDict, key: str, make: Callable[[], Meter], priority: float) -> Meter:
    if key not in agg:
        agg.add_meter(key, make(), priority)
    return agg[key]


def log_scalar(key: str, value, weight: float = 1, priority: float = 10, round: Optional[int] = None) -> None:
    """Add `value` to a weighted average (weight 0: show the latest value without averaging)."""
    for agg in get_active_aggregators():
        _meter_in(agg, key, lambda: AverageMeter(round=round), priority).update(value, weight)


def log_scalar_sum(key: str, value, priority: float = 10, round: Optional[int] = None) -> None:
    """Add `value` to a sum reported as is."""
    for agg in get_active_aggregators():
        _meter_in(agg, key, lambda: SumMeter(round=round), priority).update(value)


def log_max(key: str, value, priority: float = 10, round: Optional[int] = None) -> None:
    """Report the largest value logged in the window."""
    for agg in get_active_aggregators():
        _meter_in(agg, key, lambda: MaxMeter(round=round), priority).update(value)


def log_min(key: str, value, priority: float = 10, round: Optional[int] = None) -> None:
    """Report the smallest value logged in the window."""
    for agg in get_active_aggregators():
        _meter_in(agg, key, lambda: MinMeter(round=round), priority).update(value)


def log_derived(key: str, fn: Callable[[MetersDict], object], priority: float = 20) -> None:
    """Report `fn(meters)`, computed from the aggregator's other meters when the line is made."""
    for agg in get_active_aggregators():
        _meter_in(agg, key, lambda: DerivedMeter(fn), priority)


def log_speed(key: str, value, priority: float = 30, round: Optional[int] = None) -> None:
    """Report the per-second rate of `value` (summed) since the aggregator's window started."""
    for agg in get_active_aggregators():
        _meter_in(agg, key, lambda: TimeMeter(round=round, start=agg.window_start), priority).update(value)


def log_start_time(key: str, priority: float = 40, round: Optional[int] = None) -> None:
    """Start the stopwatch `key`; `log_stop_time(key)` adds the elapsed seconds to it."""
    for agg in get_active_aggregators():
        _meter_in(agg, key, lambda: StopwatchMeter(round=round), priority).start()


def log_stop_time(key: str, weight: float = 0.0, prehook: Optional[Callable[[], None]] = None) -> None:
    """Stop the stopwatch `key`. weight > 0 reports the mean duration instead of the total.

    `prehook` runs first (for instance a device synchronize); by default nothing waits for the device.
    """
    for agg in get_active_aggregators():
        if key in agg:
            agg[key].stop(weight, prehook)


def log_custom(new_meter_fn: Callable[[], Meter], key: str, *args, priority: float = 50, **kwargs) -> None:
    """Log into a meter made by `new_meter_fn()`; extra arguments go to its `update`."""
    for agg in get_active_aggregators():
        _meter_in(agg, key, new_meter_fn, priority).update(*args, **kwargs)


def get_meters(name: str) -> Optional[MetersDict]:
    return _aggregators.get(name)


def get_meter(name: str, key: str) -> Optional[Meter]:
    agg = _aggregators.get(name)
    return None if agg is None else agg.get(key)


def get_smoothed_value(name: str, key: str):
    """Raises KeyError when nothing was logged under `name` and `key`."""
    return _aggregators[name].get_smoothed_value(key)


def get_smoothed_values(name: str) -> Dict[str, object]:
    """Raises KeyError when nothing was ever aggregated under `name`."""
    return _aggregators[name].get_smoothed_values()


def reset_meter(name: str, key: str) -> None:
    meter = get_meter(name, key)
    if meter is not None:
        meter.reset()


def reset_meters(name: str) -> None:
    """Reset every meter of `name` and start its window now (no-op when `name` does not exist)."""
    agg = _aggregators.get(name)
    if agg is not None:
        agg.reset()


def state_dict() -> Dict[str, list]:
    """{aggregator name: MetersDict state}: plain containers of numbers and strings."""
    return {name: agg.state_dict() for name, agg in _aggregators.items() if not name.startswith("_tmp_")}


def load_state_dict(state: Dict[str, list]) -> None:
    """Restore aggregators saved by `state_dict()` (or by upstream fairseq); others are left as they are."""
    for name, agg_state in state.items():
        agg = _aggregators.setdefault(name, MetersDict())
        agg.load_state_dict(agg_state)


def get_perplexity(loss, round: int = 2, base: float = 2):
    """base ** loss, rounded (a base-2 loss gives the usual perplexity); inf on overflow, 0 for None."""
    if loss is None:
        return 0.0
    try:
        return safe_round(base ** safe_round(loss, None), round)
    except OverflowError:
        return float("inf")


__all__ = [
    "aggregate",
    "get_active_aggregators",
    "get_meter",
    "get_meters",
    "get_perplexity",
    "get_smoothed_value",
    "get_smoothed_values",
    "load_state_dict",
    "log_custom",
    "log_derived",
    "log_max",
    "log_min",
    "log_scalar",
    "log_scalar_sum",
    "log_speed",
    "log_start_time",
    "log_stop_time",
    "reset",
    "reset_meter",
    "reset_meters",
    "state_dict",
]
