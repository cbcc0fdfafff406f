"""Weight-only int8 (fairseq.kernels.int8_matmul, fairseq.generation.quantize.Int8WeightOnlyLinear): the Triton
kernel in Triton's interpreter on the CPU (TRITON_INTERPRET=1, in a subprocess) and the CPU paths
(torch._weight_int8pack_mm, the dequantized GEMM) against the fp32 product of the same int8 values; the
quantization itself; greedy decoding of a briefly trained model with int8 weights against bf16 on the CPU. The
CUDA run: tests/gpu/test_quantize_gpu.py."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from fairseq.data.dictionary import Dictionary
from fairseq.generation.quantize import Int8WeightOnlyLinear, quantizable_linears, quantize_linears_
from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.kernels.int8_matmul import int8_linear
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.usefixtures("one_thread")

INTERPRETED = textwrap.dedent("""
    import torch
    from fairseq.kernels import int8_matmul as im

    torch.manual_seed(0)
    # partial blocks in every dim: rows (16 / 32 / 64 a block), columns (32), the reduction (128)
    for rows, columns, depth in ((1, 48, 64), (5, 70, 200), (17, 33, 16), (64, 32, 128)):
        x = torch.randn(rows, depth).to(torch.bfloat16)
        qweight = torch.randint(-127, 128, (columns, depth), dtype=torch.int8)
        scale = torch.rand(columns) / 100
        bias = torch.randn(columns).to(torch.bfloat16)
        for b in (None, bias):
            got = im.int8_matmul_kernel(x, qweight, scale, b)
            want = x.float() @ qweight.float().t() * scale + (0 if b is None else b.float())
            assert got.dtype == torch.bfloat16 and got.shape == (rows, columns)
            torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-2)
    assert im.int8_kernel_available(x) and not im.int8_kernel_available(x.float())
    print("interpreted kernel agrees")
""")


def test_the_kernel_in_the_interpreter_matches_the_fp32_product():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "interpreted kernel agrees" in proc.stdout, proc.stdout + proc.stderr[-4000:]


@pytest.mark.parametrize(
    "depth, atol",
    [
        (64, 1e-2),  # torch._weight_int8pack_mm, the scales in bf16 (as the reference takes them)
        (50, 0.05),  # not a multiple of 16, where torch's CPU op is unsafe: the weight dequantized to bf16 (each value
        # rounded, 2**-9 of it) for one GEMM, outputs of order 5
    ],
)
def test_the_cpu_paths_match_the_fp32_product(depth, atol):
    torch.manual_seed(0)
    x = torch.randn(2, 3, depth).to(torch.bfloat16)
    qweight = torch.randint(-127, 128, (40, depth), dtype=torch.int8)
    scale, bias = torch.rand(40) / 100, torch.randn(40).to(torch.bfloat16)
    got = int8_linear(x, qweight, scale, bias)
    want = x.float() @ qweight.float().t() * scale.to(torch.bfloat16).float() + bias.float()
    assert got.shape == (2, 3, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=atol)


def test_quantized_rows_round_to_nearest_with_the_largest_at_127():
    torch.manual_seed(0)
    linear = nn.Linear(64, 24).to(torch.bfloat16)
    quantized = Int8WeightOnlyLinear(linear)
    weight = linear.weight.float()
    assert quantized.qweight.dtype == torch.int8 and quantized.scale.dtype == torch.float32
    assert torch.equal(quantized.qweight.abs().amax(dim=1), torch.full((24,), 127, dtype=torch.int8))
    assert (
        (quantized.qweight.float() * quantized.scale.unsqueeze(1) - weight)
        .abs()
        .le(quantized.scale.unsqueeze(1) / 2 + 1e-7)
        .all()
    )
    assert quantized.bias is linear.bias
    x = torch.randn(4, 64).to(torch.bfloat16)
    torch.testing.assert_close(quantized(x).float(), linear(x).float(), rtol=0.05, atol=0.05)


def markov_model(steps=150):
    """A small bf16 model trained on a chain where each word is followed by its successor 85% of the time: its
    greedy choice is clear, so int8 rounding should rarely change it (the GPU test's setting, smaller)."""
    d = Dictionary()
    for i in range(48):
        d.add_symbol(f"w{i}")
    g = torch.Generator().manual_seed(0)
    successor = torch.randperm(len(d) - d.nspecial, generator=g) + d.nspecial
    torch.manual_seed(0)
    cfg = TransformerLanguageModelConfig(
        decoder_embed_dim=64,
        decoder_input_dim=64,
        decoder_output_dim=64,
        decoder_ffn_embed_dim=128,
        decoder_layers=2,
        decoder_attention_heads=4,
        max_target_positions=64,
        dropout=0.0,
        share_decoder_input_output_embed=False,
    )
    model = TransformerLanguageModel.build(cfg, len(d), d.pad())
    with torch.enable_grad():
        train(model, d, successor, g, steps)
    return d, model.eval().to(torch.bfloat16)


def train(model, d, successor, g, steps):
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        tokens = torch.empty(16, 24, dtype=torch.long)
        tokens[:, 0] = torch.randint(d.nspecial, len(d), (16,), generator=g)
        for t in range(1, 24):
            follow = torch.rand(16, generator=g) < 0.85
            tokens[:, t] = torch.where(
                follow, successor[tokens[:, t - 1] - d.nspecial], torch.randint(d.nspecial, len(d), (16,), generator=g)
            )
        logits = model(tokens[:, :-1])[0]
        loss = nn.functional.cross_entropy(logits.reshape(-1, len(d)), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@torch.no_grad()
def test_int8_greedy_tokens_agree_with_bf16_on_the_cpu():
    d, model = markov_model()
    prompts = torch.randint(d.nspecial, len(d), (16, 4), generator=torch.Generator().manual_seed(1))
    sample = {"net_input": {"src_tokens": prompts, "src_lengths": torch.full((16,), 4)}}

    def greedy(m):
        generator = SequenceGenerator([m], d, beam_size=1, max_len_b=20, min_len=20)
        return torch.stack([h[0]["tokens"][4:20] for h in generator.generate([m], sample, prefix_tokens=prompts)])

    bf16 = greedy(model)
    names = quantizable_linears(model)
    quantize_linears_(model, names)
    assert len(names) == 2 * 6 + 1 and isinstance(model.decoder.output_projection, Int8WeightOnlyLinear)
    agreement = float((greedy(model) == bf16).float().mean())
    print(f"int8 greedy tokens equal to bf16: {agreement:.1%}")
    assert agreement >= 0.95, agreement  # 16 prompts x 16 tokens


def test_the_kernel_compiles_for_an_h100():
    """The interpreter runs the kernel as Python: this compiles it to an sm_90 binary (Triton's compiler and
    ptxas, no GPU needed), which catches what only the compiler rejects."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ASTSource / GPUTarget to compile ahead of time")
    from fairseq.kernels.int8_matmul import _kernel

    for rows_block, has_bias in ((16, False), (64, True)):
        constants = dict(HAS_BIAS=has_bias, BLOCK_M=rows_block, BLOCK_N=32, BLOCK_K=128)
        signature = dict(
            x_ptr="*bf16",
            w_ptr="*i8",
            scale_ptr="*fp32",
            bias_ptr="*bf16",
            out_ptr="*bf16",
            rows="i32",
            columns="i32",
            depth="i32",
            x_stride="i32",
            w_stride="i32",
            **{name: "constexpr" for name in constants},
        )
        compiled = triton.compile(
            ASTSource(_kernel(), signature, constants), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}
        )
        assert compiled.asm["cubin"]
