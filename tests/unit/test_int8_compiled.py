"""FAIRSEQ_INT8_MATMUL=inductor on CPU (inductor's C++ backend): int8_linear compiled as tensor code inductor fuses
(fairseq.kernels.int8_matmul.inductor_int8_linear) against the fp32 product of the same int8 values, and greedy
decoding of a small quantized model with the compiled step against the eager int8 model. The Triton path inside a
compiled step: tests/unit/test_decode_compiled_step.py. Compiles take ~5-15 s each on the shared machine."""

import shutil

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from fairseq.generation.quantize import quantizable_linears, quantize_linears_
from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.kernels.int8_matmul import int8_linear, set_int8_matmul
from test_int8_matmul import markov_model
from test_sequence_generator import EagerStaticGenerator

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler"
    ),
]


@pytest.fixture
def inductor_path():
    previous = set_int8_matmul("inductor")
    torch._dynamo.reset()
    yield
    set_int8_matmul(previous)
    torch._dynamo.reset()


def test_the_inductor_form_compiled_matches_the_fp32_product(inductor_path):
    torch.manual_seed(0)
    qweight = torch.randint(-127, 128, (40, 72), dtype=torch.int8)  # K 72: torch's CPU int8 op would take it
    scale, bias = torch.rand(40) / 100, torch.randn(40).to(torch.bfloat16)
    counter = CompileCounterWithBackend("inductor")
    linear = torch.compile(lambda x: int8_linear(x, qweight, scale, bias), backend=counter, fullgraph=True)
    for rows in (1, 3):
        x = torch.randn(rows, 72).to(torch.bfloat16)
        got = linear(x).float()
        product = x.float() @ qweight.float().t() * scale
        want = product + bias.float()
        assert got.shape == (rows, 40)
        error = (got - want).abs()
        if rows == 1:  # exact products summed in fp32, scaled, biased, one rounding to bf16: half an ulp, 2**-8
            assert (error <= 2**-8 * want.abs() + 1e-5).all(), error.max()
        else:  # F.linear in bf16 (the product rounded before the bias), then the bias and a second rounding
            assert (error <= 2**-8 * (product.abs() + want.abs()) + 1e-5).all(), error.max()
    assert counter.frame_count == 2  # one compile per row count
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert not any("int8pack" in t or "int8_matmul" in t for t in targets), targets  # the tensor code, traced


@torch.no_grad()
def test_compiled_int8_greedy_tokens_equal_the_eager_int8_ones(inductor_path):
    d, model = markov_model()
    quantize_linears_(model, quantizable_linears(model))
    prompts = torch.randint(d.nspecial, len(d), (8, 4), generator=torch.Generator().manual_seed(1))
    sample = {"net_input": {"src_tokens": prompts, "src_lengths": torch.full((8,), 4)}}
    options = dict(beam_size=1, max_len_b=16, min_len=16)

    def greedy(generator):
        return torch.stack([h[0]["tokens"][4:16] for h in generator.generate([model], sample, prefix_tokens=prompts)])

    eager = greedy(SequenceGenerator([model], d, device_loop=False, **options))  # torch's CPU int8 op
    generator = EagerStaticGenerator([model], d, compile_step=True, **options)
    compiled = greedy(generator)
    assert generator.step_model.compiled_step.shapes == {(8, 64)} and not generator.step_model.compiled_step.failed
    assert torch.equal(compiled, eager)  # 8 x 12 tokens: a clear greedy choice, so int8's rounding does not flip it
