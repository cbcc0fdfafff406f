"""fairseq-generate: continue the samples of a binarized split with a trained language model.

    fairseq-generate data-bin --task language_modeling --path checkpoints/checkpoint_best.pt \
        --gen-subset test --tokens-per-sample 512 --sample-break-mode eos --prefix-size 8 --beam 1 --max-len-b 64

Each sample is a prompt: its first --prefix-size tokens, or (0, upstream's default) the whole sample but its
last token (the model's input block). Output lines are upstream's, scores in base 2:
`S-{id}\\t{input}`, `T-{id}\\t{sample}`, then per hypothesis `H-{id}\\t{score}\\t{tokens}`,
`D-{id}\\t{score}\\t{detokenized}`, `P-{id}\\t{positional scores}`. Helpers shared with fairseq-interactive
(loading the ensemble, the text codec, the hypothesis lines) live here, as upstream's interactive imports them.
"""

import argparse
import ast
import logging
import math
import os
import sys
import time
from typing import Callable, List, Optional, TextIO

import numpy as np
import torch

from fairseq.frontend import options
from fairseq.checkpoint.inference import load_model
from fairseq.checkpoint.vocabulary import check_bpe_files, resolve_bpe
from fairseq.data.batching import resolve_limit
from fairseq.data.block_positions import block_limit, check_blocks_fit, generation_start_positions
from fairseq.data.encoders._write_errors import writing
from fairseq.dataclass.build import check_seed
from fairseq.dataclass.flag_values import task_data_dir
from fairseq.dataclass.generation import check_generation_config
from fairseq.dataclass.notices import announce_compat_options
from fairseq.frontend.validate import check_shard
from fairseq.generation.decode_memory import check_decode_memory, decode_positions
from fairseq.hub.text import TextCodec, move_to
from fairseq.generation.quantize import check_quantize, quantize_for_generation
from fairseq.modules.causal_attention import fuse_qkv_
from fairseq.logging import progress_bar
from fairseq.models.fairseq_model import model_config_line
from fairseq.training.precision import compute_dtype
from fairseq.registry import import_user_module
from fairseq.tasks.language_modeling import MissingDictionary, load_split
from fairseq_cli.console import run_console_script

logger = logging.getLogger("fairseq_cli.generate")


# ----------------------------------------------------------------------------- shared with fairseq-interactive


def load_ensemble(cfg, split: Optional[Callable] = None):
    """(models on the device in the compute dtype and eval mode, task, device, codec) for --path (':'-separated
    checkpoint files or sharded directories). The task is the command line's (DATA's dictionary), or with no
    DATA the first checkpoint's, as saved at training; the codec (TextCodec) is the command line's --tokenizer
    and --bpe, else the first checkpoint's (checkpoint_tokenizer). With --quantize the models' Linear weights
    are quantized once they are on the device and cast (fairseq.generation.quantize). `split(model)`: applied
    to each model cast on the CPU, before it moves (tensor-parallel serving: only a rank's part reaches its
    device)."""
    if not cfg.common_eval.path:
        raise ValueError(
            "no checkpoint given: pass --path CHECKPOINT.pt (or a sharded checkpoint directory; "
            "several joined by ':' for an ensemble)"
        )
    paths = [p for p in cfg.common_eval.path.split(os.pathsep) if p]
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"--path {path}: no such checkpoint file or sharded checkpoint directory")
    overrides = ast.literal_eval(cfg.common_eval.model_overrides)
    if not isinstance(overrides, dict):
        raise ValueError(f"--model-overrides must be a Python dict literal, got {cfg.common_eval.model_overrides!r}")
    use_cuda = torch.cuda.is_available() and not cfg.common.cpu
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = compute_dtype(cfg.common)
    check_quantize(cfg.generation.quantize, device, dtype)  # before anything is loaded
    retain_dropout = cfg.generation.retain_dropout
    task_cfg = cfg.task if _data_dir(cfg) else None
    models, task, first = [], None, None
    for path in paths:
        loaded = _load_model(cfg, path, task, task_cfg, overrides)
        task, task_cfg, first = loaded.task, None, first or loaded
        model = loaded.model if split is None else split(loaded.model.to(dtype=dtype))
        models.append(model.to(device=device, dtype=dtype).train(retain_dropout))
        if device.type == "cuda":  # one q/k/v GEMM per layer call (the CPU keeps its three: nothing to gain)
            fuse_qkv_(models[-1])
        quantize_for_generation(models[-1], cfg.generation.quantize, device)
        logger.info(
            f"loaded {path}: {sum(p.numel() for p in loaded.model.parameters()):,} parameters, "
            f"{str(dtype).replace('torch.', '')} on {device}"
        )
        logger.info(model_config_line(loaded.model, loaded.cfg.model))
    return models, task, device, TextCodec(*checkpoint_tokenizer(cfg, first, paths[0]))


def _load_model(cfg, path: str, task, task_cfg, overrides: dict):
    """load_model; with no DATA the dictionary's directory is the one saved in the checkpoint (as given when
    it was trained, often relative to another directory): its absence is told as such, with DATA as the fix."""
    try:
        return load_model(
            path, task=task, task_cfg=task_cfg, overrides=overrides, trust_legacy=cfg.common.trust_legacy_checkpoint
        )
    except MissingDictionary as e:
        if task is not None or task_cfg is not None:
            raise
        where = os.path.abspath(e.data_dir)
        raise MissingDictionary(
            f"no dict.txt in {e.data_dir} ({where}), the data directory saved in {path} when "
            "it was trained: pass the data directory that holds the model's dict.txt as DATA "
            f"(the first argument, before --path)",
            e.data_dir,
        ) from None


def checkpoint_tokenizer(cfg, loaded, path: str) -> tuple:
    """(tokenizer config, bpe config): --tokenizer / --bpe, else the checkpoint's, with the --bpe files it
    carries (upstream reads only the command line's; `--model-overrides "{'bpe': None}"` reads already encoded
    text)."""
    bpe, tokenizer = cfg.bpe, cfg.tokenizer
    saved = (loaded.saved_cfg.get("bpe") or {}).get("_name")
    if bpe is None and saved and cfg.common_eval.post_process:  # D- would decode joined words again
        logger.info(
            f"--remove-bpe given: the checkpoint's --bpe {saved} is not applied (pass --bpe {saved} for "
            "decoded D- lines instead)"
        )
    elif bpe is None and saved:
        bpe = resolve_bpe(None, loaded.saved_cfg["bpe"], loaded.vocabulary, path)
        logger.info(f"text is encoded and decoded with the checkpoint's --bpe {saved}")
    if tokenizer is None:
        tokenizer = loaded.cfg.tokenizer
    return tokenizer, bpe


def seed_everything(cfg) -> None:
    if cfg.common.seed is not None and not cfg.generation.no_seed_provided:
        np.random.seed(cfg.common.seed)
        torch.manual_seed(cfg.common.seed)  # also seeds every CUDA device


def max_positions_of(task, models) -> Optional[int]:
    return resolve_limit(task.max_positions(), *[model.max_positions() for model in models])


def check_batches_fit(cfg, models, batches, widths, max_positions: Optional[int], device: torch.device) -> None:
    """The largest KV cache among `batches` (lists of indices into `widths`, the prompts' widths) fits on the
    device with the models (fairseq.generation.decode_memory; nothing is checked on the CPU)."""
    if device.type != "cuda":
        return
    gen = cfg.generation
    rows = [
        (len(b), decode_positions(int(np.max(widths[b])), gen.max_len_a, gen.max_len_b, max_positions))
        for b in batches
        if len(b)
    ]
    if rows:
        sentences, positions = max(rows, key=lambda r: r[0] * r[1])
        check_decode_memory(models, sentences, gen.beam, positions, device)


def symbols_to_strip(generator, tgt_dict) -> set:
    """Upstream's get_symbols_to_strip_from_output: the generator's own set, else {eos}."""
    return set(getattr(generator, "symbols_to_strip_from_output", None) or {tgt_dict.eos()})


def print_hypotheses(
    sample_id: int,
    hypos: list,
    nbest: int,
    tgt_dict,
    post_process: Optional[str],
    codec,
    strip: set,
    out: TextIO,
    text_only: bool = False,
) -> None:
    """Upstream's H- (tokens), D- (decoded text) and P- (per-token) lines of the `nbest` best hypotheses;
    scores in base 2 (the generator's are natural logs). `text_only` (--text-only): the decoded text alone."""
    for hypo in hypos[:nbest]:
        hypo_str = tgt_dict.string(hypo["tokens"].int().cpu(), post_process, extra_symbols_to_ignore=strip)
        if text_only:
            print(codec.decode(hypo_str), file=out)
            continue
        score = hypo["score"] / math.log(2)
        print(f"H-{sample_id}\t{score}\t{hypo_str}", file=out)
        print(f"D-{sample_id}\t{score}\t{codec.decode(hypo_str)}", file=out)
        positional = (hypo["positional_scores"] / math.log(2)).tolist()
        print(f"P-{sample_id}\t" + " ".join(f"{x:.4f}" for x in positional), file=out)


def setup(cfg, interactive=None):
    """What both commands do first: logging, plug-ins, flag checks that need no model, seeds."""
    # --text-only, --stream: stdout holds the text alone, so the log goes to stderr
    text_only = cfg.generation.text_only or cfg.generation.stream
    progress_bar.setup_logging(cfg.common.log_file, stream=sys.stderr if text_only else None)
    if cfg.common.user_dir:
        import_user_module(cfg.common.user_dir)
    check_generation_config(cfg.generation, cfg.dataset, interactive)
    check_bpe_files(cfg.bpe)
    announce_compat_options(**vars(cfg))
    check_shard(cfg.dataset.num_shards, cfg.dataset.shard_id)
    check_seed(cfg.common)
    seed_everything(cfg)


# ----------------------------------------------------------------------------- fairseq-generate


def main(cfg) -> dict:
    """Generate for every sample of --gen-subset; the lines go to stdout, or with --results-path to
    RESULTS_PATH/generate-{gen_subset}.txt. Returns {"sentences", "tokens"} (tokens generated). `cfg` is the
    config of convert_namespace_to_generation_config or, as upstream accepts, the namespace of
    parse_args_and_arch."""
    if isinstance(cfg, argparse.Namespace):
        cfg = options.convert_namespace_to_generation_config(cfg)
        check_generation_config(cfg.generation)
    if cfg.common_eval.results_path is not None:
        path = os.path.join(cfg.common_eval.results_path, f"generate-{cfg.dataset.gen_subset}.txt")
        with writing(path, "--results-path"):  # an unwritable directory: one line, no traceback
            os.makedirs(cfg.common_eval.results_path, exist_ok=True)
            out = open(path, "w", buffering=1, encoding="utf-8")
        with out:
            return _main(cfg, out)
    return _main(cfg, sys.stdout)


def _main(cfg, out: TextIO) -> dict:
    setup(cfg)
    if _data_dir(cfg) is None:
        raise ValueError(
            "fairseq-generate reads a binarized split: pass the data directory (DATA) and "
            "--gen-subset (use fairseq-interactive for prompts given as text)"
        )
    models, task, device, codec = load_ensemble(cfg)
    itr = _batches(cfg, task, models, device)
    generator = task.build_generator(models, cfg.generation)
    strip = symbols_to_strip(generator, task.target_dictionary)
    prefix_size = cfg.generation.prefix_size
    sentences = generated = 0
    elapsed = 0.0
    for sample in itr:
        if "net_input" not in sample:
            continue
        sample = move_to(sample, device)
        prefix_tokens = sample["target"][:, :prefix_size] if prefix_size > 0 else None
        start = time.perf_counter()
        hypos = task.inference_step(generator, models, sample, prefix_tokens=prefix_tokens)
        elapsed += time.perf_counter() - start
        generated += sum(len(h[0]["tokens"]) for h in hypos)
        if not cfg.common_eval.quiet:
            _print_sample(cfg, task, sample, hypos, codec, strip, out)
        sentences += len(hypos)
    logger.info("NOTE: hypothesis and token scores are output in base 2")
    logger.info(
        f"Translated {sentences:,} sentences ({generated:,} tokens) in {elapsed:.1f}s "
        f"({sentences / max(elapsed, 1e-9):.2f} sentences/s, {generated / max(elapsed, 1e-9):.2f} tokens/s)"
    )
    return {"sentences": sentences, "tokens": generated}


def _batches(cfg, task, models, device):
    """The batches of --gen-subset in order, each checked to fit the model's positions and the device's memory."""
    max_tokens = cfg.dataset.max_tokens
    if max_tokens is None and cfg.dataset.batch_size is None:
        max_tokens = 12000  # upstream's default
    split = cfg.dataset.gen_subset
    load_split(task, split)
    dataset = task.dataset(split)
    max_positions = _prompt_limit(cfg, getattr(task, "cfg", cfg.task), dataset, max_positions_of(task, models))
    epoch_itr = task.get_batch_iterator(
        dataset=dataset,
        max_tokens=max_tokens,
        max_sentences=cfg.dataset.batch_size,
        max_positions=max_positions,
        ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
        required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
        seed=cfg.common.seed,
        num_shards=cfg.dataset.num_shards,
        shard_id=cfg.dataset.shard_id,
        num_workers=cfg.dataset.num_workers,
        data_buffer_size=cfg.dataset.data_buffer_size,
    )
    check_batches_fit(
        cfg, models, epoch_itr.frozen_batches, np.asarray(dataset.sizes), max_positions_of(task, models), device
    )
    return epoch_itr.next_epoch_itr(shuffle=False)


def _print_sample(cfg, task, sample, hypos, codec: TextCodec, strip, out: TextIO) -> None:
    """Each sentence's lines: S- (the prompt) and T- (the sample) unless --text-only, then its hypotheses'."""
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    post_process, text_only = cfg.common_eval.post_process, cfg.generation.text_only
    target = sample.get("target")
    for i, sample_id in enumerate(sample["id"].tolist()):
        if not text_only:
            src_tokens = _strip_pad(sample["net_input"]["src_tokens"][i], tgt_dict.pad())
            print(f"S-{sample_id}\t{codec.decode(src_dict.string(src_tokens, post_process))}", file=out)
            if target is not None:
                target_str = tgt_dict.string(
                    _strip_pad(target[i], tgt_dict.pad()).int().cpu(),
                    post_process,
                    escape_unk=True,
                    extra_symbols_to_ignore=strip,
                )
                print(f"T-{sample_id}\t{codec.decode(target_str)}", file=out)
        print_hypotheses(
            sample_id, hypos[i], cfg.generation.nbest, tgt_dict, post_process, codec, strip, out, text_only
        )


def _prompt_limit(cfg, task_cfg, dataset, max_positions: Optional[int]) -> Optional[int]:
    """The longest sample the batches may hold. The model reads the start token and the prompt: with
    --prefix-size N only the sample's first N tokens (so any line fits when N + 1 positions do), else the
    whole sample's source (block_positions' rule: it must fit the model's positions with the start token;
    `task_cfg`, the loaded task's, has the checkpoint's --add-bos-token)."""
    prefix_size = cfg.generation.prefix_size
    if prefix_size > 0:
        if max_positions is not None and prefix_size + 1 > max_positions and len(dataset):
            raise ValueError(
                f"--prefix-size {prefix_size} makes prompts that need {prefix_size + 1} positions "
                f"with the </s> generation starts from, more than the model's {max_positions}: "
                f"pass --prefix-size {max_positions - 1} or less"
            )
        return None
    if not cfg.dataset.skip_invalid_size_inputs_valid_test:
        check_blocks_fit(
            dataset.sizes,
            max_positions,
            cfg.dataset.gen_subset,
            task_cfg,
            generation=True,
            other_fix=", or --prefix-size N to prompt with each sample's first N tokens",
        )
    return block_limit(max_positions, generation_start_positions(task_cfg))


def _data_dir(cfg) -> Optional[str]:
    """DATA (the task's data directory); None when not given, or when a plug-in task's config has no `data`."""
    return task_data_dir(cfg.task)


def _strip_pad(tokens: torch.Tensor, pad: int) -> torch.Tensor:
    return tokens[tokens.ne(pad)]


def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = options.convert_namespace_to_generation_config(args)
    try:
        check_generation_config(cfg.generation, cfg.dataset)
    except ValueError as e:
        parser.error(str(e))
    main(cfg)


def console_main() -> None:
    run_console_script("fairseq-generate", cli_main)


if __name__ == "__main__":
    console_main()
