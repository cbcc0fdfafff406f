"""fairseq-eval-lm: loss (base 2) and perplexity of a language model on a data split."""

import argparse
import ast
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from fairseq import options
from fairseq.utils import import_user_module, run_console_script
from fairseq.checkpoint.inference import load_model
from fairseq.criterions.cross_entropy import token_cross_entropy
from fairseq.data.lm_context_window_dataset import InCorpusOrder, with_context_window
from fairseq.logging import progress_bar
from fairseq.models.fairseq_model import model_config_line
from fairseq.dataclass.validate import announce_compat_options, check_shard
from fairseq.precision import compute_dtype

logger = logging.getLogger("fairseq_cli.eval_lm")


def bpe_continuation(post_process: Optional[str]) -> Optional[str]:
    """The marker that ends a non-final BPE piece, from --remove-bpe / --post-process (None: no BPE)."""
    if post_process is None:
        return None
    if post_process == "subword_nmt":
        return "@@"
    if post_process in ("sentencepiece", "letter", "wordpiece", "_EOW", "none"):  # not marker schemes
        raise ValueError(f"--post-process {post_process}: eval-lm joins words for --remove-bpe sentencepiece, for "
                         "the --bpe scheme's pieces, or for continuation markers (--remove-bpe, --remove-bpe '@@ ')")
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
        return "\t".join(str(v) for v in (self.word, self.count, self.log_prob, self.is_bpe, self.next_word_prob,
                                           self.count - self.missing_next_words))


class BPE:
    """--remove-bpe: how counted tokens join into words.

    With a continuation `marker` (subword-nmt's "@@", upstream's only kind): a dictionary entry that ends with
    it is a non-final piece and joins the next token. With `begins_word` (one bool per dictionary entry;
    sentencepiece's U+2581 rule or a --bpe scheme's `is_beginning_of_word`): a token joins the word before it
    unless it begins a word; `word_text` turns a word's pieces into its text."""

    def __init__(self, dictionary, marker: Optional[str] = None, begins_word=None, word_text=None):
        if (marker is None) == (begins_word is None):
            raise ValueError("BPE: give a continuation marker or begins_word, not both")
        self.dictionary = dictionary
        self.word_text = word_text
        if marker is not None:
            self.marker_len = len(marker)
            self.pieces = {i for i in range(len(dictionary)) if dictionary[i].endswith(marker)}
            self.is_piece = torch.zeros(len(dictionary), dtype=torch.bool)
            self.is_piece[sorted(self.pieces)] = True
            self.begins = None
        else:
            self.marker_len = 0
            self.pieces = set()
            self.begins = torch.as_tensor(begins_word, dtype=torch.bool)
            self.begin_ids = set(torch.nonzero(self.begins).flatten().tolist())

    def merged_pieces(self, target: torch.Tensor, mask: torch.Tensor) -> int:
        """Counted tokens whose score joins the next token's word: non-final pieces, except a sample's last
        counted token (a word cut off there still counts as one). Perplexity is then per word, as upstream."""
        if self.begins is not None:
            if self.begins.device != target.device:
                self.begins = self.begins.to(target.device)
            joins = mask[:, :-1] & mask[:, 1:] & ~self.begins[target[:, 1:]]
            return int(joins.sum())
        if self.is_piece.device != target.device:  # moved once, not per batch
            self.is_piece = self.is_piece.to(target.device)
        last = mask & (mask.cumsum(-1) == mask.sum(-1, keepdim=True))
        return int((self.is_piece[target] & mask & ~last).sum())


SPM_SPACE = "\u2581"  # sentencepiece's word-boundary mark


def word_boundaries(post_process: Optional[str], dictionary, bpe_encoder=None, bpe_name: Optional[str] = None):
    """The BPE word joiner for --remove-bpe VALUE (None without it).

    - `sentencepiece`: a piece that starts with U+2581 begins a word (upstream's `post_process`
      "sentencepiece": pieces concatenated, U+2581 read as a space); dictionary specials are words of their own.
    - the flag alone (`subword_nmt`) or the scheme's name, with `--bpe NAME` (or the checkpoint's saved bpe):
      the scheme's `is_beginning_of_word` on each dictionary entry, words decoded by the scheme.
    - otherwise a continuation marker (`@@ `, upstream's `subword_nmt`)."""
    if post_process is None:
        return None
    specials = set(range(dictionary.nspecial)) | {dictionary.eos()}
    if bpe_encoder is not None and post_process in ("subword_nmt", bpe_name):
        def begins(i):
            if i in specials:
                return True
            try:
                return bool(bpe_encoder.is_beginning_of_word(dictionary[i]))
            except ValueError:  # not a token of the scheme (madeupword padding): a word of its own
                return True

        return BPE(dictionary, begins_word=[begins(i) for i in range(len(dictionary))],
                   word_text=lambda pieces: _decode_word(bpe_encoder, pieces))
    if post_process == "sentencepiece":
        return BPE(dictionary, begins_word=[i in specials or dictionary[i].startswith(SPM_SPACE)
                                            for i in range(len(dictionary))],
                   word_text=lambda pieces: "".join(pieces).replace(SPM_SPACE, " ").strip())
    if post_process == "gpt2":
        raise ValueError("--remove-bpe gpt2: word boundaries come from the encoder; pass --bpe gpt2 "
                         "--gpt2-encoder-json encoder.json --gpt2-vocab-bpe vocab.bpe")
    return BPE(dictionary, bpe_continuation(post_process))


def _decode_word(bpe_encoder, pieces: List[str]) -> str:
    try:
        return bpe_encoder.decode(" ".join(pieces)).strip()
    except ValueError:
        return "".join(pieces)


class WordOutput:
    """--output-word-probs / --output-word-stats: counted target tokens joined into words.

    With --remove-bpe a token ending with the marker continues into the next one (the marker is dropped). A
    word's log probability is the sum over its pieces, and its "next" log probability that of the word after
    it in the same sample. A word cut off at the end of a sample is not listed, but is the "next" of the word
    before it (as upstream)."""

    def __init__(self, dictionary, bpe: Optional[BPE], log_words: bool):
        self.dictionary = dictionary
        self.bpe = bpe
        self.log_words = log_words
        self.stats: Dict[str, WordStat] = {}

    def _words(self, tokens: List[int], scores: List[float]):
        """[word, summed log p, has several pieces, complete] for one sample's counted tokens."""
        if self.bpe is not None and self.bpe.begins is not None:
            return self._words_by_beginnings(tokens, scores)
        words, current = [], None
        for token, score in zip(tokens, scores):
            piece = self.dictionary[token]
            continues = self.bpe is not None and token in self.bpe.pieces
            if continues:
                piece = piece[: len(piece) - self.bpe.marker_len]
            if current is None:
                current = ["", 0.0, False, False]
            current[0] += piece
            current[1] += score
            current[2] = current[2] or continues
            if not continues:
                current[3] = True
                words.append(current)
                current = None
        return words + ([current] if current is not None else [])

    def _words_by_beginnings(self, tokens: List[int], scores: List[float]):
        groups = []  # [pieces, summed log p]
        begin_ids = self.bpe.begin_ids
        for k, (token, score) in enumerate(zip(tokens, scores)):
            if k == 0 or token in begin_ids:
                groups.append([[], 0.0])
            groups[-1][0].append(self.dictionary[token])
            groups[-1][1] += score
        return [[self.bpe.word_text(pieces), log_prob, len(pieces) > 1, True] for pieces, log_prob in groups]

    def add_batch(self, ids: torch.Tensor, target: torch.Tensor, lprobs: torch.Tensor, mask: torch.Tensor):
        for row in range(target.size(0)):
            words = self._words(target[row][mask[row]].tolist(), lprobs[row][mask[row]].tolist())
            listed = []
            for k, (word, log_prob, is_bpe, complete) in enumerate(words):
                if not complete:
                    continue
                next_log_prob = words[k + 1][1] if k + 1 < len(words) else None
                self.stats.setdefault(word, WordStat(word, is_bpe)).add(log_prob, next_log_prob)
                listed.append((word, log_prob))
            if self.log_words:
                logger.info(f"{int(ids[row])} " + "\t".join(f"{w} [{lp:2f}]" for w, lp in listed))

    def log_stats(self) -> None:
        for stat in sorted(self.stats.values(), key=lambda s: s.count, reverse=True):
            logger.info(str(stat))


@torch.no_grad()
def evaluate(model, batches, pad: int, device, dtype, bos: Optional[int] = None, bpe: Optional[BPE] = None,
             words: Optional[WordOutput] = None) -> tuple:
    """(sum of -log2 p over counted target tokens, number of counted tokens, number of words: with `bpe`
    the pieces of a word count once, else the same as tokens).

    With `bos` (models trained with --add-bos-token), predicting the prepended <s> is not counted, as
    upstream's eval-lm drops it. With `words`, each batch's token log probabilities are also handed to it
    (a copy to the host per batch)."""
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = merged = 0
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
        if bpe is not None:
            merged += bpe.merged_pieces(target, mask)
        if words is not None:
            words.add_batch(sample["id"], target.cpu(), -token_nll.view_as(target).cpu(), mask.cpu())
    return float(nll_sum) / math.log(2), count, count - merged


# Upstream's batch size when neither --max-tokens nor --batch-size is given.
DEFAULT_MAX_TOKENS = 36000


def main(cfg, **unused_kwargs) -> dict:
    """Evaluate; `cfg` is a FairseqConfig or, as upstream accepts, the namespace of parse_args_and_arch."""
    if isinstance(cfg, argparse.Namespace):
        cfg = options.convert_namespace_to_config(cfg)
    if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
        cfg.dataset.max_tokens = DEFAULT_MAX_TOKENS
    progress_bar.setup_logging(cfg.common.log_file)
    if cfg.common.user_dir:
        import_user_module(cfg.common.user_dir)
    announce_compat_options(cfg)
    check_shard(cfg.dataset)
    path = cfg.common_eval.path
    if not path:
        raise ValueError("no checkpoint given: pass --path CHECKPOINT.pt (or a sharded checkpoint directory)")
    device = torch.device("cpu") if cfg.common.cpu or not torch.cuda.is_available() else torch.device("cuda")
    context_window = cfg.eval_lm.context_window
    if context_window > 0:  # the block plus its context must fit the model, as upstream does
        if context_window >= cfg.task.tokens_per_sample:
            raise ValueError(f"--context-window {context_window} must be smaller than --tokens-per-sample "
                             f"{cfg.task.tokens_per_sample}")
        if cfg.dataset.num_shards > 1:  # the context is the previous batch of the corpus, not of the shard
            raise ValueError(f"--num-shards {cfg.dataset.num_shards} cannot be combined with --context-window; "
                             "evaluate the whole split (drop --num-shards/--shard-id)")
        cfg.task.tokens_per_sample -= context_window

    overrides = ast.literal_eval(cfg.common_eval.model_overrides)
    # (the task gets --add-bos-token from the checkpoint: a model trained with it expects <s> first)
    model, loaded_cfg, saved_cfg, task = load_model(path, task_cfg=cfg.task, overrides=overrides,
                                           trust_legacy=cfg.common.trust_legacy_checkpoint)
    model.to(device).eval()
    logger.info(f"loaded {path}: {sum(p.numel() for p in model.parameters()):,} parameters")
    logger.info(model_config_line(model, loaded_cfg.model))

    task.load_dataset(cfg.dataset.gen_subset)
    dataset = task.dataset(cfg.dataset.gen_subset)
    if context_window > 0:
        dataset = InCorpusOrder(dataset)
    itr = task.get_batch_iterator(
        dataset=dataset, max_tokens=cfg.dataset.max_tokens, max_sentences=cfg.dataset.batch_size,
        max_positions=None, ignore_invalid_inputs=True, seed=cfg.common.seed,
        num_shards=cfg.dataset.num_shards, shard_id=cfg.dataset.shard_id, num_workers=cfg.dataset.num_workers,
        epoch=1,
    ).next_epoch_itr(shuffle=False)
    pad = task.source_dictionary.pad()
    bos = task.source_dictionary.bos() if getattr(cfg.task, "add_bos_token", False) else None
    batches = with_context_window(itr, context_window, pad, bos) if context_window > 0 else itr
    bpe = word_boundaries(cfg.common_eval.post_process, task.source_dictionary,
                          *_bpe_encoder(cfg, saved_cfg))
    words = None
    if cfg.eval_lm.output_word_probs or cfg.eval_lm.output_word_stats:
        words = WordOutput(task.source_dictionary, bpe, log_words=cfg.eval_lm.output_word_probs)
    start = time.perf_counter()
    nll_bits, count, words_count = evaluate(model, batches, pad, device, compute_dtype(cfg.common), bos=bos,
                                            bpe=bpe, words=words)
    elapsed = time.perf_counter() - start
    if count == 0:
        raise ValueError(f"split {cfg.dataset.gen_subset!r} has no tokens to evaluate")
    loss = nll_bits / words_count  # per token, or per word with --remove-bpe (as upstream)
    ppl = 2**loss
    logger.info(f"Evaluated {count:,} tokens in {elapsed:.1f}s ({count / max(elapsed, 1e-9):.2f} tokens/s)")
    if bpe is not None:
        logger.info(f"--remove-bpe: loss and perplexity per word ({words_count:,} words)")
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


def _bpe_encoder(cfg, saved_cfg) -> tuple:
    """(encoder, name) of --bpe, else of the bpe saved in the checkpoint's config when --remove-bpe asks for
    word boundaries (the flag alone or the scheme's name); (None, None) otherwise."""
    from fairseq.data.encoders import build_bpe

    post_process = cfg.common_eval.post_process
    if post_process is None:
        return None, None
    bpe_cfg = getattr(cfg, "bpe", None)
    if bpe_cfg is not None:
        return build_bpe(bpe_cfg), bpe_cfg._name
    saved = saved_cfg.get("bpe") if isinstance(saved_cfg, dict) else None
    if isinstance(saved, dict) and saved.get("_name") and post_process in ("subword_nmt", saved["_name"]):
        try:
            encoder = build_bpe(saved)
        except (ValueError, OSError) as e:
            raise ValueError(f"--remove-bpe: the checkpoint was trained with --bpe {saved['_name']}, whose files "
                             f"could not be loaded ({e}); pass --bpe {saved['_name']} with its files") from None
        logger.info(f"--remove-bpe: word boundaries from the checkpoint's --bpe {saved['_name']}")
        return encoder, saved["_name"]
    return None, None


def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(parser, argv)
    main(options.convert_namespace_to_config(args))


def console_main() -> None:
    run_console_script("fairseq-eval-lm", cli_main)


if __name__ == "__main__":
    console_main()
