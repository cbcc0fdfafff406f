"""fairseq-eval-lm: loss (base 2) and perplexity of a language model on a data split."""

import argparse
import ast
import copy
import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from fairseq.frontend import options
from fairseq.registry import import_user_module
from fairseq_cli.console import run_console_script
from fairseq.checkpoint.inference import load_model
from fairseq.checkpoint.vocabulary import check_bpe_files, resolve_bpe
from fairseq.criterions.cross_entropy import token_cross_entropy
from fairseq.data.batching import resolve_limit
from fairseq.data.block_positions import block_limit, check_blocks_fit
from fairseq.dataclass.flag_values import task_block_options
from fairseq.data.lm_context_window_dataset import InCorpusOrder, with_context_window
from fairseq.logging import progress_bar
from fairseq.models.fairseq_model import model_config_line
from fairseq.dataclass.batch_flags import check_batch_flags
from fairseq.dataclass.notices import announce_compat_options
from fairseq.frontend.validate import check_shard
from fairseq.tasks.language_modeling import check_block_budget, load_split
from fairseq.training.precision import compute_dtype

logger = logging.getLogger("fairseq_cli.eval_lm")


def bpe_continuation(post_process: Optional[str]) -> Optional[str]:
    """The marker that ends a non-final BPE piece, from --remove-bpe / --post-process (None: no BPE)."""
    if post_process is None:
        return None
    if post_process == "subword_nmt":
        return "@@"
    if post_process in ("sentencepiece", "letter", "wordpiece", "_EOW", "none"):  # not marker schemes
        raise ValueError(
            f"--post-process {post_process}: eval-lm joins words for --remove-bpe sentencepiece, for "
            "the --bpe scheme's pieces, or for continuation markers (--remove-bpe, --remove-bpe '@@ ')"
        )
    return post_process.rstrip()


@dataclass
class WordStat:
    """One word's line of --output-word-stats (log probabilities in nats, summed over occurrences)."""

    word: str
    is_bpe: bool
    log_prob: float = 0.0
    next_word_prob: float = 0.0
    count: int = 0
    missing_next_words: int = 0

    def add(self, log_prob: float, next_word_prob: Optional[float]) -> None:
        self.log_prob += log_prob
        self.count += 1
        if next_word_prob is None:
            self.missing_next_words += 1
        else:
            self.next_word_prob += next_word_prob

    def __str__(self) -> str:
        return "\t".join(
            str(v)
            for v in (
                self.word,
                self.count,
                self.log_prob,
                self.is_bpe,
                self.next_word_prob,
                self.count - self.missing_next_words,
            )
        )


class BPE:
    """--remove-bpe: where words begin, so that the same raw text has the same words whatever its tokenizer:
    each whitespace-separated word once, and each </s> (upstream counts it for subword-nmt text).

    Per dictionary entry: `starts` (the piece begins a word: sentencepiece's U+2581, GPT-2's leading space, any
    piece for a continuation marker), `joins_next` (the next piece continues its word: a piece ending with the
    marker, or one that is only the word-boundary mark, such as sentencepiece's bare U+2581 before a piece
    without it), `ends` (the next piece begins a word whatever it is: </s>, <s>). A piece begins a word when
    the piece before it in the text ends one, or when it starts one and the piece before does not join it;
    the piece before is the source token at the same position (the block shifted right, the text before a
    block included), so a word cut by a block's end counts once. `word_text` turns a word's pieces into text."""

    def __init__(self, dictionary, starts, joins_next, word_text):
        self.dictionary = dictionary
        self.word_text = word_text
        self.unknown = 0  # counted <unk> targets (evaluate): each may hide a word boundary (unknown_warning)
        ends = [False] * len(dictionary)
        for special in (dictionary.eos(), dictionary.bos()):
            ends[special] = True
        self.tables = [torch.as_tensor(t, dtype=torch.bool) for t in (starts, joins_next, ends)]

    def word_beginnings(self, src: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Whether each target token begins a word (`src`: the token before each, as the model reads them)."""
        if self.tables[0].device != target.device:  # moved once, not per batch
            self.tables = [t.to(target.device) for t in self.tables]
        starts, joins_next, ends = self.tables
        return ends[src] | (starts[target] & ~joins_next[src])

    def unknown_warning(self) -> Optional[str]:
        """An <unk> carries no word-boundary mark (U+2581, `@@`, GPT-2's space): the piece it replaced may have
        begun, continued or ended a word, which its id cannot tell. None when the scored text has none."""
        if not self.unknown:
            return None
        return (
            f"--remove-bpe: the scored text holds {self.unknown:,} <unk> tokens (pieces not in dict.txt); "
            f"the word count, and so the per-word perplexity, may differ from the raw text's by up to "
            f"{self.unknown:,} words. Fix: build dict.txt from the tokenizer's whole vocabulary (for "
            "sentencepiece its .vocab, examples/large_lm/README.md) and binarize with it (--srcdict)"
        )


SPM_SPACE = "\u2581"  # sentencepiece's word-boundary mark


def word_boundaries(post_process: Optional[str], dictionary, bpe_encoder=None, bpe_name: Optional[str] = None):
    """The BPE word joiner for --remove-bpe VALUE (None without it).

    - `sentencepiece`: a piece that starts with U+2581 begins a word (upstream's `post_process`
      "sentencepiece": pieces concatenated, U+2581 read as a space); <unk> does not (sentencepiece's unknown
      characters carry no U+2581: they continue a word, or follow a bare U+2581).
    - the flag alone (`subword_nmt`) or the scheme's name, with `--bpe NAME` (or the checkpoint's saved bpe):
      the scheme's `is_beginning_of_word` on each dictionary entry, words decoded by the scheme.
    - otherwise a continuation marker (`@@ `, upstream's `subword_nmt`)."""
    if post_process is None:
        return None
    symbols = [dictionary[i] for i in range(len(dictionary))]
    specials = set(range(dictionary.nspecial)) | {dictionary.eos()}
    if bpe_encoder is not None and post_process in ("subword_nmt", bpe_name):
        decode = lambda pieces: _decode_word(bpe_encoder, pieces)  # noqa: E731
        bare = [i not in specials and decode([s]) == "" and s != "" for i, s in enumerate(symbols)]
        # a whitespace-only piece (GPT-2's lone space or tab) begins the word that follows it
        starts = [bare[i] or _scheme_starts(bpe_encoder, i, symbols[i], specials) for i in range(len(symbols))]
        if bpe_name == "sentencepiece":
            starts[dictionary.unk()] = False
        return BPE(dictionary, starts, bare, decode)
    if post_process == "sentencepiece":
        starts = [i in specials or s.startswith(SPM_SPACE) for i, s in enumerate(symbols)]
        starts[dictionary.unk()] = False
        return BPE(
            dictionary,
            starts,
            [s == SPM_SPACE for s in symbols],
            lambda pieces: "".join(pieces).replace(SPM_SPACE, " ").strip(),
        )
    if post_process == "gpt2":
        raise ValueError(
            "--remove-bpe gpt2: word boundaries come from the encoder; pass --bpe gpt2 "
            "--gpt2-encoder-json encoder.json --gpt2-vocab-bpe vocab.bpe"
        )
    marker = bpe_continuation(post_process)
    return BPE(
        dictionary,
        [True] * len(symbols),
        [i not in specials and s.endswith(marker) for i, s in enumerate(symbols)],
        lambda pieces: "".join(p[: len(p) - len(marker)] if p.endswith(marker) else p for p in pieces),
    )


def _scheme_starts(bpe_encoder, i: int, symbol: str, specials: set) -> bool:
    if i in specials:
        return True
    try:
        return bool(bpe_encoder.is_beginning_of_word(symbol))
    except ValueError:  # not a token of the scheme (madeupword padding): a word of its own
        return True


def _decode_word(bpe_encoder, pieces: List[str]) -> str:
    try:
        return bpe_encoder.decode(" ".join(pieces)).strip()
    except ValueError:
        return "".join(pieces)


class WordOutput:
    """--output-word-probs / --output-word-stats: counted target tokens joined into words where
    `BPE.word_beginnings` says (each token a word without --remove-bpe).

    A word's log probability is the sum over its pieces, its "next" log probability that of the word after
    it in the same sample. A word cut by the end of a sample is completed by the pieces that begin the next
    sample (blocks of --sample-break-mode none continue each other), so each word is listed once, in the
    sample where it begins; samples are listed in id order once all are read (`finish`)."""

    def __init__(self, dictionary, bpe: Optional[BPE], log_words: bool):
        self.dictionary = dictionary
        self.bpe = bpe
        self.log_words = log_words
        self.stats: Dict[str, WordStat] = {}
        self.samples: Dict[int, tuple] = {}  # id -> (pieces before its first word, [[pieces, log p], ...])

    def add_batch(
        self,
        ids: torch.Tensor,
        target: torch.Tensor,
        lprobs: torch.Tensor,
        mask: torch.Tensor,
        begins: Optional[torch.Tensor] = None,
    ) -> None:
        for row in range(target.size(0)):
            head, groups = [[], 0.0], []
            starts = begins[row][mask[row]].tolist() if begins is not None else None
            for k, (token, score) in enumerate(zip(target[row][mask[row]].tolist(), lprobs[row][mask[row]].tolist())):
                if starts is None or starts[k]:
                    groups.append([[], 0.0])
                group = groups[-1] if groups else head
                group[0].append(self.dictionary[token])
                group[1] += score
            self.samples[int(ids[row])] = (head, groups)

    def finish(self) -> None:
        """Join words cut by a sample's end, log --output-word-probs lines and collect the word stats."""
        for sample_id in sorted(self.samples):
            groups = self.samples[sample_id][1]
            following = self.samples.get(sample_id + 1)
            if groups and following and following[0][0]:
                groups[-1] = [groups[-1][0] + following[0][0], groups[-1][1] + following[0][1]]
            words = [(self._text(pieces), log_prob, len(pieces) > 1) for pieces, log_prob in groups]
            for k, (word, log_prob, is_bpe) in enumerate(words):
                next_log_prob = words[k + 1][1] if k + 1 < len(words) else None
                self.stats.setdefault(word, WordStat(word, is_bpe)).add(log_prob, next_log_prob)
            if self.log_words:
                logger.info(f"{sample_id} " + "\t".join(f"{w} [{lp:2f}]" for w, lp, _ in words))
        self.samples.clear()

    def _text(self, pieces: List[str]) -> str:
        return self.bpe.word_text(pieces) if self.bpe is not None else " ".join(pieces)

    def log_stats(self) -> None:
        for stat in sorted(self.stats.values(), key=lambda s: s.count, reverse=True):
            logger.info(str(stat))


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
    check_batch_flags(cfg)
    max_tokens = cfg.dataset.max_tokens
    if max_tokens is None and cfg.dataset.batch_size is None:
        max_tokens = DEFAULT_MAX_TOKENS
    progress_bar.setup_logging(cfg.common.log_file)
    if cfg.common.user_dir:
        import_user_module(cfg.common.user_dir)
    announce_compat_options(**vars(cfg))
    check_shard(cfg.dataset)
    check_bpe_files(cfg.bpe)
    path = cfg.common_eval.path
    if not path:
        raise ValueError("no checkpoint given: pass --path CHECKPOINT.pt (or a sharded checkpoint directory)")
    device = torch.device("cpu") if cfg.common.cpu or not torch.cuda.is_available() else torch.device("cuda")
    context_window = cfg.eval_lm.context_window
    task_cfg = _windowed_task_config(cfg, context_window)

    overrides = ast.literal_eval(cfg.common_eval.model_overrides)
    # (the task gets --add-bos-token from the checkpoint: a model trained with it expects <s> first)
    model, loaded_cfg, saved_cfg, task, vocabulary = load_model(
        path, task_cfg=task_cfg, overrides=overrides, trust_legacy=cfg.common.trust_legacy_checkpoint
    )
    model.to(device).eval()
    logger.info(f"loaded {path}: {sum(p.numel() for p in model.parameters()):,} parameters")
    logger.info(model_config_line(model, loaded_cfg.model))

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
    bos = (
        task.source_dictionary.bos() if getattr(task.cfg, "add_bos_token", False) else None
    )  # plug-in tasks may lack it
    batches = with_context_window(itr, context_window, pad, bos) if context_window > 0 else itr
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
    elapsed = time.perf_counter() - start
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
    from fairseq.data.encoders import build_bpe

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
