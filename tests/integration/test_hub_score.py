"""The hub interface on the session's tiny word-level model (tiny_lm_checkpoint): what `lm.score` scores, as
upstream fairseq 0.12.2 (tokens without the final </s>, one log-probability per token given </s> or <s> and the
tokens before it, lines joined by </s>, NaN for an empty sentence), checked against one forward of the model;
and the generator kept per generation options (reused with the same options, rebuilt with others, dropped when
the interface moves)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fairseq.models.transformer_lm import TransformerLanguageModel
from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.generation.sequence_scorer import SequenceScorer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread

SENTENCES = ["w1 w2 w3", "w5", "w0 w12 w1 w4 w3 w2 w1 w7 w9", "w3 w3"]


def load(checkpoint, data, **overrides):
    return TransformerLanguageModel.from_pretrained(
        str(checkpoint.parent), checkpoint.name, data_name_or_path=str(data), **overrides
    )


@pytest.fixture(scope="module")
def lm(tiny_lm_checkpoint, tiny_data):
    return load(tiny_lm_checkpoint, tiny_data)


def forward_log_probs(model, start, ids):
    """log p(ids[k] | start, ids[:k]) for each k, from one forward of the model (fp32) over start + ids[:-1]."""
    source = torch.tensor([start] + ids[:-1])
    with torch.no_grad():
        log_probs = F.log_softmax(model(source[None])[0][0].float(), dim=-1)
    return log_probs[torch.arange(len(ids)), torch.tensor(ids)]


def ids(lm, words):
    return [lm.src_dict.index(w) for w in words.split()]


# ---------------------------------------------------------------------------------------------------- score


def test_one_score_per_token_the_final_eos_and_the_start_token_not_scored(lm):
    d = lm.src_dict
    hypo = lm.score("w1 w2 w3")
    assert lm.encode("w1 w2 w3").tolist() == ids(lm, "w1 w2 w3") + [d.eos()]
    # upstream: the model reads </s> w1 w2 w3 and is scored on w1 w2 w3; the final </s> is not scored
    assert hypo["tokens"].tolist() == ids(lm, "w1 w2 w3")
    assert hypo["positional_scores"].shape == (3,) and hypo["positional_scores"].dtype == torch.float32
    expected = forward_log_probs(lm.models[0], d.eos(), ids(lm, "w1 w2 w3"))
    torch.testing.assert_close(hypo["positional_scores"], expected, rtol=0, atol=1e-5)
    assert float(hypo["score"]) == pytest.approx(float(expected.mean()), abs=1e-5)
    # upstream README's perplexity of a sentence
    ppl = hypo["positional_scores"].mean().neg().exp()
    assert float(ppl) == pytest.approx(math.exp(-float(expected.mean())), rel=1e-5)
    assert hypo["attention"] is None and hypo["alignment"] is None


def test_with_add_bos_token_the_model_reads_bos_first_and_bos_is_not_scored(tiny_lm_checkpoint, tiny_data, lm):
    with_bos = load(tiny_lm_checkpoint, tiny_data, add_bos_token=True)
    hypo = with_bos.score("w1 w2 w3")
    assert hypo["tokens"].tolist() == ids(lm, "w1 w2 w3")
    expected = forward_log_probs(with_bos.models[0], lm.src_dict.bos(), ids(lm, "w1 w2 w3"))
    torch.testing.assert_close(hypo["positional_scores"], expected, rtol=0, atol=1e-5)
    # the start token matters: from </s> the scores differ
    assert (hypo["positional_scores"] - lm.score("w1 w2 w3")["positional_scores"]).abs().max() > 1e-3


def test_replace_newline_with_eos_scores_the_eos_between_lines(lm):
    eos = lm.src_dict.eos()
    text = "w1 w2\n\nw3\n"
    joined = lm.score(text, replace_newline_with_eos=True)
    # lines "w1 w2", "", "w3": w1 w2 </s> </s> w3 </s>, the final </s> dropped: 5 scores, both inner </s> scored
    tokens = ids(lm, "w1 w2") + [eos, eos] + ids(lm, "w3")
    assert joined["tokens"].tolist() == tokens
    torch.testing.assert_close(
        joined["positional_scores"], forward_log_probs(lm.models[0], eos, tokens), rtol=0, atol=1e-5
    )
    # without it, newlines are whitespace
    assert lm.score(text)["tokens"].tolist() == ids(lm, "w1 w2 w3")
    # a leading empty line's </s> is dropped, as upstream strips </s> at both ends
    assert lm.score("\nw1 w2", replace_newline_with_eos=True)["tokens"].tolist() == ids(lm, "w1 w2")


def test_empty_sentence_has_no_scores_and_a_nan_mean(lm):
    hypo = lm.score("")
    assert hypo["tokens"].tolist() == [] and hypo["positional_scores"].numel() == 0
    assert math.isnan(float(hypo["score"]))  # upstream: a sum of nothing over 0 tokens


def test_batches_score_each_sentence_as_alone_in_input_order(lm):
    model, eos = lm.models[0], lm.src_dict.eos()
    expected = [forward_log_probs(model, eos, ids(lm, s)) for s in SENTENCES]
    saved = (lm.cfg.dataset.max_tokens, lm.cfg.dataset.batch_size)
    try:
        for max_tokens, batch_size in ((256, None), (None, 1), (12, None)):  # one batch, one per batch, by size
            lm.cfg.dataset.max_tokens, lm.cfg.dataset.batch_size = max_tokens, batch_size
            results = lm.score(SENTENCES)
            assert [h["tokens"].tolist() for h in results] == [ids(lm, s) for s in SENTENCES]
            for hypo, want in zip(results, expected):
                torch.testing.assert_close(hypo["positional_scores"], want, rtol=0, atol=1e-5)
    finally:
        lm.cfg.dataset.max_tokens, lm.cfg.dataset.batch_size = saved


def test_scores_come_from_eval_mode_unless_retain_dropout(tiny_lm_checkpoint, tiny_data, lm):
    want = lm.score(SENTENCES[2])["positional_scores"]
    lm.train()  # as upstream's scorer, every call runs the models in eval mode
    try:
        torch.testing.assert_close(lm.score(SENTENCES[2])["positional_scores"], want, rtol=0, atol=0)
        assert not lm.models[0].training
    finally:
        lm.eval()
    dropout = load(tiny_lm_checkpoint, tiny_data, retain_dropout=True)  # trained with --dropout 0.1
    torch.manual_seed(0)
    first = dropout.score(SENTENCES[2])["positional_scores"]
    second = dropout.score(SENTENCES[2])["positional_scores"]
    assert (first - second).abs().max() > 1e-3 and (first - want).abs().max() > 1e-3
    dropout.sample("w1", beam=1, max_len_b=4)
    assert dropout.models[0].training  # building a generator does not turn it off


# ---------------------------------------------------------------------------------------------- generators


def uncached_generate(lm, sentences, **options):
    """What generate() did before generators were kept: a new generator for each call, over the hub's batches
    (their order matters to sampling), the results in input order."""
    gen_args = copy.deepcopy(lm.cfg.generation)
    for key, value in options.items():
        setattr(gen_args, key, value)
    generator = lm.task.build_generator(lm.models, gen_args)
    by_id = {}
    for batch in lm._build_batches([lm.encode(s) for s in sentences], skip_invalid_size_inputs=False):
        by_id.update(zip(batch["id"].tolist(), lm.task.inference_step(generator, lm.models, batch)))
    return [by_id[i] for i in range(len(sentences))]


def assert_same_hypotheses(got, want):
    assert len(got) == len(want)
    for hypos_got, hypos_want in zip(got, want):
        assert [h["tokens"].tolist() for h in hypos_got] == [h["tokens"].tolist() for h in hypos_want]
        for a, b in zip(hypos_got, hypos_want):
            torch.testing.assert_close(a["positional_scores"], b["positional_scores"], rtol=0, atol=1e-6)
            torch.testing.assert_close(a["score"], b["score"], rtol=0, atol=1e-6)


def test_same_options_reuse_the_generator_with_the_uncached_output(lm):
    encoded = [lm.encode(s) for s in SENTENCES]
    generator = lm.generator_for(beam=2, max_len_b=12)
    assert isinstance(generator, SequenceGenerator) and generator.beam_size == 2 and generator.max_len_b == 12
    first = lm.generate(encoded, beam=2, max_len_b=12)
    second = lm.generate(encoded, beam=2, max_len_b=12)
    assert lm.generator_for(beam=2, max_len_b=12) is generator  # neither call built another
    assert_same_hypotheses(first, second)
    assert_same_hypotheses(first, uncached_generate(lm, SENTENCES, beam=2, max_len_b=12))
    # different batch shapes through one kept generator
    assert_same_hypotheses(lm.generate(encoded[1:3], beam=2, max_len_b=12), first[1:3])
    assert lm.generator_for(beam=2, max_len_b=12) is generator
    # sampling: the kept generator draws what a new one draws from the same seed
    torch.manual_seed(5)
    sampled = lm.generate(encoded, beam=2, sampling=True, sampling_topk=5, max_len_b=12)
    torch.manual_seed(5)
    assert_same_hypotheses(lm.generate(encoded, beam=2, sampling=True, sampling_topk=5, max_len_b=12), sampled)
    torch.manual_seed(5)
    assert_same_hypotheses(
        uncached_generate(lm, SENTENCES, beam=2, sampling=True, sampling_topk=5, max_len_b=12), sampled
    )


def test_other_options_give_another_generator_that_applies_them(lm):
    greedy, beam2 = lm.generator_for(beam=1, max_len_b=12), lm.generator_for(beam=2, max_len_b=12)
    assert greedy is not beam2 and (greedy.beam_size, beam2.beam_size) == (1, 2)
    prompt = lm.encode(SENTENCES[0])
    assert len(lm.generate(prompt, beam=1, max_len_b=12)) == 1
    assert len(lm.generate(prompt, beam=2, max_len_b=12)) == 2
    hot = lm.generator_for(beam=1, max_len_b=12, temperature=0.5)
    assert hot is not greedy and hot.temperature == 0.5 and greedy.temperature == 1.0
    # lengths: with --min-len at the limit every output is exactly max_len_b tokens (the prompt counts) + </s>
    for n in (6, 9):
        assert len(lm.generate(prompt, beam=1, max_len_b=n, min_len=n)[0]["tokens"]) == n + 1
    assert lm.generator_for(beam=1, max_len_b=9, min_len=9) is not lm.generator_for(beam=1, max_len_b=6, min_len=6)
    scorer = lm.generator_for(score_reference=True)
    assert isinstance(scorer, SequenceScorer) and lm.generator_for(score_reference=True) is scorer
    with pytest.raises(ValueError, match="samplin=True is no generation option"):
        lm.generator_for(beam=1, samplin=True)


def test_the_last_generators_are_kept_and_moving_the_interface_drops_them(tiny_lm_checkpoint, tiny_data):
    lm = load(tiny_lm_checkpoint, tiny_data)
    kept = lm.max_cached_generators
    generators = [lm.generator_for(beam=1, max_len_b=n) for n in range(1, kept + 2)]
    assert lm.generator_for(beam=1, max_len_b=kept + 1) is generators[-1]
    assert lm.generator_for(beam=1, max_len_b=2) is generators[1]
    assert lm.generator_for(beam=1, max_len_b=1) is not generators[0]  # the least recently used went first
    prompt = lm.encode(SENTENCES[0])
    before = lm.generate(prompt, beam=1, max_len_b=12)
    generator = lm.generator_for(beam=1, max_len_b=12)
    lm.to(torch.float64)
    assert lm.generator_for(beam=1, max_len_b=12) is not generator
    lm.float()
    assert_same_hypotheses([lm.generate(prompt, beam=1, max_len_b=12)], [before])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_kept_generator_keeps_its_graphs(tiny_lm_checkpoint, tiny_data):
    lm = load(tiny_lm_checkpoint, tiny_data).cuda()
    encoded = [lm.encode(s) for s in SENTENCES]
    first = lm.generate(encoded, beam=2, max_len_b=12)
    generator = lm.generator_for(beam=2, max_len_b=12)
    graphed = generator.step_model.graphed
    assert graphed is not None and graphed.graphs
    assert_same_hypotheses(lm.generate(encoded, beam=2, max_len_b=12), first)
    assert lm.generator_for(beam=2, max_len_b=12) is generator and generator.step_model.graphed is graphed
    lm.generate(encoded[:1], beam=2, max_len_b=12)  # fewer rows: another graph of the same step
    eager = lm.generate(encoded, beam=2, max_len_b=12, no_cuda_graphs=True)
    for got, want in zip(first, eager):
        assert [h["tokens"].tolist() for h in got] == [h["tokens"].tolist() for h in want]
