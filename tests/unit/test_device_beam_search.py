"""Beam search on the device (fairseq.generation.device_beam_search) on tiny real models, on CPU: the step-by-step
loop's hypotheses (equal for one sentence, the same tokens for a batch), the static-step (CUDA-graph) path run
eagerly over attention windows smaller than the cache, the window-bounded cache reorder (the decode engine's), a
host sync per chunk instead of per step, and the plain reference beam search of test_sequence_generator. The
static path's reorder through a block table: tests/unit/test_beam_block_table.py."""

import math

import pytest
import torch

from fairseq.generation import cuda_graph_decoding, device_beam_search, device_decoding, search
from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.modules import CausalSelfAttention
from test_device_decoding import MIXED, decode, record_drops
from test_fconv_lm import tiny as fconv_lm_tiny
from test_sequence_generator import (
    ATOL,
    D,
    EOS,
    V,
    W,
    EagerStaticGenerator,
    GRUDecoder,
    PluginLM,
    StepwiseBeamSearch,
    assert_same_hypotheses,
    build,
    check_positional_scores,
    host_syncs,
    logits_with,
    reference_beam,
    unigram_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = [
    {},
    dict(len_penalty=0.5),
    dict(len_penalty=2.0),
    dict(min_len=6),
    dict(unk_penalty=0.5),
    dict(max_len_b=3),
    dict(max_len_b=30),
    dict(normalize_scores=False),
]


def stepwise_and_on_device(model, beam, **options):
    options = {"max_len_b": 12, **options}
    stepwise = SequenceGenerator([model], D, beam_size=beam, device_loop=False, **options)
    on_device = SequenceGenerator([model], D, beam_size=beam, **options, device_loop=True)
    assert device_beam_search.applies(on_device, beam) and not device_beam_search.applies(stepwise, beam)
    return stepwise, on_device


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("beam", [2, 3, 5])
def test_one_sentence_equals_the_step_by_step_loop(beam, options):
    model = build(seed=4)  # its hypotheses end at different steps
    stepwise, on_device = stepwise_and_on_device(model, beam, **options)
    ended_apart = False
    # MIXED: prompts of different lengths, none, a forced </s>, a forced <unk>. One sentence per batch: the same
    # operations on the same values, so equal, not close.
    for prompt in MIXED:
        expected, got = decode(stepwise, [prompt])[0], decode(on_device, [prompt])[0]
        assert len(got) == len(expected) and 1 <= len(got) <= beam, prompt
        for a, b in zip(got, expected):
            for key in ("tokens", "positional_scores", "score"):
                assert torch.equal(a[key], b[key]), (prompt, key)
        # hypotheses of one sentence that end at different steps: some ended while the sentence went on
        ended_apart |= len({len(h["tokens"]) for h in expected}) > 1
    assert ended_apart or options.get("max_len_b") == 3 or "min_len" in options


@pytest.mark.parametrize("options", [dict(min_len=0), {}])
def test_ended_candidates_taken_as_hypotheses_are_ignored_as_the_loop_ignores_them(monkeypatch, options):
    """Each hypothesis has one </s> candidate, so fewer than beam of the 2 * beam candidates go on only when
    there are fewer candidates: with beam = V - 1, at step 0 (one hypothesis: V - 1 candidates) or after a forced
    </s>. Then ended ones are taken, and ignored after (SequenceGenerator's cands_to_ignore)."""
    beam = V - 1
    ignored = []
    original = device_beam_search.DeviceBeamSearch._choose

    def spy(self, lp, buf, rows, b, window, first):
        original(self, lp, buf, rows, b, window, first)
        ignored.append(bool(buf.ignore[: rows // beam].any()))

    monkeypatch.setattr(device_beam_search.DeviceBeamSearch, "_choose", spy)
    stepwise, on_device = stepwise_and_on_device(build(seed=4), beam, **options)
    for prompt in ([], [EOS, W[3]], [W[1]]):
        expected, got = decode(stepwise, [prompt])[0], decode(on_device, [prompt])[0]
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            for key in ("tokens", "positional_scores", "score"):
                assert torch.equal(a[key], b[key]), (prompt, key)
    assert any(ignored)


@pytest.mark.parametrize("options", OPTIONS + [dict(len_penalty=2.0, min_len=3, unk_penalty=0.5)])
@pytest.mark.parametrize("beam", [2, 3, 5])
def test_a_batch_gives_the_step_by_step_loops_tokens(beam, options):
    model = build(seed=4)
    stepwise, on_device = stepwise_and_on_device(model, beam, **options)
    # The step-by-step loop drops finished sentences, so its matrix products run at other batch sizes (scores
    # ~1e-6 apart); the tokens are equal.
    expected, got = decode(stepwise, MIXED), decode(on_device, MIXED)
    assert_same_hypotheses(got, expected)
    ends = {max(len(h["tokens"]) for h in sentence) for sentence in expected}
    assert len(ends) > 1 or options.get("max_len_b") == 3  # sentences end at different steps


@pytest.mark.parametrize("models", ["ensemble", "fconv"])
def test_an_ensemble_and_a_convolutional_decoder_give_the_step_by_step_loops_hypotheses(models):
    # fconv_lm takes a prompt at once but has no static step: the dynamic path, with its own cache reorder.
    models = [build(seed=7), build(seed=8)] if models == "ensemble" else [fconv_lm_tiny(seed=5, vocab=V)]
    options = dict(beam_size=3, max_len_b=12)
    stepwise = SequenceGenerator(models, D, device_loop=False, **options)
    on_device = SequenceGenerator(models, D, **options, device_loop=True)
    assert device_beam_search.applies(on_device, 3)
    for prompt in MIXED[:5]:
        expected, got = decode(stepwise, [prompt])[0], decode(on_device, [prompt])[0]
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            for key in ("tokens", "positional_scores", "score"):
                assert torch.equal(a[key], b[key]), (prompt, key)
    assert_same_hypotheses(decode(on_device, MIXED), decode(stepwise, MIXED))


@pytest.mark.parametrize("beam", [2, 3, 5])
def test_the_plain_reference_beam_search_agrees(beam):
    model = build(seed=3)
    for prompt, options in (([W[2], W[5]], dict(len_penalty=0.5)), ([], dict(min_len=3)), ([W[1]], {})):
        generator = SequenceGenerator([model], D, beam_size=beam, max_len_b=7, device_loop=True, **options)
        hypos = decode(generator, [prompt])[0]
        expected = reference_beam(
            model,
            prompt,
            beam=beam,
            max_len=7,
            lenpen=options.get("len_penalty", 1.0),
            min_len=options.get("min_len", 1),
        )
        assert [h["tokens"].tolist() for h in hypos] == [e[0] for e in expected]
        for hypo, (_, score, positional) in zip(hypos, expected):
            torch.testing.assert_close(float(hypo["score"]), score, atol=ATOL, rtol=0)
            torch.testing.assert_close(hypo["positional_scores"], torch.tensor(positional), atol=ATOL, rtol=0)
            check_positional_scores(model, hypo)


def test_hypotheses_are_laid_out_as_the_loops_and_outlive_the_buffers():
    model = build(seed=4)
    generator = SequenceGenerator([model], D, beam_size=3, max_len_b=12, device_loop=True)
    first = decode(generator, MIXED[:3])
    kept = [[{k: (v.clone() if torch.is_tensor(v) else v) for k, v in h.items()} for h in s] for s in first]
    decode(generator, MIXED[3:])  # the device buffers are reused
    assert_same_hypotheses(first, kept)
    for sentence in first:
        assert len(sentence) == 3
        assert [float(h["score"]) for h in sentence] == sorted((float(h["score"]) for h in sentence), reverse=True)
        for hypo in sentence:
            assert set(hypo) == {"tokens", "score", "attention", "alignment", "positional_scores"}
            assert hypo["attention"] is None and hypo["alignment"].numel() == 0
            assert hypo["tokens"][-1] == EOS and hypo["tokens"].device.type == "cpu"


def test_what_the_device_loop_does_not_implement_keeps_the_step_by_step_loop():
    model = build()
    for generator in (
        SequenceGenerator([model], D, beam_size=2, device_loop=False),
        SequenceGenerator([model], D, beam_size=2, no_repeat_ngram_size=2),
        SequenceGenerator([model], D, beam_size=2, match_source_len=True),
        SequenceGenerator([model], D, beam_size=2, search_strategy=search.Sampling(D)),
        SequenceGenerator([model], D, beam_size=2, search_strategy=StepwiseBeamSearch(D)),
        SequenceGenerator([PluginLM(GRUDecoder(D)).eval()], D, beam_size=2),
    ):
        assert not device_beam_search.applies(generator, 2)
    beam_one = SequenceGenerator([model], D, device_loop=True)
    assert not device_beam_search.applies(beam_one, 1) and device_decoding.applies(beam_one, 1)


@pytest.mark.parametrize("window", [4, 256])
@pytest.mark.parametrize("beam", [2, 3])
def test_the_static_step_loop_over_attention_windows_gives_the_same_tokens(monkeypatch, beam, window):
    monkeypatch.setattr(cuda_graph_decoding, "ATTENTION_WINDOW", window)
    model = build(seed=4)
    stepwise = SequenceGenerator([model], D, beam_size=beam, device_loop=False, max_len_b=20)
    static = EagerStaticGenerator([model], D, beam_size=beam, max_len_b=20)  # the CUDA-graph path, run eagerly
    # Then fewer sentences (the caches are reused), then more (a new, larger cache; 9 sentences run as 16).
    for prompts in (MIXED, MIXED[1:3], MIXED + [[W[5]] * 6]):
        expected, got = decode(stepwise, prompts), decode(static, prompts)
        assert_same_hypotheses(got, expected)
        capacity = static.step_model.graphed.capacity
        assert capacity == 64 and "beam" in static.step_model.graphed.extra
        assert static.step_model.block_table is None  # the caches are read row by row again after the call
    assert static.step_model.graphed.rows == 16 * beam


def test_a_windowed_reorder_moves_the_first_slots_of_the_rows_only():
    attention = CausalSelfAttention(8, 2)
    state = {}
    entry = attention._cache_entry(state)
    entry["key_buffer"], entry["value_buffer"] = torch.randn(4, 2, 16, 4), torch.randn(4, 2, 16, 4)
    entry["length"] = 3  # a static step leaves the plain-int length behind: the window decides
    before = {name: entry[name].clone() for name in ("key_buffer", "value_buffer")}
    order = torch.tensor([2, 2, 0, 1])
    attention.reorder_incremental_state(state, order, 8)
    for name, old in before.items():
        assert torch.equal(entry[name][:, :, :8], old[order, :, :8])
        assert torch.equal(entry[name][:, :, 8:], old[:, :, 8:])
    assert entry["length"] == 3


def test_one_host_sync_per_chunk_not_per_step():
    model = unigram_model(logits_with(w1=2.0, w2=1.0, eos=-30.0))  # </s> never wins: every output is long
    prompts = [[W[1]], [W[2], W[3]]]

    def syncs(length, **kwargs):
        generator = SequenceGenerator([model], D, beam_size=3, max_len_b=length, **{"device_loop": True, **kwargs})
        return host_syncs(generator, prompts)

    length = 3 * device_decoding.CHUNK  # within the model's 64 positions
    stepwise, on_device = stepwise_and_on_device(model, 3, max_len_b=length)
    assert_same_hypotheses(decode(on_device, prompts), decode(stepwise, prompts))
    assert all(len(h["tokens"]) == length + 1 for s in decode(on_device, prompts) for h in s)
    assert syncs(length, device_loop=False) >= length
    # one per chunk; the set-up's few (the prompts' width, the end steps) do not grow with the length
    chunks = math.ceil(length / device_decoding.CHUNK)
    assert chunks <= syncs(length) <= chunks + 6
    assert syncs(length) - syncs(length - device_decoding.CHUNK) == 1


@pytest.mark.parametrize("static", [False, True])
def test_done_sentences_leave_the_batch_between_chunks(monkeypatch, static):
    monkeypatch.setattr(cuda_graph_decoding, "ATTENTION_WINDOW", 8)
    model = build(seed=4)
    stepwise = SequenceGenerator([model], D, beam_size=2, device_loop=False, max_len_b=50)
    generator = (EagerStaticGenerator if static else SequenceGenerator)(
        [model], D, beam_size=2, max_len_b=50, device_loop=True
    )
    drops = record_drops(generator)
    got, expected = decode(generator, MIXED), decode(stepwise, MIXED)
    assert_same_hypotheses(got, expected)  # stored when they leave, ranked best first at the end
    assert drops and all(new < old and new % 2 == 0 for old, new, _ in drops)
    if static:  # graph rows: 2 x (8, 4, 2, 1) sentences
        assert all(graph in (8, 4, 2) for _, _, graph in drops)
