"""The decode engine (fairseq.generation.engine) on tiny real models, on CPU: rows that join a running batch
between chunks get the tokens they get alone (greedy and seeded sampling: the same tokens; log-probabilities to
~1e-7), greedy equals SequenceGenerator's, cancel frees a row, rows of different lengths finish at their own
steps with their own reasons, log-probabilities and top-N are the model's, prompt scoring, bad requests."""

import math

import pytest
import torch

from fairseq.generation import decode_memory, sampling
from fairseq.generation.engine import DecodeEngine, DecodeRequest, score_prompt
from fairseq.generation.sequence_generator import SequenceGenerator
from test_sequence_generator import ATOL, D, EOS, PAD, W, build, full_log_probs, sample_of

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[W[1], W[2]], [W[3]], [W[4], W[5], W[6], W[7]], [], [W[2]] * 5]


def request(i, prompt, **options):
    return DecodeRequest(id=i, prompt=torch.tensor(prompt, dtype=torch.long), **options)


def run(engine, joins, max_steps=4):
    """Decode until nothing is left; `joins` maps a chunk number to the requests added before it. Returns
    {id: (tokens, logprobs, finish_reason)} and the number of chunks."""
    out, chunk = {}, 0
    while engine.has_work or chunk <= max(joins):
        for r in joins.get(chunk, ()):
            engine.add(r)
        for event in engine.step(max_steps):
            tokens, lprobs, _ = out.get(event.id, ([], [], None))
            out[event.id] = (tokens + event.tokens, lprobs + (event.logprobs or []), event.finish_reason)
        chunk += 1
    return out, chunk


def alone(model, req, **engine_options):
    return run(DecodeEngine(model, D, max_rows=1, **engine_options), {0: [req]})[0][req.id]


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(temperature=0.9, seed=5),
        dict(temperature=1.3, top_k=3, seed=1),
        dict(temperature=0.7, top_p=0.6, seed=2),
    ],
)
def test_rows_joining_mid_decode_get_the_tokens_they_get_alone(options):
    model = build(seed=4)
    make = [lambda i, p=p: request(i, p, max_new_tokens=18 + 3 * i, logprobs=True, **options) for p in PROMPTS]
    expected = {i: alone(model, make[i](i)) for i in range(len(PROMPTS))}
    # joins at chunk 0, 1 (mid-decode), 3, and 5 (after some rows left)
    joins = {0: [make[0](0), make[1](1)], 1: [make[2](2)], 3: [make[3](3)], 5: [make[4](4)]}
    got, _ = run(DecodeEngine(model, D, max_rows=4), joins)
    for i in expected:  # the same tokens; log-probabilities ~1e-7 apart (matrix products at other batch sizes)
        assert got[i][0] == expected[i][0], i
        torch.testing.assert_close(torch.tensor(got[i][1]), torch.tensor(expected[i][1]), atol=1e-5, rtol=0)
        assert got[i][2] == expected[i][2]
    assert len({len(v[0]) for v in got.values()}) > 1  # they ended at different steps


def test_rows_joining_at_one_boundary_are_prefilled_in_one_forward():
    model = build(seed=4)
    fed = []
    hook = model.decoder.register_forward_pre_hook(lambda module, args: fed.append(args[0].tolist()))
    engine = DecodeEngine(model, D, max_rows=4)
    for i, prompt in enumerate(PROMPTS[:4]):  # 2, 1, 4 and 0 tokens
        engine.add(request(i, prompt, max_new_tokens=3))
    engine.step(1)
    hook.remove()
    # one forward: each non-empty prompt's begin token and all but its last token, right-padded
    assert fed == [[[EOS, W[1], PAD, PAD], [EOS, PAD, PAD, PAD], [EOS, W[4], W[5], W[6]]]]


def test_a_joining_group_is_prefilled_in_forwards_no_larger_than_the_models_positions():
    # the prefill's temporary caches: at most one full-length prompt's (the decode memory check's headroom)
    model = build(seed=4)
    fed = []
    hook = model.decoder.register_forward_pre_hook(lambda module, args: fed.append(args[0].tolist()))
    engine = DecodeEngine(model, D, max_rows=4, max_positions=8)
    for i, prompt in enumerate(PROMPTS[:4]):  # 2, 1, 4 and 0 tokens: 3 x 4 padded tokens would exceed 8
        engine.add(request(i, prompt, max_new_tokens=3))
    engine.step(1)
    hook.remove()
    assert fed == [[[EOS, W[1]], [EOS, PAD]], [[EOS, W[4], W[5], W[6]]]]


def test_greedy_equals_the_generators_greedy_search():
    model = build(seed=4)
    generator = SequenceGenerator([model], D, max_len_b=24, device_loop=False)
    engine = DecodeEngine(model, D, max_rows=8)
    got, _ = run(
        engine,
        {0: [request(i, p, max_new_tokens=24 - len(p), logprobs=True) for i, p in enumerate(PROMPTS)]},
        max_steps=16,
    )
    for i, prompt in enumerate(PROMPTS):
        sample, prefix = sample_of([prompt]) if prompt else sample_of([[W[1]]])
        if not prompt:
            sample["net_input"]["src_tokens"] = sample["net_input"]["src_tokens"][:, :1]
            prefix = None
        hypo = generator.generate([model], sample, prefix_tokens=prefix)[0][0]
        new = hypo["tokens"][len(prompt) :].tolist()
        tokens, lprobs, reason = got[i]
        if new[-1] == EOS and reason == "stop":
            new = new[:-1]
        assert tokens == new[: len(tokens)] and len(tokens) >= len(new) - 1, i
        torch.testing.assert_close(
            torch.tensor(lprobs[: len(new)]), hypo["positional_scores"][len(prompt) :][: len(lprobs)], atol=ATOL, rtol=0
        )


def test_logprobs_and_top_n_are_the_models():
    model = build(seed=2)
    engine = DecodeEngine(model, D, max_rows=2)
    engine.add(request("a", [W[1], W[2]], max_new_tokens=6, temperature=1.0, seed=3, top_logprobs=3))
    events = []
    while engine.has_work:
        events += engine.step(4)
    tokens = sum((e.tokens for e in events), [])
    lprobs = sum((e.logprobs for e in events), [])
    tops = sum((e.top_logprobs for e in events), [])
    seq = [EOS, W[1], W[2]]
    for token, lp, top in zip(tokens, lprobs, tops):
        reference = full_log_probs(model, seq)
        reference[PAD] = -math.inf
        assert lp == pytest.approx(float(reference[token]), abs=1e-5)
        values, ids = reference.topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)
        seq.append(token)
    assert len(tokens) == 6 or events[-1].finish_reason == "stop"


def test_seeded_sampling_depends_on_seed_and_sample_index_only():
    model = build(seed=3)
    options = dict(max_new_tokens=20, temperature=1.5)
    first = alone(model, request(0, [W[1]], seed=7, **options))[0]
    assert alone(model, request(9, [W[1]], seed=7, **options))[0] == first  # the id does not matter
    assert alone(model, request(0, [W[1]], seed=8, **options))[0] != first
    assert alone(model, request(0, [W[1]], seed=7, sample_index=1, **options))[0] != first
    # top_k=1 and a tiny top_p leave one token: the greedy one
    greedy = alone(model, request(0, [W[1]], max_new_tokens=20))[0]
    assert alone(model, request(0, [W[1]], seed=7, top_k=1, **options))[0] == greedy
    assert alone(model, request(0, [W[1]], seed=7, top_p=1e-6, **options))[0] == greedy


def test_cancel_frees_the_row_for_the_queue():
    model = build(seed=4)
    engine = DecodeEngine(model, D, max_rows=1)
    engine.add(request("long", [W[1]], max_new_tokens=40, stop=[]))
    engine.add(request("next", [W[3]], max_new_tokens=5, stop=[]))
    assert [e.id for e in engine.step(4)] == ["long"]
    assert (engine.live_rows, engine.queued_rows) == (1, 1)
    assert engine.kv_tokens_in_use == (1 + 40) + (1 + 5)
    assert engine.kv_capacity_tokens == 64 and engine.kv_bytes_per_token == 2 * 2 * 16 * 4  # layers x K,V x dim x fp32
    assert decode_memory.kv_positions_that_fit([model], torch.device("cpu")) is None
    assert engine.cancel("long") and not engine.cancel("long")
    assert engine.live_rows == 0
    events = engine.step(8)
    assert [e.id for e in events] == ["next"] and events[0].finished and events[0].finish_reason == "length"
    assert events[0].tokens == alone(model, request("next", [W[3]], max_new_tokens=5, stop=[]))[0]
    assert not engine.has_work and engine.step(4) == []
    engine.add(request("queued", [W[3]], max_new_tokens=5))
    assert engine.cancel("queued") and not engine.has_work


def test_long_and_short_rows_finish_at_their_own_steps():
    model = build(seed=4)
    engine = DecodeEngine(model, D, max_rows=3)
    engine.add(request("short", [W[1]], max_new_tokens=3, stop=[]))
    engine.add(request("long", [W[1]], max_new_tokens=30, stop=[]))
    engine.add(request("eos", [W[1], W[2]], max_new_tokens=30))
    finished = {}
    for chunk in range(20):
        for e in engine.step(4):
            if e.finished:
                finished[e.id] = (chunk, e.finish_reason)
        if not engine.has_work:
            break
    assert finished["short"] == (0, "length") and finished["long"] == (7, "length")
    assert finished["eos"][1] == "stop" and finished["eos"][0] < 7
    # min_new_tokens keeps the stop id out until then
    tokens, _, reason = alone(model, request("min", [W[1], W[2]], max_new_tokens=30, min_new_tokens=25))
    assert len(tokens) >= 25 and EOS not in tokens


def test_prompt_scores_are_the_full_forwards():
    model = build(seed=1)
    prompt = [W[3], W[1], W[4]]
    scores = DecodeEngine(model, D, max_rows=1).score(torch.tensor(prompt))
    seq = [EOS]
    for token, score in zip(prompt, scores.tolist()):
        assert score == pytest.approx(float(full_log_probs(model, seq)[token]), abs=1e-5)
        seq.append(token)
    torch.testing.assert_close(score_prompt([model], D, torch.tensor(prompt)), scores)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be at least 1"),
        (dict(min_new_tokens=9, max_new_tokens=4), "min_new_tokens must be in 0 .. max_new_tokens"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_k=-2), "top_k must be >= 0"),
        (dict(top_logprobs=21), "top_logprobs must be in 0 .. 20"),
        (dict(max_new_tokens=70), "a prompt of 2 tokens and max_new_tokens 70 need 72 positions"),
        (dict(stop=[999]), "stop ids must be in"),
    ],
)
def test_bad_requests_are_one_line(options, message):
    engine = DecodeEngine(build(), D, max_rows=1)
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        engine.add(request(0, [W[1], W[2]], **options))
    with pytest.raises(ValueError, match="prompt holds ids outside"):
        engine.add(request(0, [len(D) + 3]))
    engine.add(request(0, [W[1]]))
    with pytest.raises(ValueError, match="^a request with id 0 is already in the engine"):
        engine.add(request(0, [W[2]]))


def test_per_row_filter_equals_the_scalar_filters():
    lprobs = torch.log_softmax(torch.randn(3, 40, generator=torch.Generator().manual_seed(0)), dim=1)
    for k, p in ((5, 0.0), (0, 0.7), (0, 0.0)):
        candidates, ids = sampling.top_k_top_p(lprobs, k, p)
        per_row, per_ids = sampling.top_k_top_p(lprobs, torch.full((3,), k), torch.full((3,), p))
        kept = {
            (r, int(ids[r, j]) if ids is not None else j)
            for r in range(3)
            for j in range(candidates.size(1))
            if candidates[r, j] > -math.inf
        }
        kept_per_row = {(r, int(per_ids[r, j])) for r in range(3) for j in range(40) if per_row[r, j] > -math.inf}
        assert kept == kept_per_row, (k, p)


@torch.no_grad()
def test_a_static_step_with_a_slot_per_row_is_each_rows_own_step():
    """The decoder's static step at slots [rows, 1] (rows at different lengths) gives each row the logits of a
    full forward over its own prefix, with caches filled by copy_incremental_rows from states of their own."""
    model = build(seed=5).decoder
    prefixes = [[EOS, W[1], W[2], W[3]], [EOS, W[4]], [EOS, W[5], W[6], W[7], W[1], W[2], W[3]]]
    state = {}
    model.reserve_incremental_state(state, max_length=16, max_batch=3)
    for row, prefix in enumerate(prefixes):
        own = {}
        model.reserve_incremental_state(own, max_length=len(prefix), max_batch=1)
        model(torch.tensor([prefix[:-1]]), incremental_state=own, features_only=True)
        model.copy_incremental_rows(state, own, torch.tensor([row]), len(prefix) - 1)
    last = torch.tensor([[p[-1]] for p in prefixes])
    slots = torch.tensor([[len(p) - 1] for p in prefixes])
    logits = model.forward_static_step(last, slots, state, window=8)[:, 0]
    for row, prefix in enumerate(prefixes):
        expected = model(torch.tensor([prefix]))[0][0, -1]
        torch.testing.assert_close(logits[row], expected, atol=1e-5, rtol=0)


ENGINE_KERNEL = """
    import sys
    import torch
    sys.path.insert(0, "tests/unit")
    import test_sequence_generator as t
    from fairseq.generation.engine import DecodeEngine, DecodeRequest
    from fairseq.kernels.decode_attention import set_decode_attention_kernel

    model = t.build(seed=4)
    results = []
    for kernel in (True, False):
        set_decode_attention_kernel(kernel)
        step = model.decoder._static_step_attention(torch.zeros(2, 1, 16), torch.tensor([[3], [5]]), 64)
        assert (step.mask is None) == kernel and (not kernel or step.lengths.tolist() == [4, 6])
        engine, tokens = DecodeEngine(model, t.D, max_rows=3), {}
        for i, prompt in enumerate([[t.W[1], t.W[2]], [t.W[3]], [t.W[4]] * 5]):  # joins at other lengths
            engine.add(DecodeRequest(id=i, prompt=torch.tensor(prompt), max_new_tokens=6, stop=[]))
            for event in engine.step(2):
                tokens.setdefault(event.id, []).extend(event.tokens)
        while engine.has_work:
            for event in engine.step(2):
                tokens.setdefault(event.id, []).extend(event.tokens)
        results.append(tokens)
    assert results[0] == results[1] and all(len(v) == 6 for v in results[0].values()), results
    print("engine kernel agrees")
"""


def test_rows_at_their_own_lengths_through_the_decode_attention_kernel():
    """The static step's per-row slots as per-row live lengths of the split-KV kernel (Triton's interpreter):
    the tokens the masked SDPA path gives."""
    from test_decode_attention import interpret

    interpret(ENGINE_KERNEL, "engine kernel agrees")
