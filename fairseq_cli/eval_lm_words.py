"""fairseq-eval-lm's words: where words begin for --remove-bpe (per-word loss and perplexity), and the words of
--output-word-probs / --output-word-stats.
"""

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

logger = logging.getLogger("fairseq_cli.eval_lm")  # the command's logger: these lines read as fairseq-eval-lm's


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
