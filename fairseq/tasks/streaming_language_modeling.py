"""`--task streaming_language_modeling`: a language model trained on JSONL corpora tokenized on the fly
(metaseq's task and flag names; docs/streaming_data.md).

DATA/train/NN/<corpus>.jsonl[.gz|.zst] (fairseq.data.jsonl_corpus) is read as an endless weighted mixture of
corpora (fairseq.data.stream_iterator), tokenized by --num-workers processes ahead of training, and resumed
exactly from the checkpoint. DATA/valid/... is read whole: subset `valid` is every corpus, `valid_<corpus>`
one of them, so `--valid-subset valid,valid_web` logs valid_loss and valid_web_loss.
"""

import logging
import os
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from fairseq.data.jsonl_corpus import CorpusError, find_corpora
from fairseq.data.monolingual_dataset import MonolingualDataset
from fairseq.data.stream_blocks import CorpusStream
from fairseq.data.stream_iterator import (
    GlobalStream,
    StreamingEpochIterator,
    format_rates,
    parse_weights,
    rates_from_sizes,
)
from fairseq.data.stream_tokenizer import TokenizerSpec, bpe_spec_of, build_dictionary
from fairseq.data.worker_pool import make_pool
from fairseq.dataclass.configs import II, opt
from fairseq.registry import register_task
from fairseq.tasks.fairseq_task import FairseqTask
from fairseq.tasks.language_modeling import SAMPLE_BREAK_MODES

logger = logging.getLogger(__name__)


@dataclass
class StreamingLanguageModelingConfig:
    data: Optional[str] = opt(
        None, "data directory: DATA/train/NN/<corpus>.jsonl, DATA/valid/..., and DATA/dict.txt with --bpe (or none)"
    )
    hf_tokenizer: Optional[str] = opt("", "a HF tokenizers tokenizer.json (its ids are the model's)")
    vocab_filename: Optional[str] = opt("", "GPT-2 byte-level BPE vocab.json (with --merges-filename)")
    merges_filename: Optional[str] = opt("", "GPT-2 byte-level BPE merges.txt (with --vocab-filename)")
    end_of_document_symbol: str = opt("</s>", "symbol appended after each document")
    sample_break_mode: SAMPLE_BREAK_MODES = opt("none", "as --task language_modeling's (one definition for both)")
    tokens_per_sample: int = opt(1024, "maximum tokens per sample")
    max_target_positions: Optional[int] = opt(None, "maximum sequence length the model handles")
    multicorpus_sampling_alpha: float = opt(
        1.0,
        "corpus rates proportional to (size share) ** alpha (metaseq's smoothing; size = bytes of a corpus's files)",
    )
    multicorpus_sampling_maximum: float = opt(-1.0, "cap on a corpus's size in the smoothing (bytes; -1: none)")
    data_weights: str = opt("", "explicit corpus rates, e.g. web=0.6,books=0.3,code=0.1 (instead of alpha)")
    data_subshard_count: int = opt(
        1,
        "accepted for metaseq command lines; no effect here: resume seeks by byte "
        "offset, so there is nothing to fast-forward",
    )
    json_key: str = opt("text", "the JSON key holding a document's text")
    skip_invalid_documents: bool = opt(False, "skip (count and log) lines that are not valid JSON documents")
    ignore_data_changes: bool = opt(False, "resume even when a corpus's files changed since the checkpoint")
    # Owned by other groups: --seed, --num-workers (tokenizing processes), and the --bpe scheme's files.
    seed: int = II("common.seed", 1)
    num_workers: int = II("dataset.num_workers", 1)
    bpe: Optional[str] = II("bpe._name")
    gpt2_encoder_json: Optional[str] = II("bpe.gpt2_encoder_json")
    gpt2_vocab_bpe: Optional[str] = II("bpe.gpt2_vocab_bpe")
    sentencepiece_model: Optional[str] = II("bpe.sentencepiece_model")


def tokenizer_spec(cfg) -> TokenizerSpec:
    """The tokenizer `cfg` names: --hf-tokenizer, --vocab-filename/--merges-filename, else --bpe + dict.txt."""
    common = dict(
        end_of_document=cfg.end_of_document_symbol, json_key=cfg.json_key, skip_invalid=cfg.skip_invalid_documents
    )
    if cfg.hf_tokenizer:
        return TokenizerSpec("hf", (cfg.hf_tokenizer,), **common)
    if cfg.vocab_filename or cfg.merges_filename:
        if not (cfg.vocab_filename and cfg.merges_filename):
            raise ValueError("--vocab-filename and --merges-filename go together (GPT-2 BPE vocab.json and merges.txt)")
        return TokenizerSpec("gpt2_files", (cfg.vocab_filename, cfg.merges_filename), **common)
    files = {k: getattr(cfg, k) for k in ("gpt2_encoder_json", "gpt2_vocab_bpe", "sentencepiece_model")}
    bpe = bpe_spec_of(cfg.bpe, files) if cfg.bpe else None
    return TokenizerSpec("fairseq", (os.path.join(cfg.data, "dict.txt"),), bpe=bpe, **common)


@register_task("streaming_language_modeling", dataclass=StreamingLanguageModelingConfig)
class StreamingLanguageModelingTask(FairseqTask):
    """Train a left-to-right language model on a stream of JSONL corpora."""

    def __init__(self, cfg, dictionary, spec: TokenizerSpec):
        super().__init__(cfg)
        self.dictionary = self.output_dictionary = dictionary
        self.spec = spec
        self._train_corpora: Dict[str, list] = {}

    @classmethod
    def setup_task(cls, cfg, **kwargs) -> "StreamingLanguageModelingTask":
        if not cfg.data:
            raise ValueError(
                "--task streaming_language_modeling needs DATA: fairseq-train DATA ... (DATA/train/NN/<corpus>.jsonl)"
            )
        if cfg.data_subshard_count != 1:
            logger.warning(
                f"--data-subshard-count {cfg.data_subshard_count} has no effect here (resume seeks by byte offset)"
            )
        spec = tokenizer_spec(cfg)
        dictionary = build_dictionary(spec)
        logger.info(f"dictionary: {len(dictionary):,} types ({spec.kind}: {', '.join(spec.files)})")
        return cls(cfg, dictionary, spec)

    def _corpus_streams(self, split: str, pool=None, endless: bool = True):
        corpora = find_corpora(os.path.join(self.cfg.data, split))
        return corpora, [
            CorpusStream(
                name,
                files,
                self.spec,
                self.cfg.tokens_per_sample,
                self.cfg.sample_break_mode,
                self.dictionary.eos(),
                pool=pool,
                ahead=max(1, self.cfg.num_workers) + 1,
                endless=endless,
            )
            for name, files in corpora.items()
        ]

    def corpus_rates(self, corpora: Dict[str, list]) -> Dict[str, float]:
        cfg = self.cfg
        if cfg.data_weights:
            return parse_weights(cfg.data_weights, list(corpora))
        if cfg.multicorpus_sampling_alpha <= 0:
            raise ValueError(f"--multicorpus-sampling-alpha {cfg.multicorpus_sampling_alpha}: must be > 0")
        sizes = {name: float(sum(os.path.getsize(f) for f in files)) for name, files in corpora.items()}
        return rates_from_sizes(sizes, cfg.multicorpus_sampling_alpha, cfg.multicorpus_sampling_maximum)

    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, for_training: bool = False, **kwargs):
        """The training split: its corpora are only listed here (the iterator streams them). A validation subset
        (`valid`, or `valid_<corpus>`) is tokenized whole into blocks."""
        if for_training:
            self._train_corpora = find_corpora(os.path.join(self.cfg.data, split))
            rates = self.corpus_rates(self._train_corpora)
            logger.info(f"{split}: corpora {', '.join(self._train_corpora)}; rates {format_rates(rates)}")
            self.datasets[split] = _TrainSplit(split, rates)
            return self.datasets[split]
        self.datasets[split] = self._load_valid(split)
        return self.datasets[split]

    def _load_valid(self, subset: str) -> MonolingualDataset:
        split, _, only = subset.partition("_")
        split_dir = os.path.join(self.cfg.data, split)
        if not os.path.isdir(split_dir):
            raise CorpusError(
                f"no {split_dir} for --valid-subset {subset}: put DATA/{split}/NN/<corpus>.jsonl there, "
                "or pass --disable-validation"
            )
        corpora, streams = self._corpus_streams(split, endless=False)
        if only and only not in corpora:
            raise CorpusError(
                f"--valid-subset {subset}: {split_dir} has no corpus {only!r} (it has {', '.join(corpora)})"
            )
        items = []
        for stream in streams:
            if only and stream.name != only:
                continue
            block = stream.next_block()
            while block is not None:
                items.append((block[0], block[1], None))
                block = stream.next_block()
            stream.close()
        sizes = np.array([len(t) for _, t, _ in items], dtype=np.int64)
        logger.info(f"{subset}: {len(items):,} blocks from {only or ', '.join(corpora)}")
        return MonolingualDataset(items, sizes, self.dictionary, shuffle=False)

    def get_batch_iterator(
        self, dataset, max_tokens=None, max_sentences=None, num_shards: int = 1, shard_id: int = 0, **kwargs
    ):
        if not isinstance(dataset, _TrainSplit):
            return super().get_batch_iterator(
                dataset,
                max_tokens=max_tokens,
                max_sentences=max_sentences,
                num_shards=num_shards,
                shard_id=shard_id,
                **kwargs,
            )
        cfg = self.cfg
        batch_size = max_sentences or (max_tokens or 0) // cfg.tokens_per_sample
        if batch_size < 1:
            raise ValueError(
                f"--max-tokens {max_tokens} holds no block of --tokens-per-sample {cfg.tokens_per_sample}: "
                "pass --batch-size N (samples per rank) or a larger --max-tokens"
            )
        workers, rates, seed = cfg.num_workers, dataset.rates, kwargs.get("seed", cfg.seed)

        def make_stream():
            pool = make_pool(workers, preload=("fairseq.data.stream_tokenizer",)) if workers > 0 else None
            _, streams = self._corpus_streams(dataset.split, pool=pool)
            return _OwningStream(streams, rates, seed, pool)

        return StreamingEpochIterator(
            make_stream,
            batch_size,
            self.dictionary.pad(),
            num_shards=num_shards,
            shard_id=shard_id,
            buffer_size=kwargs.get("data_buffer_size") or 2,
            check_files=not cfg.ignore_data_changes,
        )

    def max_positions(self) -> Optional[int]:
        return self.cfg.max_target_positions  # the dictionaries: FairseqTask's, from self.dictionary


class _TrainSplit:
    """The training split of the streaming task: its name and rates (the iterator reads the files)."""

    def __init__(self, split: str, rates: Dict[str, float]):
        self.split, self.rates = split, rates
        self.sizes = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return 0


class _OwningStream(GlobalStream):
    """A GlobalStream that ends its tokenizing workers when closed."""

    def __init__(self, streams, rates, seed, pool):
        super().__init__(streams, rates, seed)
        self.pool = pool

    def close(self) -> None:
        super().close()
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
