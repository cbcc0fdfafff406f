"""fairseq-eval-lm --output-word-probs / --output-word-stats / --remove-bpe on hand-made token scores."""

import logging

import pytest
import torch

from fairseq.data.dictionary import Dictionary
from fairseq_cli.eval_lm_words import WordOutput, bpe_continuation, word_boundaries

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
    # sample 7: "the cat@@ s sat un@@ der@@" (a word cut off at the end) and one ignored (masked) slot;
    # sample 8 begins with "mat", which completes "undermat"
    target = torch.stack(
        [
            encode(d, ["the", "cat@@", "s", "sat", "un@@", "der@@", "mat"]),
            encode(d, ["mat", "the", "the", "the", "the", "the", "the"]),
        ]
    )
    src = torch.stack(
        [
            torch.cat([torch.tensor([d.eos()]), target[0, :-1]]),
            torch.cat([torch.tensor([d.index("der@@")]), target[1, :-1]]),
        ]
    )
    lprobs = torch.tensor([[-1.0, -0.5, -0.25, -2.0, -0.125, -0.0625, -9.0], [-4.0] + [-1.0] * 6])
    mask = torch.tensor([[True] * 6 + [False], [True, True] + [False] * 5])
    bpe = word_boundaries("@@ ", d)
    begins = bpe.word_beginnings(src, target)
    words = WordOutput(d, bpe, log_words=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        words.add_batch(torch.tensor([7, 8]), target, lprobs, mask, begins)
        words.finish()
        words.log_stats()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    # the sample id, then word [natural-log probability] with 6 decimals, tab-separated; "undermat" is
    # listed once, in the sample where it begins, with the log probabilities of all its pieces
    assert lines[:2] == [
        "7 the [-1.000000]\tcats [-0.750000]\tsat [-2.000000]\tundermat [-4.187500]",
        "8 the [-1.000000]",
    ]
    # word, count, summed log p, is BPE, summed log p of the next word, count with a next word
    assert sorted(lines[2:]) == sorted(
        [
            "the\t2\t-2.0\tFalse\t-0.75\t1",
            "cats\t1\t-0.75\tTrue\t-2.0\t1",
            "sat\t1\t-2.0\tFalse\t-4.1875\t1",
            "undermat\t1\t-4.1875\tTrue\t0.0\t0",
        ]
    )
    assert int((begins & mask).sum()) == 5  # the words: "mat" continues sample 7's last word


def test_word_stats_accumulate_over_samples_and_sort_by_count(caplog):
    d = make_dictionary()
    target = torch.stack([encode(d, ["the", "sat", "the"]), encode(d, ["sat", "the", "mat"])])
    lprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    words = WordOutput(d, None, log_words=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        words.add_batch(torch.tensor([0, 1]), target, lprobs, torch.ones(2, 3, dtype=torch.bool))
        words.finish()
        words.log_stats()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    # no per-sample lines without --output-word-probs; "the" (3 times) first; the last word of a sample
    # has no next token
    assert lines == ["the\t3\t-9.0\tFalse\t-8.0\t2", "sat\t2\t-6.0\tFalse\t-8.0\t2", "mat\t1\t-6.0\tFalse\t0.0\t0"]


def test_word_beginnings_after_eos_and_a_bare_sentencepiece_mark():
    d = Dictionary()
    for piece in ["\u2581the", "\u2581", "1990", "cat", "\u2581sat"]:
        d.add_symbol(piece)
    bpe = word_boundaries("sentencepiece", d)
    # "▁the </s> 1990 ▁ <unk> ▁ 1990 cat ▁sat": </s> ends a word (the piece after it begins one), a bare ▁
    # joins the piece after it (also <unk>, sentencepiece's unknown character)
    pieces = ["\u2581the", "</s>", "1990", "\u2581", "<unk>", "\u2581", "1990", "cat", "\u2581sat"]
    target = encode(d, pieces).unsqueeze(0)
    src = torch.cat([torch.tensor([[d.eos()]]), target[:, :-1]], dim=1)
    assert bpe.word_beginnings(src, target)[0].tolist() == [True, True, True, True, False, True, False, False, True]


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
