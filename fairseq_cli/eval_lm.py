"""fairseq-eval-lm: loss (base 2) and perplexity of a language model on a data split (its words: eval_lm_words)."""

import argparse
import ast
import copy
import dataclasses
import json
import logging
import math
import os
import time
from typing import List, Optional

import torch

from fairseq.frontend import options
from fairseq.registry import import_user_module
from fairseq_cli.console import run_console_script
from fairseq_cli.eval_lm_words import BPE, WordOutput, word_boundaries
from fairseq.checkpoint.inference import load_model
from fairseq.checkpoint.vocabulary import check_bpe_files, resolve_bpe
from fairseq.criterions.cross_entropy import token_cross_entropy
from fairseq.data.batching import resolve_limit
from fairseq.data.encoders import build_bpe
from fairseq.data.block_positions import block_limit, check_blocks_fit
from fairseq.dataclass.flag_values import task_adds_bos, task_block_options
from fairseq.data.lm_context_window_dataset import InCorpusOrder, with_context_window
from fairseq.logging import progress_bar
from fairseq.models.fairseq_model import model_config_line
from fairseq.dataclass.batch_flags import check_batch_flags
from fairseq.dataclass.notices import announce_compat_options
from fairseq.frontend.validate import check_shard
from fairseq.tasks.language_modeling import check_block_budget, load_split
from fairseq.training.precision import compute_dtype

logger = logging.getLogger("fairseq_cli.eval_lm")


@torch.no_grad()
def evaluate(
    model,
    batches,
    pad: int,
    device,
    dtype,
    bos: Optional[int] = None,
    bpe: Optional[BPE] = None,
    words: Optional[WordOutput] = None,
) -> tuple:
    """(sum of -log2 p over counted target tokens, number of counted tokens, number of words: with `bpe`
    the counted tokens that begin a word (BPE.word_beginnings), else the same as tokens).

    With `bos` (models trained with --add-bos-token), predicting the prepended <s> is not counted, as
    upstream's eval-lm drops it. With `words`, each batch's token log probabilities are also handed to it
    (a copy to the host per batch)."""
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = word_count = 0
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else None
    for sample in batches:
        if not sample or sample.get("is_dummy", False):  # ({}: a --num-shards shard's padding batch)
            continue
        src = sample["net_input"]["src_tokens"].to(device, non_blocking=True)
        target = sample["target"].to(device, non_blocking=True)
        if autocast is not None:
            with autocast:
                logits = model(src)
        else:
            logits = model(src)
        if isinstance(logits, tuple):  # (logits, extra), upstream's convention (a plug-in may return logits)
            logits = logits[0]
        mask = target.ne(pad)
        if bos is not None:
            mask &= target.ne(bos)
        # The training loss's per-token fp32 cross-entropy (0 at pad), one chunk of fp32 rows at a time.
        token_nll = token_cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), pad)
        nll_sum += (token_nll * mask.reshape(-1)).sum().double()
        count += int(mask.sum())
        begins = bpe.word_beginnings(src, target) if bpe is not None else None
        if begins is not None:
            word_count += int((begins & mask).sum())
            bpe.unknown += int((target.eq(bpe.dictionary.unk()) & mask).sum())
        if words is not None:
            words.add_batch(
                sample["id"],
                target.cpu(),
                -token_nll.view_as(target).cpu(),
                mask.cpu(),
                None if begins is None else begins.cpu(),
            )
    if words is not None:
        words.finish()
    return float(nll_sum) / math.log(2), count, word_count if bpe is not None else count


# Upstream's batch size when neither --max-tokens nor --batch-size is given.
DEFAULT_MAX_TOKENS = 36000


def main(cfg, **unused_kwargs) -> dict:
    """Evaluate; `cfg` is a FairseqConfig or, as upstream accepts, the namespace of parse_args_and_arch."""
    if isinstance(cfg, argparse.Namespace):
        cfg = options.convert_namespace_to_config(cfg)
    max_tokens = _prepare(cfg)
    path = cfg.common_eval.path
    device = torch.device("cpu") if cfg.common.cpu or not torch.cuda.is_available() else torch.device("cuda")
    context_window = cfg.eval_lm.context_window
    model, saved_cfg, task, vocabulary = _load(cfg, path, device, context_window)
    batches, pad, bos = _batches(cfg, task, model, max_tokens, context_window)
    bpe = word_boundaries(
        cfg.common_eval.post_process, task.source_dictionary, *_bpe_encoder(cfg, saved_cfg, vocabulary, path)
    )
    words = None
    if cfg.eval_lm.output_word_probs or cfg.eval_lm.output_word_stats:
        words = WordOutput(task.source_dictionary, bpe, log_words=cfg.eval_lm.output_word_probs)
    start = time.perf_counter()
    nll_bits, count, words_count = evaluate(
        model, batches, pad, device, compute_dtype(cfg.common), bos=bos, bpe=bpe, words=words
    )
    return _report(cfg, path, nll_bits, count, words_count, time.perf_counter() - start, bpe, words)


def _prepare(cfg) -> Optional[int]:
    """The checks and set-up before anything is loaded (logging, --user-dir, the flags' notices); the batches'
    --max-tokens (upstream's default when neither it nor --batch-size is given)."""
    check_batch_flags(cfg)
    max_tokens = cfg.dataset.max_tokens
    if max_tokens is None and cfg.dataset.batch_size is None:
        max_tokens = DEFAULT_MAX_TOKENS
    progress_bar.setup_logging(cfg.common.log_file)
    if cfg.common.user_dir:
        import_user_module(cfg.common.user_dir)
    announce_compat_options(**vars(cfg))
    check_shard(cfg.dataset.num_shards, cfg.dataset.shard_id)
    check_bpe_files(cfg.bpe)
    if not cfg.common_eval.path:
        raise ValueError("no checkpoint given: pass --path CHECKPOINT.pt (or a sharded checkpoint directory)")
    return max_tokens


def _load(cfg, path: str, device: torch.device, context_window: int):
    """(model on `device` in eval mode, the checkpoint's saved config, task, vocabulary record)."""
    task_cfg = _windowed_task_config(cfg, context_window)
    overrides = ast.literal_eval(cfg.common_eval.model_overrides)
    # (the task gets --add-bos-token from the checkpoint: a model trained with it expects <s> first)
    model, loaded_cfg, saved_cfg, task, vocabulary = load_model(
        path, task_cfg=task_cfg, overrides=overrides, trust_legacy=cfg.common.trust_legacy_checkpoint
    )
    model.to(device).eval()
    logger.info(f"loaded {path}: {sum(p.numel() for p in model.parameters()):,} parameters")
    logger.info(model_config_line(model, loaded_cfg.model))
    return model, saved_cfg, task, vocabulary


def _batches(cfg, task, model, max_tokens: Optional[int], context_window: int):
    """(the split's batches in corpus order, with the context window's tokens in front; pad; <s> or None)."""
    _blocks_as_trained(cfg, task, model, context_window)
    check_block_budget("--max-tokens", max_tokens, *task_block_options(task.cfg), context_window)  # as train
    load_split(task, cfg.dataset.gen_subset)
    dataset = task.dataset(cfg.dataset.gen_subset)
    max_positions = _block_limit(cfg, task, model, dataset, context_window)
    if context_window > 0:
        dataset = InCorpusOrder(dataset)
    itr = task.get_batch_iterator(
        dataset=dataset,
        max_tokens=max_tokens,
        max_sentences=cfg.dataset.batch_size,
        max_positions=max_positions,
        ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
        seed=cfg.common.seed,
        num_shards=cfg.dataset.num_shards,
        shard_id=cfg.dataset.shard_id,
        num_workers=cfg.dataset.num_workers,
        epoch=1,
    ).next_epoch_itr(shuffle=False)
    pad = task.source_dictionary.pad()
    bos = task.source_dictionary.bos() if task_adds_bos(task.cfg) else None  # plug-in tasks may lack the option
    batches = with_context_window(itr, context_window, pad, bos) if context_window > 0 else itr
    return batches, pad, bos


def _report(cfg, path: str, nll_bits: float, count: int, words_count: int, elapsed: float, bpe, words) -> dict:
    """The result's log lines, --output-word-stats, --results-path's JSON file; {"loss", "perplexity", "tokens"
    (and "words" with --remove-bpe)}. A split with nothing to evaluate is an error."""
    if count == 0:
        skipped = (
            " --skip-invalid-size-inputs-valid-test skipped every block that does not fit the model: lower "
            "--tokens-per-sample, or drop the flag to see the first such block"
            if cfg.dataset.skip_invalid_size_inputs_valid_test
            else ""
        )
        raise ValueError(f"split {cfg.dataset.gen_subset!r} has no tokens to evaluate.{skipped}")
    loss = nll_bits / words_count  # per token, or per word with --remove-bpe (as upstream)
    ppl = 2**loss
    logger.info(f"Evaluated {count:,} tokens in {elapsed:.1f}s ({count / max(elapsed, 1e-9):.2f} tokens/s)")
    if bpe is not None:
        logger.info(f"--remove-bpe: loss and perplexity per word ({words_count:,} words)")
        if bpe.unknown_warning():
            logger.warning(bpe.unknown_warning())
    logger.info(f"Loss (base 2): {loss:.4f}, Perplexity: {ppl:.2f}")
    if words is not None and cfg.eval_lm.output_word_stats:
        words.log_stats()
    result = {"loss": loss, "perplexity": ppl, "tokens": count}
    if bpe is not None:
        result["words"] = words_count
    if cfg.common_eval.results_path:
        os.makedirs(cfg.common_eval.results_path, exist_ok=True)
        out = os.path.join(cfg.common_eval.results_path, f"eval_lm.{cfg.dataset.gen_subset}.json")
        with open(out, "w") as f:
            json.dump(dict(result, path=path, gen_subset=cfg.dataset.gen_subset), f, indent=1)
        logger.info(f"wrote {out}")
    return result


def _windowed_task_config(cfg, context_window: int):
    """The task config the blocks are cut with: with --context-window, blocks of --tokens-per-sample less the
    window, each read after the window's context (a copy: the config stays as given), which must fit the model
    as upstream's do."""
    if context_window <= 0:
        return cfg.task
    if context_window >= cfg.task.tokens_per_sample:
        raise ValueError(
            f"--context-window {context_window} must be smaller than --tokens-per-sample {cfg.task.tokens_per_sample}"
        )
    if cfg.dataset.num_shards > 1:  # the context is the previous batch of the corpus, not of the shard
        raise ValueError(
            f"--num-shards {cfg.dataset.num_shards} cannot be combined with --context-window; "
            "evaluate the whole split (drop --num-shards/--shard-id)"
        )
    task_cfg = copy.copy(cfg.task)
    task_cfg.tokens_per_sample -= context_window
    return task_cfg


def _blocks_as_trained(cfg, task, model, context_window: int) -> None:
    """Upstream's eval-lm cuts blocks of its own --tokens-per-sample (default 1024) whatever the model was trained
    with, and skips the ones longer than the model. Here, with the flag at that default and a model trained on
    shorter blocks (upstream's tests train with --tokens-per-sample 500 and evaluate without the flag), the task
    reads blocks of the model's length instead (less --context-window), so every token is scored as trained;
    one line says so. A value other than the default is kept (and refused when too long, block_positions)."""
    given, _ = task_block_options(cfg.task)
    fields = dataclasses.fields(cfg.task) if dataclasses.is_dataclass(cfg.task) else ()
    default = next((f.default for f in fields if f.name == "tokens_per_sample"), None)
    positions = resolve_limit(task.max_positions(), model.max_positions())
    if given is None or given != default or positions is None or given <= positions or positions <= context_window:
        return
    window = f" (read after up to --context-window {context_window} tokens of context)" if context_window else ""
    logger.info(
        f"--tokens-per-sample {given} (its default) is more than the model's {positions} positions: "
        f"evaluating blocks of {positions - context_window} tokens{window}, the length it was trained with; "
        "pass --tokens-per-sample to choose another"
    )
    task.cfg = dataclasses.replace(task.cfg, tokens_per_sample=positions - context_window)


def _block_limit(cfg, task, model, dataset, context_window: int) -> Optional[int]:
    """The longest block the model may read (its trained positions, less the context window): a longer one
    is an error, or skipped with --skip-invalid-size-inputs-valid-test."""
    max_positions = resolve_limit(task.max_positions(), model.max_positions())
    if not cfg.dataset.skip_invalid_size_inputs_valid_test:
        check_blocks_fit(dataset.sizes, max_positions, cfg.dataset.gen_subset, task.cfg, context_window)
    return block_limit(max_positions, context_window)


def _bpe_encoder(cfg, saved_cfg, vocabulary, path) -> tuple:
    """(encoder, name) of --bpe, else of the bpe saved in the checkpoint's config (with the files it carries)
    when --remove-bpe asks for word boundaries (the flag alone or the scheme's name); (None, None) otherwise."""
    post_process = cfg.common_eval.post_process
    if post_process is None:
        return None, None
    bpe_cfg = cfg.bpe
    if bpe_cfg is not None:
        return build_bpe(bpe_cfg), bpe_cfg._name
    saved = saved_cfg.get("bpe") if isinstance(saved_cfg, dict) else None
    if isinstance(saved, dict) and saved.get("_name") and post_process in ("subword_nmt", saved["_name"]):
        encoder = build_bpe(resolve_bpe(None, saved, vocabulary, path))
        logger.info(f"--remove-bpe: word boundaries from the checkpoint's --bpe {saved['_name']}")
        return encoder, saved["_name"]
    return None, None


def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = options.convert_namespace_to_config(args)
    try:
        check_batch_flags(cfg)
    except ValueError as e:
        parser.error(str(e))
    main(cfg)


def console_main() -> None:
    run_console_script("fairseq-eval-lm", cli_main)


if __name__ == "__main__":
    console_main()
