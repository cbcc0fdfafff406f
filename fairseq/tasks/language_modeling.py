"""`--task language_modeling`: next-token prediction over binarized text (upstream's flags and data path).

DATA is a directory written by fairseq-preprocess (`dict.txt`, `train.bin/.idx`, `valid.bin/.idx`, ...)
or several such directories joined by `:`; epoch e reads the directory `paths[(e - 1) % len(paths)]`
(the dictionary always comes from the first one).
"""

import logging
import os
from dataclasses import dataclass
from typing import List, Literal, Optional

import numpy as np
import torch

from fairseq.data.data_utils import load_indexed_dataset
from fairseq.data.dictionary import Dictionary, TruncatedDictionary  # noqa: F401 (also upstream's name here)
from fairseq.data.lm_context_window_dataset import InCorpusOrder, with_context_window
from fairseq.data.monolingual_dataset import MonolingualDataset
from fairseq.data.token_block_dataset import TokenBlockDataset, maybe_shorten_dataset
from fairseq.dataclass.configs import II, opt
from fairseq.registry import register_task
from fairseq.tasks.fairseq_task import FairseqTask

logger = logging.getLogger(__name__)

SAMPLE_BREAK_MODES = Literal["none", "complete", "complete_doc", "eos"]
SHORTEN_METHODS = Literal["none", "truncate", "random_crop"]


@dataclass
class LanguageModelingConfig:
    data: Optional[str] = opt(None, "path to the data directory (several: path1:path2, one per epoch in turn)")
    sample_break_mode: SAMPLE_BREAK_MODES = opt(
        "none",
        "none: fill each sample with --tokens-per-sample tokens, crossing sentence ends; complete: samples of "
        "whole sentences, up to --tokens-per-sample tokens; complete_doc: the same without crossing documents "
        "(separated by empty lines); eos: one sentence per sample",
    )
    tokens_per_sample: int = opt(1024, "maximum tokens per sample")
    output_dictionary_size: int = opt(-1, "predict only the first N symbols; later ones become <unk> (-1: all)")
    self_target: bool = opt(False, "not supported: language models here predict the next token only")
    future_target: bool = opt(False, "predict the next token (the default)")
    past_target: bool = opt(False, "not supported: language models here predict the next token only")
    add_bos_token: bool = opt(False, "prepend <s> to every sample (to the source and the target, as upstream)")
    max_target_positions: Optional[int] = opt(None, "maximum sequence length the model handles")
    shorten_method: SHORTEN_METHODS = opt(
        "none", "shorten sentences longer than --tokens-per-sample before blocking: truncate or random_crop"
    )
    shorten_data_split_list: str = opt("", "comma-separated splits to shorten (empty: all splits)")
    pad_to_fixed_length: bool = opt(False, "pad every batch to --tokens-per-sample positions")
    pad_to_fixed_bsz: bool = opt(False, "pad every batch to --batch-size rows (--batch-size-valid for valid)")
    # Owned by the common and dataset groups (--seed, --batch-size, --batch-size-valid), as upstream.
    seed: int = II("common.seed", 1)
    batch_size: Optional[int] = II("dataset.batch_size")
    batch_size_valid: Optional[int] = II("dataset.batch_size_valid")


# Break modes that pack blocks up to --tokens-per-sample tokens: nearly every block has about that many.
PACKED_BREAK_MODES = ("none", "complete", "complete_doc")


def check_token_budget(cfg) -> None:
    """--max-tokens (or --max-tokens-valid) below --tokens-per-sample with packed blocks: nearly every block is
    longer than a batch may be and would be skipped, so the run would train (or validate) on almost nothing.
    A pure contradiction of flags, refused before any data is read (eos mode, where only long lines are
    skipped, is judged on the data: fairseq.training.batch_iterators)."""
    task, dataset = cfg.task, cfg.dataset
    tokens_per_sample, mode = getattr(task, "tokens_per_sample", None), getattr(task, "sample_break_mode", None)
    if tokens_per_sample is None or mode not in PACKED_BREAK_MODES:
        return
    budgets = [("--max-tokens", dataset.max_tokens)]
    if not dataset.disable_validation:
        budgets.append(("--max-tokens-valid", dataset.max_tokens_valid))
    for flag, value in budgets:
        check_block_budget(flag, value, tokens_per_sample, mode)


def check_block_budget(
    flag: str, value: Optional[int], block: Optional[int], mode: Optional[str], context_window: int = 0
) -> None:
    """ValueError when a batch budget (`flag` `value`) is below the `block` tokens that --sample-break-mode
    `mode` packs (nearly) every block to (fairseq-train, fairseq-eval-lm); `context_window`: eval-lm's blocks
    are --tokens-per-sample less --context-window tokens."""
    if block is None or mode not in PACKED_BREAK_MODES or not value or value >= block:
        return
    given = f"--tokens-per-sample {block + context_window}"
    if context_window:
        given += f" less --context-window {context_window}"
    raise ValueError(
        f"{flag} {value} is less than {given}: with --sample-break-mode {mode} (nearly) every block has {block} "
        f"tokens and would be skipped; raise {flag} to at least {block}, or lower --tokens-per-sample to at most "
        f"{value + context_window}"
    )


def split_paths(data: str):
    return [p for p in data.split(os.pathsep) if p]


@register_task("language_modeling", dataclass=LanguageModelingConfig)
class LanguageModelingTask(FairseqTask):
    """Train or evaluate a left-to-right language model."""

    def __init__(self, cfg: LanguageModelingConfig, dictionary: Dictionary, output_dictionary=None):
        super().__init__(cfg)
        self.dictionary = dictionary
        self.output_dictionary = output_dictionary if output_dictionary is not None else dictionary
        self._split_sources = {}  # split -> its file and counts, for messages (describe_split)

    @classmethod
    def setup_task(cls, cfg: LanguageModelingConfig, **kwargs) -> "LanguageModelingTask":
        if cfg.self_target or cfg.past_target:
            raise ValueError(
                "--self-target and --past-target are not supported: language models here predict "
                "the next token (--future-target, the default); drop those flags"
            )
        if not cfg.data:
            raise ValueError(
                "--task language_modeling needs a data directory: fairseq-train DATA_DIR ... "
                "(a directory written by fairseq-preprocess)"
            )
        dictionary = load_dictionary(split_paths(cfg.data)[0])
        output_dictionary = dictionary
        if cfg.output_dictionary_size >= 0:
            output_dictionary = TruncatedDictionary(dictionary, cfg.output_dictionary_size)
        return cls(cfg, dictionary, output_dictionary)

    def load_dataset(
        self, split: str, epoch: int = 1, combine: bool = False, for_training: bool = False, **kwargs
    ) -> MonolingualDataset:
        """Load `split` from the data directory of `epoch`, as token blocks with next-token targets.

        `for_training` (the trainer's training split) adds the check that the dictionary is not larger than
        the one the data was binarized with (a warning: see fairseq.data.data_utils.check_dictionary_matches).
        """
        cfg = self.cfg
        paths = split_paths(cfg.data)
        data_path = paths[(epoch - 1) % len(paths)]
        split_path = os.path.join(data_path, split)
        dataset = load_indexed_dataset(split_path, self.dictionary, combine=combine, expect_all_ids=for_training)
        if dataset is None:
            raise MissingSplit(split, split_path)
        dataset = maybe_shorten_dataset(
            dataset, split, cfg.shorten_data_split_list, cfg.shorten_method, cfg.tokens_per_sample, cfg.seed
        )
        blocks = TokenBlockDataset(
            dataset,
            dataset.sizes,
            cfg.tokens_per_sample,
            pad=self.dictionary.pad(),
            eos=self.dictionary.eos(),
            break_mode=cfg.sample_break_mode,
            include_targets=True,
        )
        pad_to_bsz = None
        if cfg.pad_to_fixed_bsz:
            pad_to_bsz = cfg.batch_size_valid if "valid" in split else cfg.batch_size
        self.datasets[split] = MonolingualDataset(
            blocks,
            blocks.sizes,
            self.dictionary,
            self.output_dictionary,
            shuffle=True,
            add_bos_token=cfg.add_bos_token,
            fixed_pad_length=cfg.tokens_per_sample if cfg.pad_to_fixed_length else None,
            pad_to_bsz=pad_to_bsz,
        )
        logger.info(
            f"{split_path}: {len(dataset):,} sentences, {len(blocks):,} blocks "
            f"(--sample-break-mode {cfg.sample_break_mode}, --tokens-per-sample {cfg.tokens_per_sample})"
        )
        shard = f"shard {(epoch - 1) % len(paths) + 1} of {len(paths)} in DATA: " if len(paths) > 1 else ""
        self._split_sources[split] = f"{shard}{split_path}.bin: {len(dataset):,} sentences, {len(blocks):,} blocks"
        return self.datasets[split]

    def build_dataset_for_inference(self, src_tokens: List[torch.Tensor], src_lengths, **kwargs) -> MonolingualDataset:
        """Prompts for generation or scoring, as upstream lays them out: each sentence without its trailing
        </s>, as source behind </s> (<s> with --add-bos-token) and as target followed by <pad>; batches are
        right-padded (`task.get_batch_iterator(dataset, ...)` batches it; `inference_step` reads it)."""
        dictionary = self.source_dictionary
        start = dictionary.bos() if self.cfg.add_bos_token else dictionary.eos()
        items = []
        for tokens in src_tokens:
            tokens = torch.as_tensor(tokens, dtype=torch.long)
            while len(tokens) and tokens[-1] == dictionary.eos():  # upstream strips </s> at both ends
                tokens = tokens[:-1]
            while len(tokens) and tokens[0] == dictionary.eos():
                tokens = tokens[1:]
            items.append(
                (
                    torch.cat([tokens.new_full((1,), start), tokens]),
                    torch.cat([tokens, tokens.new_full((1,), dictionary.pad())]),
                    None,
                )
            )
        return MonolingualDataset(
            items, np.asarray(src_lengths), dictionary, self.output_dictionary, shuffle=False, add_bos_token=False
        )

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None, on_tokens=None):
        """Continue each prompt of `sample` (from build_dataset_for_inference): its source without the leading
        </s> (or <s>) is forced, generation starts from that token, as upstream. `on_tokens`: stream the
        tokens (SequenceGenerator.generate)."""
        if constraints is not None:
            raise ValueError(
                "--constraints (lexically constrained decoding) is not supported with --task "
                "language_modeling (upstream refuses it too)"
            )
        bos_token = self.source_dictionary.bos() if self.cfg.add_bos_token else self.source_dictionary.eos()
        with torch.no_grad():
            src_tokens = sample["net_input"]["src_tokens"]
            if prefix_tokens is None and src_tokens.nelement():
                prefix_tokens = src_tokens
                if prefix_tokens[:, 0].eq(bos_token).all():
                    prefix_tokens = prefix_tokens[:, 1:]
            streaming = {} if on_tokens is None else {"on_tokens": on_tokens}
            return generator.generate(models, sample, prefix_tokens=prefix_tokens, bos_token=bos_token, **streaming)

    def eval_lm_dataloader(
        self,
        dataset,
        max_tokens: Optional[int] = 36000,
        batch_size: Optional[int] = None,
        max_positions=None,
        num_shards: int = 1,
        shard_id: int = 0,
        num_workers: int = 1,
        data_buffer_size: int = 10,
        context_window: int = 0,
    ):
        """Upstream's evaluation batches of `dataset` (one pass, no shuffling; too long items skipped). With
        `context_window` > 0 blocks come in corpus order, each with up to that many tokens of the text before it
        as unscored context (fairseq.data.lm_context_window_dataset, in upstream's batch layout)."""
        if context_window > 0:
            dataset = InCorpusOrder(dataset)
        batches = self.get_batch_iterator(
            dataset=dataset,
            max_tokens=max_tokens,
            max_sentences=batch_size,
            max_positions=max_positions,
            ignore_invalid_inputs=True,
            num_shards=num_shards,
            shard_id=shard_id,
            num_workers=num_workers,
            data_buffer_size=data_buffer_size,
        ).next_epoch_itr(shuffle=False)
        if context_window <= 0:
            return batches
        bos = self.source_dictionary.bos() if self.cfg.add_bos_token else None
        return with_context_window(batches, context_window, self.source_dictionary.pad(), bos, width_with_window=True)

    def describe_split(self, split: str) -> Optional[str]:
        return self._split_sources.get(split)

    def max_positions(self) -> Optional[int]:
        return self.cfg.max_target_positions

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.output_dictionary


class MissingSplit(FileNotFoundError):
    """No .bin/.idx of `split` at `split_path`; `flag` is the option that named the split (fairseq-generate and
    fairseq-eval-lm read --gen-subset: load_split)."""

    def __init__(self, split: str, split_path: str, flag: str = "--train-subset/--valid-subset"):
        self.split, self.split_path = split, split_path
        data_dir = os.path.dirname(split_path)
        found = (
            sorted(name[: -len(".idx")] for name in os.listdir(data_dir) if name.endswith(".idx"))
            if os.path.isdir(data_dir)
            else []
        )
        has = f" ({data_dir or '.'} has {', '.join(found)})" if found else ""
        super().__init__(
            f"Dataset not found: {split} ({split_path}.bin/.idx){has}; check DATA and {flag} or run "
            "fairseq-preprocess for this split"
        )


def load_split(task, split: str, flag: str = "--gen-subset") -> None:
    """task.load_dataset(split), a missing split named by the option the command read it from (`flag`)."""
    try:
        task.load_dataset(split)
    except MissingSplit as e:
        raise MissingSplit(e.split, e.split_path, flag) from None


class MissingDictionary(FileNotFoundError):
    """No dict.txt in `data_dir`; a caller that took the directory from a checkpoint names the better fix."""

    def __init__(self, message: str, data_dir: str):
        super().__init__(message)
        self.data_dir = data_dir


def load_dictionary(data_dir: str) -> Dictionary:
    path = os.path.join(data_dir, "dict.txt")
    if not os.path.isfile(path):
        raise MissingDictionary(
            f"no dict.txt in {data_dir}; run fairseq-preprocess first (it writes dict.txt next to the binarized data)",
            data_dir,
        )
    dictionary = Dictionary.load(path)
    logger.info(f"dictionary: {len(dictionary):,} types")
    return dictionary
