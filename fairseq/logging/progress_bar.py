"""Progress bars that write upstream fairseq's log lines (json, simple, tqdm, none), and wrappers that
also send the numbers to TensorBoard or Weights & Biases.

Lines go through the `logging` module. With `setup_logging()`'s format a JSON line reads

    2024-05-01 12:00:00 | INFO | train_inner | {"epoch": 1, "update": 0.25, "loss": "9.123", ...}

The third field is the tag of the line (`train_inner`, `train`, `valid`): each line is emitted through
this module's logger as a record named after the tag (upstream renames its logger for the duration of
the call; building the record directly gives the same line without touching shared state).
"""

import atexit
import json
import logging
import os
import sys
from numbers import Number
from typing import Dict, Iterable, Optional

from tqdm import tqdm

from .meters import AverageMeter, StopwatchMeter, TimeMeter

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def make_formatter() -> logging.Formatter:
    return logging.Formatter(fmt=LOG_FORMAT, datefmt=DATE_FORMAT)


def add_log_file(log_file: str) -> logging.FileHandler:
    """Also write every log record to `log_file` (appending); adding the same file twice is a no-op."""
    root = logging.getLogger()
    path = os.path.abspath(log_file)
    for handler in root.handlers:
        if isinstance(handler, logging.FileHandler) and handler.baseFilename == path:
            return handler
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(make_formatter())
    root.addHandler(handler)
    return handler


def setup_logging(
    log_file: Optional[str] = None, level: Optional[str] = None, stream=None
) -> Optional[logging.FileHandler]:
    """Configure the root logger as upstream's command-line tools do: the line format above, on stdout (or
    `stream`), at level INFO (or $LOGLEVEL); plus `log_file` when given (its handler is returned). A root logger
    that already has handlers keeps them (as `logging.basicConfig` would)."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(stream or sys.stdout)
        handler.setFormatter(make_formatter())
        root.addHandler(handler)
    root.setLevel((level or os.environ.get("LOGLEVEL", "INFO")).upper())
    return None if log_file is None else add_log_file(log_file)


def _is_rank_zero() -> bool:
    import torch.distributed as dist  # deferred: startup (keeps fairseq.logging torch-free)

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def progress_bar(
    iterator: Iterable,
    log_format: Optional[str] = None,
    log_interval: int = 100,
    log_file: Optional[str] = None,
    epoch: Optional[int] = None,
    prefix: Optional[str] = None,
    default_log_format: str = "tqdm",
    tensorboard_logdir: Optional[str] = None,
    wandb_project: Optional[str] = None,
    wandb_run_name: Optional[str] = None,
) -> "BaseProgressBar":
    """A progress bar over `iterator` in `log_format` (`default_log_format` when None).

    tqdm is used only when stderr is a terminal; otherwise the simple format is used. TensorBoard and
    W&B wrappers are added on rank 0 only.
    """
    log_format = log_format or default_log_format
    if log_file is not None:
        add_log_file(log_file)
    if log_format == "tqdm" and not sys.stderr.isatty():
        log_format = "simple"
    if log_format == "json":
        bar = JsonProgressBar(iterator, epoch, prefix, log_interval)
    elif log_format == "simple":
        bar = SimpleProgressBar(iterator, epoch, prefix, log_interval)
    elif log_format == "tqdm":
        bar = TqdmProgressBar(iterator, epoch, prefix)
    elif log_format == "none":
        bar = NoopProgressBar(iterator, epoch, prefix)
    else:
        raise ValueError(f"unknown log format {log_format!r}: expected json, simple, tqdm or none")
    if (tensorboard_logdir or wandb_project) and _is_rank_zero():
        if tensorboard_logdir:
            bar = TensorboardProgressBarWrapper(bar, tensorboard_logdir)
        if wandb_project:
            bar = WandBProgressBarWrapper(bar, wandb_project, run_name=wandb_run_name)
    return bar


def read_json_log(path: str, tag: str = "train_inner") -> list:
    """The stats dicts of the `tag` lines of a log written with --log-format json, in order."""
    marker = f"| {tag} | "
    with open(path) as f:
        return [json.loads(line.split(marker, 1)[1]) for line in f if marker in line]


def format_stat(stat):
    """A stat as it appears in a log line: numbers with "{:g}" (after the meters' rounding), meters by
    their kind, one-element or larger tensors as Python values; anything else unchanged."""
    if isinstance(stat, Number):
        return "{:g}".format(stat)
    if isinstance(stat, AverageMeter):
        return "{:.3f}".format(stat.avg)
    if isinstance(stat, TimeMeter):
        return "{:g}".format(round(stat.avg))
    if isinstance(stat, StopwatchMeter):
        return "{:g}".format(round(stat.sum))
    if hasattr(stat, "tolist"):
        return stat.tolist()
    return stat


def _emit(tag: Optional[str], message: str) -> None:
    """Log `message` at INFO through this module's logger, as a record named `tag`."""
    if not logger.isEnabledFor(logging.INFO):
        return
    record = logger.makeRecord(tag or logger.name, logging.INFO, __file__, 0, message, (), None)
    logger.handle(record)


class BaseProgressBar:
    """Iterates over `iterable`; `log()` writes interval lines, `print()` end-of-epoch/validation lines."""

    def __init__(self, iterable: Iterable, epoch: Optional[int] = None, prefix: Optional[str] = None):
        self.iterable = iterable
        # a resumable iterator knows how far it already is into the epoch
        self.n = getattr(iterable, "n", 0)
        self.epoch = epoch
        parts = []
        if epoch is not None:
            parts.append("epoch {:03d}".format(epoch))
        if prefix is not None:
            parts.append(prefix)
        self.prefix = " | ".join(parts)

    def __len__(self) -> int:
        return len(self.iterable)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def __iter__(self):
        raise NotImplementedError

    def log(self, stats: Dict, tag: Optional[str] = None, step: Optional[int] = None) -> None:
        raise NotImplementedError

    def print(self, stats: Dict, tag: Optional[str] = None, step: Optional[int] = None) -> None:
        raise NotImplementedError

    def update_config(self, config: Dict) -> None:
        pass

    @staticmethod
    def _formatted(stats: Dict) -> Dict[str, str]:
        return {key: str(format_stat(value)) for key, value in stats.items()}

    @classmethod
    def _commas(cls, stats: Dict) -> str:
        return ", ".join(f"{key}={value.strip()}" for key, value in cls._formatted(stats).items())

    @classmethod
    def _pipes(cls, stats: Dict) -> str:
        return " | ".join(f"{key} {value.strip()}" for key, value in cls._formatted(stats).items())


# The length of an endless epoch (the streaming task's): positions are shown without it, and no fraction of
# the epoch is logged.
UNBOUNDED = 1 << 50


class _CountingBar(BaseProgressBar):
    """Tracks the position within the epoch; logs only when the step is a multiple of log_interval."""

    def __init__(self, iterable, epoch=None, prefix=None, log_interval: int = 1000):
        super().__init__(iterable, epoch, prefix)
        self.log_interval = log_interval
        self.i: Optional[int] = None
        self.size: Optional[int] = None

    def __iter__(self):
        self.size = len(self.iterable)
        if self.size >= UNBOUNDED:
            self.size = None
        for i, obj in enumerate(self.iterable, start=self.n):
            self.i = i
            yield obj

    def _due(self, step: Optional[int]) -> bool:
        step = step or self.i or 0
        return step > 0 and self.log_interval is not None and step % self.log_interval == 0


class JsonProgressBar(_CountingBar):
    """One JSON object per line: epoch, update (epoch - 1 + fraction of the epoch done), then the stats."""

    def log(self, stats, tag=None, step=None):
        if not self._due(step):
            return
        update = None
        if self.epoch is not None and self.i is not None and self.size:
            update = self.epoch - 1 + (self.i + 1) / float(self.size)
        _emit(tag, json.dumps(self._json_stats(stats, self.epoch, update)))

    def print(self, stats, tag=None, step=None):
        if tag is not None:
            stats = {f"{tag}_{key}": value for key, value in stats.items()}
        _emit(tag, json.dumps(self._json_stats(stats, self.epoch)))

    @staticmethod
    def _json_stats(stats: Dict, epoch: Optional[int] = None, update: Optional[float] = None) -> Dict:
        line = {}
        if epoch is not None:
            line["epoch"] = epoch
        if update is not None:
            line["update"] = round(update, 3)
        for key, value in stats.items():
            line[key] = format_stat(value)
        return line


class SimpleProgressBar(_CountingBar):
    """`epoch 001:    100 / 1000 loss=9.123, ppl=557.3, ...` lines for logs that are not terminals."""

    def log(self, stats, tag=None, step=None):
        if not self._due(step):
            return
        position = 0 if self.i is None else self.i + 1
        size = len(self.iterable) if self.size is None else self.size
        of = f" / {size:d}" if size < UNBOUNDED else ""
        _emit(tag, "{}:  {:5d}{} {}".format(self.prefix, position, of, self._commas(stats)))

    def print(self, stats, tag=None, step=None):
        _emit(tag, "{} | {}".format(self.prefix, self._pipes(stats)))


class TqdmProgressBar(BaseProgressBar):
    """A tqdm bar on stderr whose postfix shows the latest stats; `print()` lines as in the simple format."""

    def __init__(self, iterable, epoch=None, prefix=None):
        super().__init__(iterable, epoch, prefix)

        self.tqdm = tqdm(
            iterable,
            self.prefix,
            leave=False,
            total=float("inf") if len(iterable) >= UNBOUNDED else None,  # inf: tqdm shows no total
            file=sys.stderr,
            disable=(logger.getEffectiveLevel() > logging.INFO),
        )

    def __iter__(self):
        return iter(self.tqdm)

    def __exit__(self, *exc):
        self.tqdm.close()
        return False

    def log(self, stats, tag=None, step=None):
        self.tqdm.set_postfix(self._formatted(stats), refresh=False)

    def print(self, stats, tag=None, step=None):
        _emit(tag, "{} | {}".format(self.prefix, self._pipes(stats)))


class NoopProgressBar(BaseProgressBar):
    """Iterates; logs nothing."""

    def __iter__(self):
        return iter(self.iterable)

    def log(self, stats, tag=None, step=None):
        pass

    def print(self, stats, tag=None, step=None):
        pass


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _scalar(value) -> Optional[float]:
    """The number a dashboard should plot for a stat, or None when it is not a single number."""
    if isinstance(value, AverageMeter):
        value = value.val
    if hasattr(value, "numel") and value.numel() == 1:
        value = value.item()
    if isinstance(value, Number) and not isinstance(value, bool):
        return value
    return None


class _WrapperBar(BaseProgressBar):
    """Delegates to a wrapped bar and also sends each log/print call's numbers to `_record`."""

    def __init__(self, wrapped_bar: BaseProgressBar):
        self.wrapped_bar = wrapped_bar

    def __len__(self):
        return len(self.wrapped_bar)

    def __iter__(self):
        return iter(self.wrapped_bar)

    def __enter__(self):
        self.wrapped_bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.wrapped_bar.__exit__(*exc)

    def log(self, stats, tag=None, step=None):
        self._record(stats, tag, step)
        self.wrapped_bar.log(stats, tag=tag, step=step)

    def print(self, stats, tag=None, step=None):
        self._record(stats, tag, step)
        self.wrapped_bar.print(stats, tag=tag, step=step)

    def update_config(self, config):
        self.wrapped_bar.update_config(config)

    @staticmethod
    def _scalars(stats: Dict, step: Optional[int]):
        """(step, {key: number}) without num_updates, which is the step; step None: nothing to plot."""
        if step is None:
            step = _scalar(stats.get("num_updates"))
        values = {key: _scalar(value) for key, value in stats.items() if key != "num_updates"}
        return (None if step is None else int(step)), {k: v for k, v in values.items() if v is not None}

    def _record(self, stats, tag, step):
        raise NotImplementedError


# one SummaryWriter per (logdir, tag) for the whole process, closed at exit
_tensorboard_writers: Dict[str, object] = {}


def _close_tensorboard_writers() -> None:
    for writer in _tensorboard_writers.values():
        writer.close()
    _tensorboard_writers.clear()


class TensorboardProgressBarWrapper(_WrapperBar):
    """Writes every stat as a scalar to `<logdir>/<tag>/` event files (step = num_updates)."""

    def __init__(self, wrapped_bar, tensorboard_logdir: str):
        super().__init__(wrapped_bar)
        self.tensorboard_logdir = tensorboard_logdir
        try:
            from torch.utils.tensorboard import SummaryWriter  # deferred: optional
        except ImportError:
            SummaryWriter = None
            _warn_once("tensorboard not found: pip install tensorboard (continuing without --tensorboard-logdir)")
        self._summary_writer_class = SummaryWriter

    def _writer(self, tag: Optional[str]):
        path = os.path.join(self.tensorboard_logdir, tag or "")
        if path not in _tensorboard_writers:
            if not _tensorboard_writers:
                atexit.register(_close_tensorboard_writers)
            writer = self._summary_writer_class(path)
            writer.add_text("sys.argv", " ".join(sys.argv))
            _tensorboard_writers[path] = writer
        return _tensorboard_writers[path]

    def _record(self, stats, tag, step):
        if self._summary_writer_class is None:
            return
        step, values = self._scalars(stats, step)
        if step is None:
            return
        writer = self._writer(tag)
        for key, value in values.items():
            writer.add_scalar(key, value, step)
        writer.flush()


class WandBProgressBarWrapper(_WrapperBar):
    """Logs every stat to Weights & Biases as `<tag>/<key>` (WANDB_MODE=offline is honoured by wandb)."""

    def __init__(self, wrapped_bar, wandb_project: str, run_name: Optional[str] = None):
        super().__init__(wrapped_bar)
        try:
            import wandb  # deferred: optional
        except ImportError:
            wandb = None
            _warn_once("wandb not found: pip install wandb (continuing without --wandb-project)")
        self._wandb = wandb
        # one run per process: later bars (next epoch, validation) log into the run already started
        if wandb is not None and wandb.run is None:
            wandb.init(project=wandb_project, name=run_name)

    def update_config(self, config):
        if self._wandb is not None:
            self._wandb.config.update(config)
        self.wrapped_bar.update_config(config)

    def _record(self, stats, tag, step):
        if self._wandb is None:
            return
        step, values = self._scalars(stats, step)
        if not values:
            return
        prefix = "" if tag is None else tag + "/"
        self._wandb.log({prefix + key: value for key, value in values.items()}, step=step)
