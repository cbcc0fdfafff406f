"""The decode step compiled by inductor (fairseq.generation.compiled_step) on CUDA, inside the captured CUDA graphs:
greedy and beam search give the uncompiled graphs' tokens (fp32; bf16 to a near tie), a running engine's joining
rows too, one compile per row count (the split-KV kernel reads live lengths: the window is no shape), the prompts'
forward compiled once for prompts of several widths and row counts with the eager prefill's tokens, and fewer
kernels per decode step than the uncompiled step (torch.profiler, kernels replayed from the graphs included).
The CPU side (inductor's C++ backend, Triton's interpreter): tests/unit/test_decode_compiled_step.py."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.profiler import ProfilerActivity, profile

from fairseq.generation.compiled_step import CompiledPrefill
from fairseq.generation.engine import DecodeEngine, DecodeRequest
from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.modules.causal_attention import fuse_qkv_

from test_generation_gpu import build, dictionary

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def sample(d, rows, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, len(d), (rows, length), generator=g).cuda()
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((rows,), length).cuda()}}, src


def generate(model, d, rows, compile_step, beam=1, new=40):
    generator = SequenceGenerator(
        [model], d, beam_size=beam, max_len_b=24 + new, min_len=24 + new, compile_step=compile_step
    )
    batch, prompts = sample(d, rows)
    hypos = generator.generate([model], batch, prefix_tokens=prompts)
    return (
        generator,
        torch.stack([h[0]["tokens"] for h in hypos]),
        torch.stack([h[0]["positional_scores"] for h in hypos]),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_graphs_give_the_uncompiled_greedy_tokens(dtype):
    d = dictionary()
    model = build(d, "cuda", dtype)
    fuse_qkv_(model)  # as fairseq-generate loads a model
    for rows in (3, 1) if dtype == torch.float32 else (1,):  # row counts 4 and 1: one compile each
        _, want, want_scores = generate(model, d, rows, False)
        generator, got, got_scores = generate(model, d, rows, True)
        assert generator.step_model.graphed.capture and generator.step_model.graphed.graphs
        if dtype == torch.float32:
            assert torch.equal(got, want)
            torch.testing.assert_close(got_scores, want_scores, atol=1e-4, rtol=0)
        else:  # bf16: another rounding of the fused kernels may flip a near tie late in a row
            assert float((got == want).float().mean()) >= 0.9
            assert torch.equal(got[:, :32], want[:, :32])
    shapes = generator.step_model.compiled_step.shapes
    assert shapes == {(1, None)}, shapes  # the kernel's live lengths: no window in the compiled shapes


def test_compiled_beam_search_and_engine_give_the_uncompiled_tokens():
    d = dictionary()
    model = build(d, "cuda", torch.float32)
    _, want, _ = generate(model, d, 2, False, beam=4)
    _, got, _ = generate(model, d, 2, True, beam=4)
    assert torch.equal(got, want)

    def requests():
        torch.manual_seed(3)
        return [
            DecodeRequest(id=i, prompt=torch.randint(4, len(d), (5 + 7 * i,)), max_new_tokens=20 + 6 * i)
            for i in range(3)
        ]

    def run(engine):
        out, chunk, batch = {}, 0, requests()
        joins = {0: batch[:2], 2: batch[2:]}
        while engine.has_work or chunk <= 2:
            for r in joins.get(chunk, ()):
                engine.add(r)
            for event in engine.step(8):
                out[event.id] = out.get(event.id, []) + event.tokens
            chunk += 1
        return out

    engine = DecodeEngine(model, d, max_rows=4, compile_step=True)
    assert run(engine) == run(DecodeEngine(model, d, max_rows=4))
    assert {rows for rows, _ in engine.step_model.compiled_step.shapes} <= {1, 2, 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_prefill_gives_the_eager_prefill_tokens_with_one_compile(dtype):
    # Prompts of 3 widths and 2 row counts over caches of one size: the rows and the length are dynamic
    # dimensions of the compiled forward (one row would be a second compile). Scores: the compiled kernels and
    # the padding (attention reduces over more, masked, keys) round differently from the eager prefill. The
    # step stays uncompiled (one compile in this test).
    d = dictionary()
    model = build(d, "cuda", dtype)
    fuse_qkv_(model)
    options = dict(max_len_a=0, max_len_b=72, min_len=72)  # one cache size for every call
    eager = SequenceGenerator([model], d, compile_step=False, **options)
    generator = SequenceGenerator([model], d, compile_step=False, **options)
    counter = CompileCounterWithBackend("inductor")
    step_model = generator.step_model
    step_model.compiled_prefill = CompiledPrefill(step_model.model, d.pad(), backend=counter)
    for rows, length in ((3, 40), (2, 24), (3, 9), (2, 70)):
        batch, prompts = sample(d, rows, length=length, seed=length)
        want = eager.generate([model], batch, prefix_tokens=prompts)
        got = generator.generate([model], batch, prefix_tokens=prompts)
        for a, b in zip(got, want):
            if dtype == torch.float32:
                assert torch.equal(a[0]["tokens"], b[0]["tokens"]), (rows, length)
            else:  # bf16: the first new tokens (a near tie may flip later)
                assert torch.equal(a[0]["tokens"][: length + 4], b[0]["tokens"][: length + 4]), (rows, length)
            # the prompt's scores (bf16: log-probabilities of magnitude ~5 rounded to 8 bits, then fused otherwise)
            atol = 1e-4 if dtype == torch.float32 else 0.25
            torch.testing.assert_close(
                a[0]["positional_scores"][:length], b[0]["positional_scores"][:length], atol=atol, rtol=0
            )
    assert step_model.compiled_prefill.shapes == {(3, 64), (2, 64), (2, 128)}  # the begin token, then the prompt
    assert counter.frame_count == 1, counter.frame_count


def kernels_per_step(model, d, compile_step, new=33):
    counts = []
    for tokens in (1, new):
        generator = SequenceGenerator([model], d, max_len_b=24 + tokens, min_len=24 + tokens, compile_step=compile_step)
        batch, prompts = sample(d, 1)
        generator.generate([model], batch, prefix_tokens=prompts)  # warm-up: compiles and captures
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generator.generate([model], batch, prefix_tokens=prompts)
            torch.cuda.synchronize()
        counts.append(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))
    return (counts[1] - counts[0]) / (new - 1)


def test_the_compiled_step_launches_fewer_kernels():
    d = dictionary()
    model = build(d, "cuda", torch.bfloat16)
    fuse_qkv_(model)
    eager, compiled = kernels_per_step(model, d, False), kernels_per_step(model, d, True)
    print(f"kernels per decode step (3 layers): {eager:.1f} uncompiled, {compiled:.1f} compiled")
    assert compiled < 0.8 * eager
