"""The device decode loop (fairseq.generation.device_decoding) on tiny real models, on CPU: greedy results equal
to the step-by-step loop's, the static-step (CUDA-graph) path run eagerly over attention windows smaller than
the cache, a host sync per chunk instead of per token, counter-based sampling that depends on the seed and the
sentence only (and draws from the model's distribution), and streaming."""

import math

import pytest
import torch

from fairseq.generation import cuda_graph_decoding, device_decoding, sampling, search
from fairseq.generation.sequence_generator import SequenceGenerator
from test_sequence_generator import (
    ATOL,
    D,
    EOS,
    PAD,
    PROMPTS,
    UNK,
    W,
    EagerStaticGenerator,
    build,
    host_syncs,
    logits_with,
    sample_of,
    sequence_log_probs,
    unigram_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MIXED = PROMPTS + [[W[6]] * 3, [W[2]], [EOS, W[3]], [W[1], UNK, W[2]]]  # a forced </s>, a forced <unk>


def decode(generator, prompts, ids=None, **kwargs):
    sample, prefix = sample_of(prompts)
    if ids is not None:
        sample["id"] = torch.tensor(ids)
    return generator.generate(None, sample, prefix_tokens=prefix, **kwargs)


def tokens_of(hypos):
    return [[h["tokens"].tolist() for h in sentence] for sentence in hypos]


@pytest.mark.parametrize(
    "options",
    [{}, dict(unk_penalty=0.5), dict(min_len=6), dict(temperature=0.7), dict(max_len_b=3), dict(max_len_b=30)],
)
def test_greedy_equals_the_step_by_step_loop(options):
    model = build(seed=4)  # its sentences end at different steps
    options = {"max_len_b": 12, **options}
    stepwise = SequenceGenerator([model], D, device_loop=False, **options)
    on_device = SequenceGenerator([model], D, **options, device_loop=True)
    assert device_decoding.applies(on_device, 1) and not device_decoding.applies(stepwise, 1)
    # One sentence per batch: the same operations on the same values, so equal, not close.
    for prompt in MIXED:
        expected, got = decode(stepwise, [prompt])[0][0], decode(on_device, [prompt])[0][0]
        for key in ("tokens", "positional_scores", "score"):
            assert torch.equal(got[key], expected[key]), (prompt, key)
    # A batch: the step-by-step loop drops finished sentences, so its matmuls run at other batch sizes
    # (scores ~1e-6 apart); the tokens are equal.
    expected, got = decode(stepwise, MIXED), decode(on_device, MIXED)
    assert tokens_of(got) == tokens_of(expected)
    assert len({len(s[0]["tokens"]) for s in expected}) > 1
    for a, b in zip(got, expected):
        torch.testing.assert_close(a[0]["positional_scores"], b[0]["positional_scores"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [4, 256])
def test_the_static_step_loop_over_attention_windows_gives_the_same_tokens(monkeypatch, window):
    monkeypatch.setattr(cuda_graph_decoding, "ATTENTION_WINDOW", window)
    model = build(seed=4)
    stepwise = SequenceGenerator([model], D, device_loop=False, max_len_b=20)
    static = EagerStaticGenerator([model], D, max_len_b=20)  # the CUDA-graph path, run eagerly
    windows = []
    original = static.step_model.static_step
    static.step_model.static_step = lambda *args: windows.append(args[3]) or original(*args)
    for prompts in (MIXED, MIXED[1:3], MIXED + [[W[5]] * 6]):
        expected, got = decode(stepwise, prompts), decode(static, prompts)
        assert tokens_of(got) == tokens_of(expected)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a[0]["positional_scores"], b[0]["positional_scores"], atol=ATOL, rtol=0)
    capacity = static.step_model.graphed.capacity
    assert capacity == 64 and "loop" in static.step_model.graphed.extra
    if window == 4:  # the live length rounded up to 4, not the capacity
        assert min(windows) == 4 and max(windows) < capacity and sorted(set(windows)) == list(range(4, 28, 4))
    else:
        assert set(windows) == {capacity}


def record_drops(generator):
    """The list of (rows before, rows after, rows computed) of each time `generator`'s device loop shrinks its
    batch, filled as it decodes."""
    drops = []
    drop = generator._device_loop._drop_finished

    def recorded(b, buf, rows, *rest):
        new_rows, graph_rows = drop(b, buf, rows, *rest)
        if new_rows != rows:
            drops.append((rows, new_rows, graph_rows))
        return new_rows, graph_rows

    generator._device_loop._drop_finished = recorded
    return drops


@pytest.mark.parametrize("static", [False, True])
def test_finished_sentences_leave_the_batch_between_chunks(monkeypatch, static):
    monkeypatch.setattr(cuda_graph_decoding, "ATTENTION_WINDOW", 8)
    model = build(seed=4)  # with 50 tokens allowed its sentences end after 1 to 51 tokens
    stepwise = SequenceGenerator([model], D, device_loop=False, max_len_b=50)
    generator = (EagerStaticGenerator if static else SequenceGenerator)([model], D, max_len_b=50, device_loop=True)
    drops = record_drops(generator)
    streamed = []
    got = decode(generator, MIXED, on_tokens=lambda tokens, done: streamed.append((tokens, done)))
    expected = decode(stepwise, MIXED)
    assert tokens_of(got) == tokens_of(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a[0]["positional_scores"], b[0]["positional_scores"], atol=ATOL, rtol=0)
        torch.testing.assert_close(a[0]["score"], b[0]["score"], atol=ATOL, rtol=0)
    assert sorted(len(s[0]["tokens"]) for s in got) == [1, 4, 6, 8, 17, 22, 40, 51]
    # a chunk after which sentences are done shrinks the batch: eagerly always, with graphs when the rounded
    # row count (8, 4, 2, 1) goes down (to the 4 and 2 graphs); (rows before, rows after, rows computed)
    assert drops == [(8, 3, 4 if static else 3), (3, 2, 2), (2, 1, 1)]
    final_tokens, final_done = streamed[-1]
    assert final_done.all()
    for row, sentence in enumerate(got):  # the streamed batch keeps batch order while rows leave
        toks = sentence[0]["tokens"].tolist()
        assert final_tokens[row, 1 : 1 + len(toks)].tolist() == toks


def test_one_host_sync_per_chunk_not_per_token():
    model = unigram_model(logits_with(w1=2.0, w2=1.0, eos=-30.0))  # </s> never chosen: every output is long
    length = 3 * device_decoding.CHUNK  # within the model's 64 positions
    stepwise = SequenceGenerator([model], D, device_loop=False, max_len_b=length)
    on_device = SequenceGenerator([model], D, max_len_b=length, device_loop=True)
    prompts = [[W[1]], [W[2], W[3]]]
    assert tokens_of(decode(on_device, prompts)) == tokens_of(decode(stepwise, prompts))
    assert all(len(s[0]["tokens"]) == length + 1 for s in decode(on_device, prompts))
    chunks = math.ceil(length / device_decoding.CHUNK)
    assert host_syncs(stepwise, prompts) >= length
    # one per chunk; the set-up's few (the prompts' width, the end steps) do not grow with the length
    assert chunks <= host_syncs(on_device, prompts) <= chunks + 6


# ---- sampling --------------------------------------------------------------------------------------------


def sampler(seed=11, beam=1, **kwargs):
    return SequenceGenerator(
        [build(seed=4)],
        D,
        beam_size=beam,
        max_len_b=10,
        search_strategy=search.Sampling(D, seed=seed, **kwargs),
        device_loop=True,
    )


@pytest.mark.parametrize("kwargs", [{}, dict(sampling_topk=3), dict(sampling_topp=0.6)])
def test_a_sentences_sample_depends_on_the_seed_and_the_sentence_not_the_batch(kwargs):
    generator = sampler(**kwargs)
    prompts, ids = MIXED[:6], [10, 11, 12, 13, 14, 15]
    together = tokens_of(decode(generator, prompts, ids))
    alone = [tokens_of(decode(generator, [p], [i]))[0] for p, i in zip(prompts, ids)]
    reversed_batch = tokens_of(decode(generator, prompts[::-1], ids[::-1]))[::-1]
    assert together == alone == reversed_batch
    assert tokens_of(decode(sampler(seed=12, **kwargs), prompts, ids)) != together
    # the same prompt as another sentence (another id) is another draw
    assert len({str(tokens_of(decode(generator, [[W[1]]], [i]))) for i in range(6)}) > 1
    model = generator.model.single_model
    for prompt, sentence in zip(prompts, decode(generator, prompts, ids)):
        toks = sentence[0]["tokens"].tolist()
        all_lp = sequence_log_probs(model, [EOS] + toks[:-1])
        all_lp[:, PAD] = -math.inf
        # the score of each drawn token is the model's log-probability of it
        torch.testing.assert_close(
            sentence[0]["positional_scores"],
            all_lp.gather(1, torch.tensor(toks).unsqueeze(1)).squeeze(1),
            atol=ATOL,
            rtol=0,
        )
        for i in range(len([t for t in prompt if t != EOS]), len(toks) - 1):
            if "sampling_topk" in kwargs:
                assert toks[i] in all_lp[i].topk(3).indices.tolist()
            elif "sampling_topp" in kwargs:
                assert float(all_lp[i].exp()[all_lp[i] > all_lp[i][toks[i]]].sum()) < 0.6


def test_sampling_seeds_default_to_torchs_initial_seed():
    generator = SequenceGenerator(
        [build(seed=4)], D, max_len_b=10, search_strategy=search.Sampling(D), device_loop=True
    )
    torch.manual_seed(3)
    first = tokens_of(decode(generator, MIXED[:4]))
    torch.rand(5)  # the draws do not read torch's RNG state, only its seed
    assert tokens_of(decode(generator, MIXED[:4])) == first
    torch.manual_seed(4)
    assert tokens_of(decode(generator, MIXED[:4])) != first


@pytest.mark.parametrize(
    "kwargs,kept",
    [({}, ("w1", "w2", "w3")), (dict(sampling_topk=2), ("w1", "w2")), (dict(sampling_topp=0.7), ("w1", "w2"))],
)
def test_draws_follow_the_models_distribution_over_the_kept_tokens(kwargs, kept):
    logits = [-30.0] * len(D)  # every other token: p ~ 1e-13
    logits[W[1]], logits[W[2]], logits[W[3]] = 1.0, 0.5, 0.0
    model = unigram_model(logits)
    generator = SequenceGenerator(
        [model], D, max_len_b=1, search_strategy=search.Sampling(D, seed=5, **kwargs), device_loop=True
    )
    n = 4000
    drawn = [s[0]["tokens"][0].item() for s in decode(generator, [[]] * n, list(range(n)))]
    probs = torch.log_softmax(torch.tensor(logits), 0).exp()
    kept_ids = [W[int(name[1:])] for name in kept]
    kept_mass = float(probs[kept_ids].sum())
    counts = {t: drawn.count(t) for t in set(drawn)}
    assert set(counts) == set(kept_ids)  # nothing outside the kept set
    for token in kept_ids:
        p = float(probs[token]) / kept_mass  # renormalized over the kept set
        # a fixed seed makes this exact; the bound is 4 standard deviations of a binomial count
        assert abs(counts[token] - n * p) < 4 * math.sqrt(n * p * (1 - p)), (token, counts[token], n * p)


def test_gumbel_noise_is_a_function_of_key_step_and_token():
    keys = sampling.sentence_keys(7, torch.tensor([0, 1, 2]))
    ids = torch.arange(50)
    full = sampling.gumbel_noise(keys, torch.tensor([3]), ids)
    part = sampling.gumbel_noise(keys[1:2], torch.tensor([3]), ids[10:20].unsqueeze(0))
    assert torch.equal(part, full[1:2, 10:20])
    assert not torch.equal(full, sampling.gumbel_noise(keys, torch.tensor([4]), ids))
    assert len(set(keys.tolist())) == 3 and torch.isfinite(full).all()
    uniform = torch.exp(
        -torch.exp(
            -sampling.gumbel_noise(sampling.sentence_keys(1, torch.arange(200)), torch.tensor([0]), torch.arange(500))
        )
    ).flatten()
    assert abs(float(uniform.mean()) - 0.5) < 0.01 and abs(float(uniform.var()) - 1 / 12) < 0.005


def test_sampling_with_several_beams_keeps_the_step_by_step_loop():
    # (beam search with several beams decodes on the device too: tests/unit/test_device_beam_search.py)
    generator = sampler(beam=2)
    assert not device_decoding.applies(generator, 2)
    assert not device_decoding.applies(SequenceGenerator([build()], D, no_repeat_ngram_size=2), 1)


# ---- streaming -------------------------------------------------------------------------------------------


def test_streamed_tokens_grow_by_chunks_and_end_as_the_hypotheses():
    model = unigram_model(logits_with(w1=2.0, w2=1.0, eos=-30.0))
    generator = SequenceGenerator([model], D, max_len_b=40, device_loop=True)
    seen = []
    hypos = decode(generator, [[W[1]], [W[2], W[3]]], on_tokens=lambda t, done: seen.append((t.clone(), done)))
    # </s> and the shared first prompt token (fed at once), the token of that forward, then 16 per chunk, up to
    # the longest output (40 tokens and </s>)
    assert [t.size(1) for t, _ in seen] == [19, 35, 42]
    assert all(t.device.type == "cpu" for t, _ in seen)
    for earlier, later in zip(seen, seen[1:]):
        assert torch.equal(later[0][:, : earlier[0].size(1)], earlier[0])
    assert seen[-1][1].all() and not seen[0][1].any()
    for row, sentence in enumerate(hypos):
        assert seen[-1][0][row, 1:].tolist() == sentence[0]["tokens"].tolist()
    with pytest.raises(ValueError, match="streaming tokens .* needs greedy search or sampling with --beam 1"):
        decode(SequenceGenerator([model], D, beam_size=2), [[W[1]]], on_tokens=lambda t, d: None)
