"""The decode step compiled by inductor (fairseq.generation.compiled_step) on CPU (inductor's C++ backend): greedy
tokens equal to the eager step loop's (the prompts' forward compiled too: tests/unit/test_decode_compiled_prefill.py),
rows joining a running engine get the tokens they get uncompiled, one compile per row count (whatever the prompt
widths) and no graph break, torch's recompile limit said once, the split-KV attention and int8 matmul kernels opaque ops of the
compiled graph (Triton's interpreter, in a subprocess), and the modes. On CUDA, inside the captured graphs: tests/gpu/test_decode_compiled_gpu.py.
Compiles take ~5-15 s each on the shared 2-core machine: each test compiles one or two shapes."""

import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from fairseq.generation import compiled_step
from fairseq.generation.compiled_step import CompiledStep, compile_mode
from fairseq.generation.engine import DecodeEngine
from fairseq.generation.sequence_generator import SequenceGenerator
from test_decode_engine import PROMPTS, request, run
from test_sequence_generator import D, W, EagerStaticGenerator, assert_same_hypotheses, build, sample_of

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler"
    ),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_compiled_greedy_equals_the_eager_step_by_step_loop():
    model = build(seed=4)
    prompts = [p or [D.index("w1")] for p in PROMPTS]  # 5 rows (8 rounded up), none ending early: one compile
    sample, prefix = sample_of(prompts)
    options = dict(max_len_b=20, min_len=20)
    expected = SequenceGenerator([model], D, device_loop=False, **options).generate(None, sample, prefix_tokens=prefix)
    generator = EagerStaticGenerator([model], D, compile_step=True, **options)
    got = generator.generate(None, sample, prefix_tokens=prefix)
    assert_same_hypotheses(got, expected)  # the same tokens; scores to ATOL
    assert generator.step_model.compiled_step.shapes == {(8, 64)}  # (rows, window): the capacity caps the window
    assert generator.step_model.compiled_prefill.shapes == {(5, 64)}  # (rows, length): 5 prompts, padded


def test_prompts_of_every_width_compile_the_step_once():
    # The step reads no plain-int length (it did: one compile per prompt width); greedy and beam search, both
    # loops. The counting backend runs the traced graph with the same ops: bitwise the uncompiled step's.
    model = build(seed=4)
    for options in (dict(), dict(device_loop=False), dict(beam_size=2)):
        expected = EagerStaticGenerator([model], D, max_len_b=12, min_len=12, **options)
        generator = EagerStaticGenerator([model], D, max_len_b=12, min_len=12, **options)
        counter = CompileCounter()
        step_model = generator.step_model
        step_model.compiled_step = CompiledStep(step_model._static_step, step_model.model, backend=counter)
        for width in range(2, 9):
            sample, prefix = sample_of([W[:width]])
            want = expected.generate(None, sample, prefix_tokens=prefix)[0]
            got = generator.generate(None, sample, prefix_tokens=prefix)[0]
            assert [h["tokens"].tolist() for h in got] == [h["tokens"].tolist() for h in want], (options, width)
            assert all(torch.equal(a["positional_scores"], b["positional_scores"]) for a, b in zip(got, want))
        assert counter.frame_count == 1, options


def test_the_recompile_limit_is_said_once_and_decoding_goes_on(monkeypatch, caplog):
    torch._dynamo.reset()  # the limit counts every compile of the step in the process
    monkeypatch.setattr(compiled_step, "RECOMPILE_LIMIT", 1)
    model = build(seed=4)
    joins = {0: [request(0, PROMPTS[0], max_new_tokens=12)], 1: [request(1, PROMPTS[2], max_new_tokens=6)]}
    expected, _ = run(DecodeEngine(model, D, max_rows=2), joins)
    engine = DecodeEngine(model, D, max_rows=2)
    step_model = engine.step_model
    step_model.compiled_step = CompiledStep(step_model._static_step, step_model.model, backend=CompileCounter())
    with caplog.at_level(logging.WARNING, logger="fairseq.generation.compiled_step"):
        got, _ = run(engine, joins)  # rows 1, then 2: a second compile, past the limit
    assert got == expected and step_model.compiled_step.failed and step_model.compiled_step.shapes == {(1, 64)}
    warnings = [r.getMessage() for r in caplog.records if "recompile limit" in r.getMessage()]
    assert warnings == [
        "the compiled decode step reached torch.compile's recompile limit (1 compiles of it in this process, "
        "generators and engines together); this generator runs it uncompiled from now on"
    ]


def test_rows_joining_a_compiled_engine_get_their_uncompiled_tokens():
    model = build(seed=4)

    def joins():
        return {
            0: [request(0, PROMPTS[0], max_new_tokens=14, logprobs=True)],
            2: [request(1, PROMPTS[2], max_new_tokens=9, logprobs=True, temperature=0.8, seed=3)],
        }

    expected, _ = run(DecodeEngine(model, D, max_rows=2), joins())
    engine = DecodeEngine(model, D, max_rows=2, compile_step=True)
    got, _ = run(engine, joins())
    for i in expected:
        assert got[i][0] == expected[i][0], i
        torch.testing.assert_close(torch.tensor(got[i][1]), torch.tensor(expected[i][1]), atol=1e-5, rtol=0)
        assert got[i][2] == expected[i][2]
    assert engine.step_model.compiled_step.shapes == {(1, 64), (2, 64)}  # rows 1, then 2 when the second joined
    assert engine.step_model.compiled_prefill.shapes == {(1, 64)}  # each joined alone, padded to 64 positions


def test_one_compile_per_row_count_and_no_graph_break():
    model = build(seed=4)
    engine = DecodeEngine(model, D, max_rows=8)
    counter = CompileCounter()  # counts the graphs dynamo makes: a graph break would make two per shape
    step_model = engine.step_model
    step_model.compiled_step = CompiledStep(step_model._static_step, step_model.model, backend=counter)
    joins = {0: [request(i, PROMPTS[i], max_new_tokens=6 + 5 * i) for i in range(3)], 2: [request(9, PROMPTS[3])]}
    run(engine, joins, max_steps=3)
    rows = {r for r, _ in step_model.compiled_step.shapes}
    assert rows == {4, 2, 1}  # 3 rows (rounded up: 4), rows leaving: 2, 1; the join at chunk 2 fits in 4
    assert counter.frame_count == len(step_model.compiled_step.shapes) == 3


def test_a_failed_compile_decodes_on_uncompiled_with_one_warning(caplog):
    model = build(seed=4)

    def broken(graph, example_inputs):
        raise RuntimeError("no compiler here")

    def joins():
        return {0: [request(i, PROMPTS[i], max_new_tokens=8) for i in range(2)]}

    expected, _ = run(DecodeEngine(model, D, max_rows=2), joins())
    engine = DecodeEngine(model, D, max_rows=2)
    step_model = engine.step_model
    step_model.compiled_step = CompiledStep(step_model._static_step, step_model.model, backend=broken)
    with caplog.at_level(logging.WARNING, logger="fairseq.generation.compiled_step"):
        got, _ = run(engine, joins())
    assert got == expected and step_model.compiled_step.failed and not step_model.compiled_step.shapes
    warnings = [r.getMessage() for r in caplog.records if "compiling the decode step failed" in r.getMessage()]
    assert len(warnings) == 1 and "no compiler here" in warnings[0], warnings


def test_an_error_of_the_run_at_a_new_shape_is_raised_and_leaves_the_compile_on():
    """Only torch.compile's own failures turn compiling off: an error the function itself raises (a prompt that
    does not fit the caches, an out-of-memory) reaches the caller, and the next call is compiled again."""

    def doubled_when_it_fits(x, n):
        if n > 3:
            raise ValueError("does not fit the caches")
        return x * 2

    compiled = compiled_step._Compiled(doubled_when_it_fits, "test function", "default", CompileCounter())
    assert torch.equal(compiled._run((1,), torch.ones(2), 1), torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="does not fit the caches"):
        compiled._run((2,), torch.ones(3), 5)
    assert not compiled.failed and torch.equal(compiled._run((2,), torch.ones(3), 2), torch.full((3,), 2.0))


KERNEL_AS_ONE_OP = """
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend
    from fairseq.generation.compiled_step import CompiledStep
    from fairseq.generation.engine import DecodeEngine
    from test_decode_engine import PROMPTS, request, run
    from test_sequence_generator import D, build

    torch.set_num_threads(1)
    model = build(seed=4)
    joins = lambda: {0: [request(i, PROMPTS[i], max_new_tokens=10, logprobs=True) for i in range(2)]}
    expected, _ = run(DecodeEngine(model, D, max_rows=2), joins())  # the kernels, uncompiled
    engine = DecodeEngine(model, D, max_rows=2)
    counter = CompileCounterWithBackend("inductor")
    step_model = engine.step_model
    step_model.compiled_step = CompiledStep(step_model._static_step, step_model.model, backend=counter)
    got, _ = run(engine, joins())
    for i in expected:
        assert got[i][0] == expected[i][0], i
        torch.testing.assert_close(torch.tensor(got[i][1]), torch.tensor(expected[i][1]), atol=1e-5, rtol=0)
    # the live lengths go to the kernel: the window is no shape, one compile per row count
    assert step_model.compiled_step.shapes == {(2, None), (1, None)}, step_model.compiled_step.shapes
    assert counter.frame_count == 2
    op = torch.ops.fairseq.decode_attention.default
    for graph in counter.graphs:  # one opaque call per layer, not the kernel traced
        calls = [n for n in graph.graph.nodes if n.op == "call_function" and n.target in (op, op.overloadpacket)]
        assert len(calls) == 2, graph.graph
    # the int8 matmul kernel too (an int8 model's Linears), its values those of the kernel called eagerly
    from fairseq.kernels.int8_matmul import int8_linear, int8_matmul_kernel

    x, bias = torch.randn(3, 64).bfloat16(), torch.randn(48).bfloat16()
    qweight, scale = torch.randint(-127, 128, (48, 64), dtype=torch.int8), torch.rand(48) / 100
    counter = CompileCounterWithBackend("inductor")
    linear = torch.compile(lambda x: int8_linear(x, qweight, scale, bias) * 2, backend=counter, fullgraph=True)
    assert torch.equal(linear(x), int8_matmul_kernel(x, qweight, scale, bias) * 2)
    op = torch.ops.fairseq.int8_matmul.default
    assert [n.target for n in counter.graphs[0].graph.nodes if n.op == "call_function"][0] in (op, op.overloadpacket)
    print("compiled kernel ok")
"""


def test_the_triton_kernels_are_opaque_ops_of_the_compiled_step():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "unit"), env.get("PYTHONPATH", "")])
    env.pop("FAIRSEQ_DECODE_ATTENTION_KERNEL", None)
    script = textwrap.dedent(KERNEL_AS_ONE_OP)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0 and "compiled kernel ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_modes():
    assert [compile_mode(v) for v in (None, False, "", "0")] == [None] * 4
    assert [compile_mode(v) for v in (True, "1", "default")] == ["default"] * 3
    assert compile_mode("max-autotune") == compile_mode("max-autotune-no-cudagraphs") == "max-autotune-no-cudagraphs"
    with pytest.raises(ValueError, match="'reduce-overhead' is not a mode; use 0"):
        compile_mode("reduce-overhead")
    previous = compiled_step.set_compile_decode_step(True)
    try:
        assert SequenceGenerator([build()], D).step_model.compiled_step.mode == "default"
        assert SequenceGenerator([build()], D, compile_step=False).step_model.compiled_step is None
        autotuned = SequenceGenerator([build()], D, compile_step="max-autotune").step_model
        assert (autotuned.compiled_step.mode, autotuned.compiled_prefill.mode) == (
            "max-autotune-no-cudagraphs",
            "default",
        )
    finally:
        compiled_step.set_compile_decode_step(previous)
    step_model = SequenceGenerator([build()], D).step_model
    assert step_model.compiled_step is None and step_model.compiled_prefill is None  # off by default
