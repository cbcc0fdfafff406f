"""Base class of tasks: which data, which dictionaries, how to batch it, and how to build model and criterion."""

import inspect
import logging
from typing import Any, Dict, Optional

import numpy as np
import torch

from fairseq import registry
from fairseq.criterions import build_criterion
from fairseq.data.batching import (
    Batches,
    SizeFilterReport,
    batch_by_size,
    filter_by_size,
    filter_by_size_limits,
    size_limit,
)
from fairseq.data.dictionary import Dictionary
from fairseq.data.iterators import EpochBatchIterator
from fairseq.dataclass.generation import as_generation_config
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.generation import search
from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.generation.sequence_scorer import SequenceScorer
from fairseq.logging import metrics
from fairseq.upstream_absent import absent_name, refused_options

logger = logging.getLogger(__name__)


class FairseqTask:
    """A task holds its config (`cfg`), its loaded datasets by split, and cached batch iterators."""

    def __init__(self, cfg, **kwargs):
        self.cfg = cfg
        self.datasets: Dict[str, Any] = {}
        self._epoch_iterators: Dict[tuple, EpochBatchIterator] = {}

    @classmethod
    def setup_task(cls, cfg, **kwargs) -> "FairseqTask":
        return cls(cfg, **kwargs)

    @classmethod
    def add_args(cls, parser) -> None:
        """Upstream's hook: add this task's flags (its config dataclass's fields) to an argparse parser."""
        dc = getattr(cls, "config_class", None)
        if dc is not None:
            gen_parser_from_dataclass(parser, dc())

    @classmethod
    def load_dictionary(cls, filename: str):
        """Upstream's hook: the dictionary stored in `filename` (a dict.txt)."""
        return Dictionary.load(filename)

    # ---- data ---------------------------------------------------------------------------------------
    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, **kwargs) -> None:
        """Load `split` into `self.datasets`. The trainer passes `for_training=True` for its training split
        (tasks written for upstream take it in **kwargs, as upstream's trainer passes extra keywords too)."""
        raise NotImplementedError(f"task {type(self).__name__} does not implement load_dataset")

    def dataset(self, split: str):
        """The loaded dataset of `split` (after `load_dataset(split)`)."""
        if split not in self.datasets:
            loaded = ", ".join(sorted(self.datasets)) or "none"
            raise KeyError(
                f"dataset split {split!r} is not loaded (loaded: {loaded}); call load_dataset({split!r}) first"
            )
        return self.datasets[split]

    def describe_split(self, split: str) -> Optional[str]:
        """Where the loaded `split` comes from, for messages (its file, item counts); None when unknown."""
        return None

    def no_batches_message(
        self, split: str, epoch_itr, purpose: str = "training", token_flag: str = "--max-tokens"
    ) -> str:
        """One line saying why `epoch_itr` (get_batch_iterator's, for `split`) has no batch, or skips most items
        (SizeFilterReport.mostly_dropped), and the fix.

        `purpose` is "training" or "validation"; `token_flag` is the flag that gave get_batch_iterator its
        max_tokens (validation: --max-tokens-valid when set).
        """
        source = self.describe_split(split)
        where = f" ({source})" if source else ""
        report = getattr(epoch_itr, "size_report", None)
        if purpose == "training":
            what, other_fix = f"the training split {split!r}", "check DATA and --train-subset"
        else:
            what, other_fix = (
                f"the validation subset {split!r}",
                "drop it from --valid-subset, or pass --disable-validation",
            )
        if report is None or report.num_items == 0:
            fix = (
                "binarize a non-empty text with fairseq-preprocess, or " + other_fix
                if purpose == "training"
                else other_fix
            )
            return f"no {purpose} batch: {what} is empty{where}; {fix}"
        flag = token_flag if report.flag == "--max-tokens" else report.flag
        fix = report.fix(token_flag)
        if report.num_dropped >= report.num_items:
            return (
                f"no {purpose} batch: all {report.num_items:,} items of {what}{where} are longer than {flag} "
                f"{report.limit} (the longest has {report.longest} tokens); {fix}"
                + ("" if purpose == "training" else f", or {other_fix}")
            )
        if report.mostly_dropped:
            return (
                f"{report.num_dropped:,} of {report.num_items:,} items of {what}{where} are longer than {flag} "
                f"{report.limit} (the longest has {report.longest} tokens) and would be skipped; {fix}"
                + ("" if purpose == "training" else f", or {other_fix}")
            )
        return f"no {purpose} batch in {what}{where}"  # not reached by get_batch_iterator's batching

    def max_positions(self) -> Optional[int]:
        return None

    def filter_indices_by_size(self, indices, dataset, max_positions=None, ignore_invalid_inputs: bool = False):
        """Upstream's name: `indices` without the items longer than `max_positions` (a number, tuple or dict);
        without `ignore_invalid_inputs` such an item is an error."""
        indices, ignored = filter_by_size_limits(indices, dataset, max_positions)
        if ignored and not ignore_invalid_inputs:
            raise ValueError(
                f"{len(ignored)} items, e.g. item {ignored[0]} of size {dataset.size(ignored[0])}, are "
                f"longer than the limit {max_positions}; pass --skip-invalid-size-inputs-valid-test "
                "to skip them"
            )
        if ignored:
            logger.warning(f"{len(ignored)} items are longer than {max_positions} and skipped, e.g. {ignored[:10]}")
        return indices

    @property
    def source_dictionary(self):
        return getattr(self, "dictionary", None)

    @property
    def target_dictionary(self):
        return getattr(self, "output_dictionary", self.source_dictionary)

    def get_batch_iterator(
        self,
        dataset,
        max_tokens: Optional[int] = None,
        max_sentences: Optional[int] = None,
        max_positions=None,
        ignore_invalid_inputs: bool = False,
        required_batch_size_multiple: int = 1,
        seed: int = 1,
        num_shards: int = 1,
        shard_id: int = 0,
        num_workers: int = 0,
        epoch: int = 1,
        data_buffer_size: int = 0,
        disable_iterator_cache: bool = False,
        skip_remainder_batch: bool = False,
        grouped_shuffling: bool = False,
        update_epoch_batch_itr: bool = False,
        pin_memory: bool = False,
    ) -> EpochBatchIterator:
        """Batches of `dataset` as a resumable iterator over epochs.

        Items are ordered by size (ties broken from `seed`), items longer than `max_positions` or
        `max_tokens` are dropped with `ignore_invalid_inputs` (an error otherwise), and batches hold at most
        `max_tokens` tokens (count * longest item) and `max_sentences` items, in multiples of
        `required_batch_size_multiple`. The iterator is cached: the same dataset and arguments return the
        same object (whatever `epoch`), as upstream does, so a trainer may ask for it every epoch
        (`update_epoch_batch_itr`: a new one). `skip_remainder_batch` and `grouped_shuffling` are upstream's
        EpochBatchIterator options.
        """
        if max_tokens is None and max_sentences is None:
            raise ValueError("set --max-tokens or --batch-size to say how large batches are")
        sizing = (max_tokens, max_sentences, max_positions, ignore_invalid_inputs, required_batch_size_multiple, seed)
        loading = dict(num_shards=num_shards, shard_id=shard_id, num_workers=num_workers, pin_memory=pin_memory)
        loading.update(skip_remainder_batch=skip_remainder_batch, grouped_shuffling=grouped_shuffling)
        # Cached by everything that shapes the batches; max_positions by its text (a dict is unhashable).
        key = (id(dataset), *sizing[:2], str(max_positions), *sizing[3:], *loading.values())
        use_cache = not (disable_iterator_cache or update_epoch_batch_itr)
        cached = self._epoch_iterators.get(key) if use_cache else None
        if cached is not None and cached.dataset is dataset:
            return cached
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        batches, size_report = _batches_by_size(dataset, *sizing)
        epoch_iter = EpochBatchIterator(
            dataset,
            collate_fn=dataset.collater,
            batch_sampler=batches,
            seed=seed,
            epoch=epoch,
            buffer_size=data_buffer_size,
            **loading,
        )
        # Read by no_batches_message when no batch is left (a trainer must not run empty epochs).
        epoch_iter.size_report = size_report
        if use_cache:
            self._remember_iterator(key, dataset, epoch_iter)
        return epoch_iter

    def _remember_iterator(self, key: tuple, dataset, epoch_iter: EpochBatchIterator) -> None:
        # Forget iterators of datasets since replaced (sharded data loads a new one each epoch).
        live = {id(d) for d in self.datasets.values()} | {id(dataset)}
        self._epoch_iterators = {k: v for k, v in self._epoch_iterators.items() if k[0] in live}
        self._epoch_iterators[key] = epoch_iter

    # ---- model and criterion ------------------------------------------------------------------------
    def build_model(self, model_cfg, from_checkpoint: bool = False):
        """The model of architecture `model_cfg._name` (e.g. transformer_lm_gpt3_small; a legacy namespace's
        `arch`)."""
        arch = registry.config_name(model_cfg, "arch")
        if arch is None:
            raise ValueError("the model config has no architecture name (_name); pass --arch")
        return registry.arch_model(arch).build_model(model_cfg, self)

    def build_criterion(self, criterion_cfg, optimization_cfg=None):
        """The criterion `criterion_cfg` names (--criterion); `optimization_cfg` supplies --sentence-avg."""
        return build_criterion(criterion_cfg, self, optimization_cfg)

    # ---- generation (upstream's names) --------------------------------------------------------------
    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None):
        """A SequenceGenerator (or `seq_gen_cls`) for `models`, from the generation options in `args`: a
        GenerationConfig, or upstream's argparse Namespace / DictConfig (converted once, here; options it lacks
        take GenerationConfig's defaults). Reads beam, max_len_a, max_len_b, min_len, unnormalized, lenpen,
        unkpen, temperature, match_source_len, no_repeat_ngram_size, sampling, sampling_topk, sampling_topp,
        retain_dropout; and this fork's no_cuda_graphs."""
        gen = as_generation_config(args)
        if gen.score_reference:  # score the given text instead (upstream's choice, made here too)
            return SequenceScorer(self.target_dictionary, compute_alignment=gen.print_alignment)
        if prefix_allowed_tokens_fn is not None:
            raise ValueError(
                "prefix_allowed_tokens_fn (prefix-constrained decoding) is not supported by this fairseq's generator"
            )
        search_strategy = _search_strategy(gen, self.target_dictionary)
        seq_gen_cls = SequenceGenerator if seq_gen_cls is None else seq_gen_cls
        extra_gen_cls_kwargs = dict(extra_gen_cls_kwargs or {})
        if isinstance(seq_gen_cls, type) and issubclass(seq_gen_cls, SequenceGenerator):  # --no-cuda-graphs
            extra_gen_cls_kwargs.setdefault("cuda_graphs", not gen.no_cuda_graphs)
        generator = seq_gen_cls(
            models,
            self.target_dictionary,
            beam_size=gen.beam,
            max_len_a=gen.max_len_a,
            max_len_b=gen.max_len_b,
            min_len=gen.min_len,
            normalize_scores=not gen.unnormalized,
            len_penalty=gen.lenpen,
            unk_penalty=gen.unkpen,
            temperature=gen.temperature,
            match_source_len=gen.match_source_len,
            no_repeat_ngram_size=gen.no_repeat_ngram_size,
            search_strategy=search_strategy,
            **extra_gen_cls_kwargs,
        )
        if gen.retain_dropout:  # --retain-dropout: the generator's constructor put them in eval mode
            for model in models:
                model.train()
        return generator

    def build_dataset_for_inference(self, src_tokens, src_lengths, **kwargs):
        raise NotImplementedError(f"task {type(self).__name__} does not build datasets for inference")

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        with torch.no_grad():
            return generator.generate(models, sample, prefix_tokens=prefix_tokens, constraints=constraints)

    # ---- steps (upstream's names; fairseq-validate calls valid_step) ----------------------------------
    def valid_step(self, sample, model, criterion):
        """(loss, sample_size, logging_output) of `criterion` on `sample`, in eval mode without gradients."""
        model.eval()
        with torch.no_grad():
            return criterion(model, sample)

    def reduce_metrics(self, logging_outputs, criterion) -> None:
        """Upstream's: log wpb (tokens) and bsz (sentences) summed over `logging_outputs`, and wps, then the
        criterion's own metrics."""
        if any("ntokens" in log for log in logging_outputs):
            ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
            metrics.log_scalar("wpb", ntokens, priority=180, round=1)
            metrics.log_speed("wps", ntokens, priority=90, round=1)
        if any("nsentences" in log for log in logging_outputs):
            metrics.log_scalar("bsz", sum(log.get("nsentences", 0) for log in logging_outputs), priority=190, round=1)
        criterion.__class__.reduce_metrics(logging_outputs)

    # ---- hooks the trainer calls (upstream's): at each epoch's start and before each validation ----
    def begin_epoch(self, epoch: int, model) -> None:
        pass

    def begin_valid_epoch(self, epoch: int, model) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def _search_strategy(gen, dictionary) -> search.Search:
    """The search that the generation options ask for (sampling, length-constrained or beam search), after
    refusing the options this generator lacks and the combinations upstream refuses."""
    for name, is_set, fix in refused_options("generator"):
        if is_set(getattr(gen, name) or 0):
            raise ValueError(f"--{name.replace('_', '-')} is not supported by this fairseq's generator; {fix}")
    if gen.sampling and gen.match_source_len:  # upstream: "search parameters are mutually exclusive"
        raise ValueError(
            "--sampling and --match-source-len cannot be combined (they are two search strategies); drop one"
        )
    if gen.sampling_topk >= 0 and not gen.sampling:
        raise ValueError(f"--sampling-topk {gen.sampling_topk} requires --sampling")
    if gen.sampling_topp >= 0 and not gen.sampling:
        raise ValueError(f"--sampling-topp {gen.sampling_topp} requires --sampling")
    if gen.sampling:
        return search.Sampling(dictionary, gen.sampling_topk, gen.sampling_topp)
    if gen.match_source_len:
        # Outputs exactly as long as the source (upstream hard-codes these length constraints).
        return search.LengthConstrainedBeamSearch(dictionary, min_len_a=1, min_len_b=0, max_len_a=1, max_len_b=0)
    return search.BeamSearch(dictionary)


def _batches_by_size(
    dataset, max_tokens, max_sentences, max_positions, ignore_invalid_inputs, required_batch_size_multiple, seed
):
    """(batches, SizeFilterReport): `dataset`'s items ordered by size (ties broken from `seed`), those over the
    size limit dropped (an error without `ignore_invalid_inputs`), cut into batches."""
    sizes = np.asarray(dataset.sizes)
    indices = dataset.ordered_indices(seed=seed) if _takes_seed(dataset) else dataset.ordered_indices()
    # One limit, named after the flag that really set it (the positions limit or --max-tokens).
    limit, flag = size_limit(max_positions, max_tokens)
    indices, dropped = filter_by_size(indices, sizes, limit, ignore_invalid_inputs, flag=flag)
    if len(dropped):
        logger.warning(f"{len(dropped):,} items longer than {flag} {limit} are skipped, e.g. {dropped[:10].tolist()}")
    batches: Batches = batch_by_size(
        indices,
        sizes[indices],
        max_tokens=max_tokens,
        max_sentences=max_sentences,
        required_batch_size_multiple=required_batch_size_multiple,
    )
    return batches, SizeFilterReport.of(sizes, len(dropped), limit, flag)


def _takes_seed(dataset) -> bool:
    try:
        return "seed" in inspect.signature(dataset.ordered_indices).parameters
    except (TypeError, ValueError):
        return False


def __getattr__(name):
    # upstream's LegacyFairseqTask lives in the compat wing (fairseq.upstream_absent resolves it there)
    return absent_name(__name__, name)
