"""Meters: small accumulators of Python numbers that produce one smoothed value for a log line.

Meters hold host numbers. The trainer sums per-step values on the device and hands meters Python numbers
once per log interval (see `fairseq.logging.logging_outputs`), so updating a meter never waits for the GPU.

`state_dict()` of every meter and of `MetersDict` contains only str/int/float/None, lists, tuples and
dicts, so a checkpoint holding them loads with `torch.load(weights_only=True)`. The state keys are those
upstream fairseq writes (`val`/`sum`/`count`/`round`, `init`/`n`/`round`, ...), so meter states move
between the two in both directions.
"""

import bisect
import math
import time
from typing import Callable, Dict, List, Optional, Tuple


def to_number(value):
    """A one-element tensor or numpy scalar as a Python number; anything else unchanged.

    Duck-typed (`.item()`) so that this module does not import torch.
    """
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "item") and hasattr(value, "numel") and value.numel() == 1:
        return value.item()
    return value


def safe_round(value, ndigits: Optional[int]):
    """round() that also accepts one-element tensors and numpy scalars, and leaves None and inf alone."""
    value = to_number(value)
    if ndigits is None or value is None or not isinstance(value, (int, float)):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return value
    return round(value, ndigits)


class Meter:
    """A value accumulated over a logging window."""

    def reset(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    @property
    def smoothed_value(self):
        raise NotImplementedError


class AverageMeter(Meter):
    """Weighted average of the values given to `update(val, n)`.

    A weight of 0 records the value without adding it to the average: while nothing has been added with a
    positive weight, the smoothed value is the latest value (how `lr` and `num_updates` are logged).
    """

    def __init__(self, round: Optional[int] = None):
        self.round = round
        self.reset()

    def reset(self) -> None:
        self.val = None
        self.sum = 0
        self.count = 0

    def update(self, val, n=1) -> None:
        if val is None:
            return
        self.val = val
        if n > 0:
            self.sum = self.sum + val * n
            self.count = self.count + n

    @property
    def avg(self):
        return self.sum / self.count if self.count > 0 else self.val

    @property
    def smoothed_value(self):
        return safe_round(self.avg, self.round)

    def state_dict(self) -> dict:
        return {
            "val": to_number(self.val),
            "sum": to_number(self.sum),
            "count": to_number(self.count),
            "round": self.round,
        }

    def load_state_dict(self, state: dict) -> None:
        self.val = state["val"]
        self.sum = state["sum"]
        self.count = state["count"]
        self.round = state.get("round")


class SumMeter(Meter):
    """Sum of the values given to `update(val)`."""

    def __init__(self, round: Optional[int] = None):
        self.round = round
        self.reset()

    def reset(self) -> None:
        self.sum = 0

    def update(self, val) -> None:
        if val is not None:
            self.sum = self.sum + val

    @property
    def smoothed_value(self):
        return safe_round(self.sum, self.round)

    def state_dict(self) -> dict:
        return {"sum": to_number(self.sum), "round": self.round}

    def load_state_dict(self, state: dict) -> None:
        self.sum = state["sum"]
        self.round = state.get("round")


class _ExtremeMeter(Meter):
    """Largest (or smallest) value given to `update(val)` in the window; None before the first."""

    def __init__(self, round: Optional[int] = None):
        self.round = round
        self.reset()

    def reset(self) -> None:
        self.value = None

    def _better(self, new, old) -> bool:
        raise NotImplementedError

    def update(self, val) -> None:
        if val is not None and (self.value is None or self._better(val, self.value)):
            self.value = val

    @property
    def smoothed_value(self):
        return safe_round(self.value, self.round)

    def state_dict(self) -> dict:
        return {"value": to_number(self.value), "round": self.round}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
        self.round = state.get("round")


class MaxMeter(_ExtremeMeter):
    """Peak of a quantity over the window (e.g. peak GPU memory over an epoch of log intervals)."""

    def _better(self, new, old) -> bool:
        return new > old


class MinMeter(_ExtremeMeter):
    """Minimum of a quantity over the window (e.g. the least free GPU memory)."""

    def _better(self, new, old) -> bool:
        return new < old


class TimeMeter(Meter):
    """Rate per second: the sum of the values given to `update(val)` over the seconds since the start.

    `init` is elapsed time carried over from a checkpoint; `start` (a `time.perf_counter()` reading)
    lets a meter created in the middle of a window count from the window's beginning.
    """

    def __init__(self, init: float = 0, n=0, round: Optional[int] = None, start: Optional[float] = None):
        self.round = round
        self.reset(init, n, start)

    def reset(self, init: float = 0, n=0, start: Optional[float] = None) -> None:
        self.init = init
        self.n = n
        self.start = time.perf_counter() if start is None else start

    def update(self, val=1) -> None:
        self.n = self.n + val

    @property
    def elapsed_time(self) -> float:
        return self.init + (time.perf_counter() - self.start)

    @property
    def avg(self):
        elapsed = self.elapsed_time
        return self.n / elapsed if elapsed > 0 else 0.0

    @property
    def smoothed_value(self):
        return safe_round(self.avg, self.round)

    def state_dict(self) -> dict:
        return {"init": self.elapsed_time, "n": to_number(self.n), "round": self.round}

    def load_state_dict(self, state: dict) -> None:
        self.reset(init=state["init"], n=state.get("n", 0))
        self.round = state.get("round")


class StopwatchMeter(Meter):
    """Seconds spent between `start()` and `stop()` calls, summed (e.g. `train_wall`).

    `stop(n)` with n > 0 also counts events, and the smoothed value becomes the mean duration per event;
    with n = 0 (the default for logged times) it is the total. Before any stop it is the time since start.
    """

    def __init__(self, round: Optional[int] = None):
        self.round = round
        self.sum = 0.0
        self.n = 0
        self.start_time = None

    def start(self) -> None:
        self.start_time = time.perf_counter()

    def stop(self, n=1, prehook: Optional[Callable[[], None]] = None) -> None:
        if self.start_time is None:
            return
        if prehook is not None:
            prehook()
        self.sum += time.perf_counter() - self.start_time
        self.n = self.n + n
        self.start_time = None

    def reset(self) -> None:
        self.sum = 0.0
        self.n = 0
        self.start()

    @property
    def avg(self) -> float:
        return self.sum / self.n if self.n > 0 else self.sum

    @property
    def elapsed_time(self) -> float:
        return 0.0 if self.start_time is None else time.perf_counter() - self.start_time

    @property
    def smoothed_value(self):
        return safe_round(self.avg if self.sum > 0 else self.elapsed_time, self.round)

    def state_dict(self) -> dict:
        return {"sum": self.sum, "n": to_number(self.n), "round": self.round}

    def load_state_dict(self, state: dict) -> None:
        self.sum = state["sum"]
        self.n = state["n"]
        self.start_time = None
        self.round = state.get("round")


class DerivedMeter(Meter):
    """A value computed from the other meters of the same `MetersDict` when read (e.g. `ppl` from `loss`).

    It holds a function, so it is left out of `state_dict()`; whoever logged it logs it again.
    """

    def __init__(self, fn: Callable[["MetersDict"], object]):
        self.fn = fn

    def reset(self) -> None:
        pass


METER_CLASSES = {cls.__name__: cls for cls in (AverageMeter, SumMeter, MaxMeter, MinMeter, TimeMeter, StopwatchMeter)}


class MetersDict(dict):
    """Meters by key, iterated in order of (priority, insertion).

    `window_start` is the `time.perf_counter()` reading when the dict was created or last reset: rate
    meters added during a window count from it, so a rate logged once per interval covers the interval.
    """

    def __init__(self):
        super().__init__()
        self._order: List[Tuple[float, int, str]] = []
        self.window_start = time.perf_counter()

    def add_meter(self, key: str, meter: Meter, priority: float) -> None:
        if key in self:
            raise KeyError(f"meter {key!r} already exists")
        bisect.insort(self._order, (priority, len(self._order), key))
        super().__setitem__(key, meter)

    def __setitem__(self, key, value):
        raise TypeError("use add_meter(key, meter, priority)")

    def __iter__(self):
        return (key for _, _, key in self._order)

    def keys(self):
        return list(self)

    def values(self):
        return [self[key] for key in self]

    def items(self):
        return [(key, self[key]) for key in self]

    def priority(self, key: str) -> float:
        return next(pri for pri, _, k in self._order if k == key)

    def get_smoothed_value(self, key: str):
        meter = self[key]
        if isinstance(meter, DerivedMeter):
            return meter.fn(self)
        return meter.smoothed_value

    def get_smoothed_values(self) -> Dict[str, object]:
        """Every smoothed value in priority order; keys starting with "_" are internal and left out."""
        return {key: self.get_smoothed_value(key) for key in self if not key.startswith("_")}

    def reset(self) -> None:
        self.window_start = time.perf_counter()
        for meter in self.values():
            if isinstance(meter, TimeMeter):
                meter.reset(start=self.window_start)
            else:
                meter.reset()

    def state_dict(self) -> list:
        """[(priority, key, meter class name, meter state), ...] (upstream fairseq's layout)."""
        return [
            (pri, key, type(self[key]).__name__, self[key].state_dict())
            for pri, _, key in self._order
            if not isinstance(self[key], DerivedMeter)
        ]

    def load_state_dict(self, state: list) -> None:
        """Replace the meters with those in `state`; meter classes this project lacks are skipped."""
        dict.clear(self)
        self._order.clear()
        for pri, key, class_name, meter_state in state:
            meter_class = METER_CLASSES.get(class_name)
            if meter_class is None:
                continue
            meter = meter_class()
            meter.load_state_dict(meter_state)
            self.add_meter(key, meter, pri)
