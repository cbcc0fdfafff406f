"""fairseq-eval-lm --output-word-probs / --output-word-stats / --remove-bpe on hand-made token scores."""

import logging

import pytest
import torch

from fairseq.data.dictionary import Dictionary
from fairseq_cli.eval_lm import BPE, WordOutput, bpe_continuation

LOGGER = "fairseq_cli.eval_lm"


def make_dictionary():
    d = Dictionary()
    for word in ["the", "cat@@", "s", "sat", "un@@", "der@@", "mat"]:
        d.add_symbol(word)
    return d


def encode(d, words):
    return torch.tensor([d.index(w) for w in words])


def test_bpe_pieces_join_into_words_with_summed_log_probs(caplog):
    d = make_dictionary()
    # one sample: "the cat@@ s sat un@@ der@@" (a word cut off at the end) and one ignored (masked) slot
    target = encode(d, ["the", "cat@@", "s", "sat", "un@@", "der@@", "mat"]).unsqueeze(0)
    lprobs = torch.tensor([[-1.0, -0.5, -0.25, -2.0, -0.125, -0.0625, -9.0]])
    mask = torch.tensor([[True, True, True, True, True, True, False]])
    words = WordOutput(d, BPE(d, bpe_continuation("@@ ")), log_words=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        words.add_batch(torch.tensor([7]), target, lprobs, mask)
        words.log_stats()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    # the sample id, then word [natural-log probability] with 6 decimals, tab-separated
    assert lines[0] == "7 the [-1.000000]\tcats [-0.750000]\tsat [-2.000000]"
    # word, count, summed log p, is BPE, summed log p of the next word, count with a next word; "under" is
    # cut off by the end of the sample: not listed, but it is the next word of "sat"
    assert sorted(lines[1:]) == sorted([
        "the\t1\t-1.0\tFalse\t-0.75\t1",
        "cats\t1\t-0.75\tTrue\t-2.0\t1",
        "sat\t1\t-2.0\tFalse\t-0.1875\t1",
    ])


def test_word_stats_accumulate_over_samples_and_sort_by_count(caplog):
    d = make_dictionary()
    target = torch.stack([encode(d, ["the", "sat", "the"]), encode(d, ["sat", "the", "mat"])])
    lprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    words = WordOutput(d, None, log_words=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        words.add_batch(torch.tensor([0, 1]), target, lprobs, torch.ones(2, 3, dtype=torch.bool))
        words.log_stats()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    # no per-sample lines without --output-word-probs; "the" (3 times) first; the last word of a sample
    # has no next token
    assert lines == [
        "the\t3\t-9.0\tFalse\t-8.0\t2",
        "sat\t2\t-6.0\tFalse\t-8.0\t2",
        "mat\t1\t-6.0\tFalse\t0.0\t0",
    ]


def test_remove_bpe_counts_words_for_perplexity():
    d = make_dictionary()
    bpe = BPE(d, "@@")
    assert {d[i] for i in bpe.pieces} == {"cat@@", "un@@", "der@@"}
    target = torch.stack([encode(d, ["the", "cat@@", "s", "un@@", "der@@"]),
                          encode(d, ["cat@@", "s", "sat", "un@@", "the"])])
    mask = torch.tensor([[True] * 5, [True, True, True, True, False]])
    # row 0: cat@@ and un@@ join the next token; der@@ ends the sample, so "under" counts as one word
    # row 1: cat@@ joins "s"; un@@ is the last counted token (the slot after it is masked)
    assert bpe.merged_pieces(target, mask) == 2 + 1


def test_remove_bpe_values():
    assert bpe_continuation(None) is None
    assert bpe_continuation("subword_nmt") == "@@"  # what the bare flag --remove-bpe stands for
    assert bpe_continuation("@@ ") == "@@"
    with pytest.raises(ValueError, match="--post-process letter: .*--remove-bpe sentencepiece"):
        bpe_continuation("letter")  # no marker scheme; sentencepiece has its own joiner (word_boundaries)


def test_remove_bpe_flag_parses_like_upstream():
    from fairseq import options

    def post_process(*flags):
        parser = options.get_eval_lm_parser()
        args = options.parse_args_and_arch(parser, ["data", "--path", "x.pt", *flags])
        return options.convert_namespace_to_config(args).common_eval.post_process

    assert post_process() is None
    assert post_process("--remove-bpe") == "subword_nmt"
    assert post_process("--remove-bpe", "@@ ") == "@@ "
    assert post_process("--post-process", "@@ ") == "@@ "
