"""The prompts' forward compiled (fairseq.generation.compiled_step.CompiledPrefill), lengths padded to a multiple of
64 and dynamic, like the rows: one compile for every prompt width (two with one row and several), greedy and beam tokens equal to the eager prefill's with the
forced and positional scores to a tolerance (padding lengthens SDPA's reduction over masked keys: not bitwise on
the CPU, measured <= 2e-6), rows joining an engine in groups, a failed compile said once. A counting backend runs the
traced graphs with eager ops (fast); inductor itself compiles the prefill in tests/unit/test_decode_compiled_step.py
and, on CUDA, tests/gpu/test_decode_compiled_gpu.py."""

import logging

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from fairseq.generation.compiled_step import CompiledPrefill, prefill_length
from fairseq.generation.engine import DecodeEngine
from fairseq.generation.quantize import quantizable_linears, quantize_linears_
from test_decode_engine import PROMPTS, request, run
from test_int8_matmul import markov_model
from test_sequence_generator import ATOL, D, PAD, W, EagerStaticGenerator, assert_same_hypotheses, build, sample_of

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prefill_lengths():
    assert [prefill_length(n, 2048) for n in (1, 64, 65, 128, 129, 513, 2000)] == [64, 64, 128, 128, 192, 576, 2048]
    assert prefill_length(40, 48) == 48 and prefill_length(300, 320) == 320  # the capacity or positions cap it


def compiling(generator):
    """`generator` with its prefill compiled by a counting backend (and its step uncompiled)."""
    counter = CompileCounter()
    step_model = generator.step_model
    step_model.compiled_prefill = CompiledPrefill(step_model.model, PAD, backend=counter)
    return step_model.compiled_prefill, counter


@pytest.mark.parametrize("beam", [1, 2])
def test_prompts_of_every_width_compile_the_prefill_once(beam):
    model = build(seed=4)
    options = dict(beam_size=beam, max_len_b=12, min_len=12)
    expected = EagerStaticGenerator([model], D, **options)  # the eager prefill, unpadded
    generator = EagerStaticGenerator([model], D, **options)
    prefill, counter = compiling(generator)
    for sentences in (5, 3, 2):  # the most first: the caches it reserves are kept for the others
        for width in range(2, 9):
            prompts = [W[:width], W[8 - width :][::-1], W[1:width], [W[width - 1]] * width, W[::2]][:sentences]
            sample, prefix = sample_of(prompts)
            want = expected.generate(None, sample, prefix_tokens=prefix)
            assert_same_hypotheses(generator.generate(None, sample, prefix_tokens=prefix), want)  # scores to ATOL
    assert prefill.shapes == {(5, 64), (3, 64), (2, 64)}  # padded to 64 positions (the model's)
    assert counter.frame_count == 1  # the rows and the length are dynamic dimensions


def test_prompt_lengths_compile_once_for_caches_of_one_size():
    model = build(seed=4, max_target_positions=600)
    options = dict(max_len_a=1, max_len_b=4, min_len=4)  # outputs of the prompt and 4 tokens
    expected = EagerStaticGenerator([model], D, **options)
    generator = EagerStaticGenerator([model], D, **options)
    prefill, counter = compiling(generator)
    g = torch.Generator().manual_seed(0)
    for width in (300, 290, 70, 50, 10):  # the longest first: the caches it reserves are kept for the others
        prompt = torch.randint(D.nspecial, len(D), (width,), generator=g).tolist()
        sample, prefix = sample_of([prompt])
        want = expected.generate(None, sample, prefix_tokens=prefix)
        assert_same_hypotheses(generator.generate(None, sample, prefix_tokens=prefix), want)
    # the begin token and 300 or 290 tokens: 320 (the caches' capacity); 70: 128; 50, 10: 64. The length is a
    # dynamic dimension: one compile
    assert prefill.shapes == {(1, 320), (1, 128), (1, 64)} and counter.frame_count == 1


def test_rows_joining_an_engine_with_a_compiled_prefill_get_their_eager_tokens():
    model = build(seed=4, max_target_positions=256)

    def joins():
        return {
            0: [request(i, PROMPTS[i], max_new_tokens=6 + 2 * i, logprobs=True) for i in range(4)],
            2: [request(9, PROMPTS[4], max_new_tokens=5, logprobs=True, temperature=0.8, seed=3)],
        }

    expected, _ = run(DecodeEngine(model, D, max_rows=4), joins())
    engine = DecodeEngine(model, D, max_rows=4)
    prefill, counter = compiling(engine)
    got, _ = run(engine, joins())
    assert set(got) == set(expected)
    for i in expected:
        assert got[i][0] == expected[i][0] and got[i][2] == expected[i][2], i
        torch.testing.assert_close(torch.tensor(got[i][1]), torch.tensor(expected[i][1]), atol=ATOL, rtol=0)
    # three prompts at once (the empty one has nothing to prefill: 3 x 64 <= the 256 positions), one forward,
    # written to the running caches' rows; the one joining later alone: a second compile (one row), the last
    assert prefill.shapes == {(3, 64), (1, 64)} and counter.frame_count == 2


def test_a_failed_prefill_compile_prefills_eagerly_with_one_warning(caplog):
    model = build(seed=4)

    def broken(graph, example_inputs):
        raise RuntimeError("no compiler here")

    sample, prefix = sample_of([W[:3], W[2:4]])
    want = EagerStaticGenerator([model], D, max_len_b=8).generate(None, sample, prefix_tokens=prefix)
    generator = EagerStaticGenerator([model], D, max_len_b=8)
    generator.step_model.compiled_prefill = prefill = CompiledPrefill(generator.step_model.model, PAD, backend=broken)
    with caplog.at_level(logging.WARNING, logger="fairseq.generation.compiled_step"):
        for _ in range(2):
            assert_same_hypotheses(generator.generate(None, sample, prefix_tokens=prefix), want)
    assert prefill.failed and not prefill.shapes
    warnings = [r.getMessage() for r in caplog.records if "compiling the prefill failed" in r.getMessage()]
    assert len(warnings) == 1 and "no compiler here" in warnings[0], warnings


def test_an_int8_models_prefill_compiles_once_whatever_its_token_count():
    """int8 Linears choose their kernel by row count (at most MAX_KERNEL_ROWS: the decode kernel): in the
    prefill the rows are the dynamic batch x length, and testing them there guarded the compile on
    rows x length <= 256, a second compile when a batch crossed it."""
    d, model = markov_model()  # positions 64: every prompt padded to 64; trained: clear greedy choices
    quantize_linears_(model, quantizable_linears(model))
    options = dict(beam_size=1, max_len_b=8, min_len=8)
    expected = EagerStaticGenerator([model], d, **options)
    generator = EagerStaticGenerator([model], d, **options)
    prefill, counter = compiling(generator)
    with torch.no_grad():
        for rows in (8, 2, 5, 3):  # 512, 128, 320 and 192 prompt tokens
            prompts = torch.randint(d.nspecial, len(d), (rows, 5), generator=torch.Generator().manual_seed(rows))
            sample = {"net_input": {"src_tokens": prompts, "src_lengths": torch.full((rows,), 5)}}
            want = expected.generate([model], sample, prefix_tokens=prompts)
            got = generator.generate([model], sample, prefix_tokens=prompts)
            assert [h[0]["tokens"].tolist() for h in got] == [h[0]["tokens"].tolist() for h in want]
    assert prefill.shapes == {(8, 64), (2, 64), (5, 64), (3, 64)} and counter.frame_count == 1
