"""The training batches of `--task streaming_language_modeling`: a mixture of corpus streams, one global sequence
of samples whatever the number of data-parallel ranks, made in a background thread.

- Global order: sample g (g = 0, 1, ... over the whole run) comes from the corpus that uniform draw u(seed, g)
  picks under the rates (`corpus_draws`: a counter-based function of seed and g, so the mixture's RNG state is
  g itself), and is that corpus's next block. A global batch is `ranks x batch size` consecutive samples; rank r
  takes the r-th slice. Every rank computes the whole sequence (each tokenizes every corpus, in its own worker
  processes) and keeps its slice, so the order depends on g alone: resuming on another number of ranks
  continues the same sequence, ranks never share a sample, and the ranks of a tensor-parallel group (one
  data-parallel rank) get the same batch.
- State (`StreamingEpochIterator.state_dict`, stored in the checkpoint as the train iterator's): g, the rates,
  tokens per corpus, and each corpus's CorpusStream state after the last global batch handed to training.
  Batches prepared ahead are not in it: a resumed run makes them again, identically.
- The stream is endless (each corpus starts a new pass when its files run out): training ends at --max-update.
"""

import logging
import math
import queue
import threading
from typing import Callable, Dict, List, Optional

import numpy as np

from fairseq.data.iterators import CountingIterator, EpochBatchIterating
from fairseq.data.jsonl_corpus import CorpusError, fingerprint
from fairseq.data.monolingual_dataset import collate
from fairseq.logging import metrics
from fairseq.logging.progress_bar import UNBOUNDED
from fairseq.data.stream_blocks import CorpusStream

logger = logging.getLogger(__name__)

DRAWS_PER_BLOCK = 4096
ENDLESS = UNBOUNDED  # the length of the endless epoch (progress bars show no total for it)


def corpus_draws(seed: int, first: int, count: int) -> np.ndarray:
    """The uniform draws u(seed, g) for g in [first, first + count): a pure function of seed and g."""
    out = np.empty(count)
    g, filled = first, 0
    while filled < count:
        block, within = divmod(g, DRAWS_PER_BLOCK)
        draws = np.random.default_rng([seed, block]).random(DRAWS_PER_BLOCK)[within:]
        n = min(len(draws), count - filled)
        out[filled : filled + n] = draws[:n]
        filled, g = filled + n, g + n
    return out


class GlobalStream:
    """Samples of the mixture in global order (see the module docstring)."""

    def __init__(self, corpora: List[CorpusStream], rates: Dict[str, float], seed: int):
        self.corpora, self.seed = corpora, seed
        self.rates = {c.name: float(rates[c.name]) for c in corpora}
        weights = np.array([self.rates[c.name] for c in corpora])
        self._cumulative = np.cumsum(weights / weights.sum())
        self._cumulative[-1] = 1.0
        self.sample = 0  # samples made so far (g of the next one)
        self.tokens = {c.name: 0 for c in corpora}

    def picks(self, first: int, count: int) -> np.ndarray:
        """The corpus index of samples g = first, ..., first + count - 1."""
        return np.searchsorted(self._cumulative, corpus_draws(self.seed, first, count), side="right")

    def take(self, count: int) -> List[dict]:
        """The next `count` samples, as MonolingualDataset items with "id" = g and "corpus"."""
        items = []
        for k, c in enumerate(self.picks(self.sample, count).tolist()):
            corpus = self.corpora[c]
            source, target = corpus.next_block()
            self.tokens[corpus.name] += len(target)
            items.append({"id": self.sample + k, "source": source, "target": target, "corpus": corpus.name})
        self.sample += count
        return items

    def state(self, with_fingerprint: bool = False) -> dict:
        return {
            "sample": self.sample,
            "seed": self.seed,
            "rates": dict(self.rates),
            "tokens": dict(self.tokens),
            "corpora": {c.name: c.state(with_fingerprint) for c in self.corpora},
        }

    def load_state(self, state: dict, check_files: bool = True) -> None:
        saved = state["corpora"]
        missing = [c.name for c in self.corpora if c.name not in saved]
        gone = [name for name in saved if name not in self.tokens]
        if gone and check_files:
            files = ", ".join(saved[gone[0]]["files"][:2])
            raise CorpusError(
                f"corpus {gone[0]!r} of the checkpoint is no longer in the data ({files} removed); "
                "restore it, or pass --ignore-data-changes to continue without it"
            )
        for c in self.corpora:
            if c.name in saved:
                c.load_state(saved[c.name], check_files)
        if missing:
            logger.warning(f"corpora {missing} are new since the checkpoint: they start at their beginning")
        self.sample = int(state["sample"])
        self.tokens.update({k: int(v) for k, v in state["tokens"].items() if k in self.tokens})
        if state["rates"] != self.rates:
            logger.warning(
                f"data rates changed on resume at sample {self.sample:,}: {format_rates(state['rates'])}"
                f" -> {format_rates(self.rates)}"
            )

    def close(self) -> None:
        for c in self.corpora:
            c.close()


def format_rates(rates: Dict[str, float]) -> str:
    return ",".join(f"{k}={v:.4g}" for k, v in rates.items())


class StreamingEpochIterator(EpochBatchIterating):
    """The trainer's iterator over an endless GlobalStream (EpochBatchIterator's interface: the one epoch never
    ends). `make_stream()` builds a fresh stream (restored with `load_state_dict`'s state before the first
    batch); `batch_size` samples per rank and batch; rank `shard_id` of `num_shards`; `buffer_size` batches
    are made ahead by a background thread (--data-buffer-size)."""

    def __init__(
        self,
        make_stream: Callable[[], GlobalStream],
        batch_size: int,
        pad: int,
        num_shards: int = 1,
        shard_id: int = 0,
        buffer_size: int = 2,
        check_files: bool = True,
        log_tokens: bool = True,
    ):
        self.make_stream, self.batch_size, self.pad = make_stream, batch_size, pad
        self.num_shards, self.shard_id = num_shards, shard_id
        self.buffer_size, self.check_files, self.log_tokens = max(1, buffer_size), check_files, log_tokens
        self.epoch = 1
        self.shuffle = True
        self._resume: Optional[dict] = None
        self._consumed: Optional[dict] = None  # the stream state after the last batch handed out
        self._itr: Optional[CountingIterator] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._batches_done = 0

    def __len__(self) -> int:
        return ENDLESS

    @property
    def next_epoch_idx(self) -> int:
        return self.epoch

    @property
    def first_batch(self):
        return "DUMMY"  # every rank gets a full batch of every global batch: no dummy step is ever needed

    def end_of_epoch(self) -> bool:
        return False

    @property
    def iterations_in_epoch(self) -> int:
        return self._itr.n if self._itr is not None else self._batches_done

    def next_epoch_itr(self, shuffle: bool = True, fix_batches_to_gpus: bool = False, set_dataset_epoch: bool = True):
        if self._itr is None:
            self._itr = CountingIterator(self._batches(), start=self._batches_done, total=ENDLESS)
        return self._itr

    def _batches(self):
        results: "queue.Queue" = queue.Queue(self.buffer_size)
        stop = self._stop = threading.Event()  # this generator's: a later one gets its own
        self._thread = threading.Thread(target=self._produce, args=(results, stop), daemon=True, name="streaming-data")
        self._thread.start()
        try:
            while True:
                item = results.get()
                if isinstance(item, BaseException):
                    raise item
                batch, state = item
                self._consumed = state
                if self.log_tokens:
                    log_corpus_tokens(state)
                yield batch
        finally:
            stop.set()

    def close(self) -> None:
        """Stop making batches (the background thread ends, and with it the tokenizing workers)."""
        self._stop.set()

    def _produce(self, results: "queue.Queue", stop: threading.Event) -> None:
        stream = None
        try:
            stream = self.make_stream()
            if self._resume is not None:
                stream.load_state(self._resume, self.check_files)
            width = self.batch_size * self.num_shards
            while not stop.is_set():
                items = stream.take(width)
                mine = items[self.shard_id * self.batch_size : (self.shard_id + 1) * self.batch_size]
                _put(results, (collate(mine, self.pad), stream.state()), stop)
        except BaseException as e:  # handed to the training thread, which raises it
            _put(results, e, stop)
        finally:
            if stream is not None:
                stream.close()

    def state_dict(self) -> dict:
        state = self._consumed if self._consumed is not None else self._resume
        if state is not None:
            state = with_fingerprints(state)
        return {
            "version": 2,
            "epoch": self.epoch,
            "iterations_in_epoch": self.iterations_in_epoch,
            "shuffle": True,
            "streaming": state,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = int(state_dict.get("epoch", 1))
        self._batches_done = int(state_dict.get("iterations_in_epoch", 0))
        self._resume = state_dict.get("streaming")
        self._consumed, self._itr = None, None


def _put(results: "queue.Queue", item, stop: threading.Event) -> None:
    """Hand `item` to the training thread, unless it stopped asking (`stop`)."""
    while not stop.is_set():
        try:
            results.put(item, timeout=0.5)
            return
        except queue.Full:
            continue


def with_fingerprints(state: dict) -> dict:
    """`state` with each corpus's fingerprint of the file it reads (computed at save time only)."""
    corpora = {}
    for name, c in state["corpora"].items():
        c = dict(c)
        if "fingerprint" not in c:
            c["fingerprint"] = fingerprint(c["files"][c["file_index"]], c["offset"])
        corpora[name] = c
    return dict(state, corpora=corpora)


def log_corpus_tokens(state: dict) -> None:
    """Tokens seen per corpus so far (all ranks together) as log-line keys tokens_<corpus>."""
    for name, count in state["tokens"].items():
        metrics.log_scalar(f"tokens_{name}", count, weight=0, priority=900, round=0)


def rates_from_sizes(sizes: Dict[str, float], alpha: float, maximum: float) -> Dict[str, float]:
    """metaseq's alpha smoothing: p_i proportional to (min(size_i, maximum) / total) ** alpha (maximum <= 0:
    no cap)."""
    capped = np.array([min(s, maximum) if maximum > 0 else s for s in sizes.values()], dtype=float)
    p = (capped / capped.sum()) ** alpha
    p = p / p.sum()
    return {name: float(v) for name, v in zip(sizes, p)}


def parse_weights(text: str, corpora: List[str]) -> Dict[str, float]:
    """--data-weights "web=0.6,books=0.3": rates normalized to 1 (corpora not named get 0); ValueError naming
    the flag and the value for a bad one."""
    rates = {name: 0.0 for name in corpora}
    for part in [p for p in text.split(",") if p.strip()]:
        name, sep, value = part.partition("=")
        name = name.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not math.isfinite(weight):
            raise ValueError(f"--data-weights {text!r}: {part!r} is not CORPUS=WEIGHT (e.g. web=0.6,books=0.4)")
        if name not in rates:
            raise ValueError(
                f"--data-weights names corpus {name!r}, which the data does not have (corpora: {', '.join(corpora)})"
            )
        if weight < 0:
            raise ValueError(f"--data-weights {name}={value}: a weight must be >= 0")
        rates[name] = weight
    total = sum(rates.values())
    if total <= 0:
        raise ValueError(f"--data-weights {text!r}: all weights are 0; give at least one corpus a positive weight")
    return {k: v / total for k, v in rates.items()}
