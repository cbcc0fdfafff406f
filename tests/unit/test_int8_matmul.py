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
from fairseq.kernels.int8_matmul import int8_linear, set_int8_matmul
from fairseq.kernels.int8_tuning import LEGACY, Config, candidates, config_for, heuristic, row_bucket, tuned_configs
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.usefixtures("one_thread")

INTERPRETED = textwrap.dedent("""
    import torch
    from fairseq.kernels import int8_matmul as im
    from fairseq.kernels.int8_tuning import candidates

    torch.manual_seed(0)
    # K and N not multiples of any block; K 600 split in 2, 3 (4 asked: 5 blocks of 128 in slices of 256) or 4
    # slices; one row (the GEMV form and tl.dot's), 5 and 17 (dot blocks of 16, 32), 64
    shapes = ((1, 48, 600), (1, 70, 200), (5, 70, 600), (17, 33, 16), (64, 40, 136))
    configs = 0
    for rows, columns, depth in shapes:
        x = torch.randn(rows, depth).to(torch.bfloat16)
        qweight = torch.randint(-127, 128, (columns, depth), dtype=torch.int8)
        scale = torch.rand(columns) / 100
        bias = torch.randn(columns).to(torch.bfloat16)
        for b in (None, bias):
            want = x.float() @ qweight.float().t() * scale + (0 if b is None else b.float())
            shapes = candidates(rows, columns, depth) + [None]  # None: the untimed choice (CPU)
            shapes += [c._replace(sum_in_kernel=False) for c in shapes if c and c.split_k > 1]  # two launches
            for config in shapes:
                got = im.int8_matmul_kernel(x, qweight, scale, b, config)
                assert got.dtype == torch.bfloat16 and got.shape == (rows, columns)
                # exact products summed in fp32, then one conversion to bf16: within one bf16 ulp (2**-7 relative;
                # the interpreter truncates it, the GPU rounds to nearest)
                torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3, msg=str((rows, config)))
                configs += 1
    assert im.int8_kernel_available(x) and not im.int8_kernel_available(x.float())
    assert list(im._counters) == [torch.device("cpu")] and not im._counters[x.device].any()  # all reset
    try:
        im.int8_matmul_kernel(x, qweight, scale, None, im.Config(16, 256, gemv=True))
    except ValueError as e:
        assert str(e) == "int8 matmul: the GEMV launch shape takes one row, not 64", e
    else:
        raise AssertionError("a GEMV launch over 64 rows ran")
    print(f"interpreted kernel agrees over {configs} launches")
""")


def test_the_kernel_in_the_interpreter_matches_the_fp32_product():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "interpreted kernel agrees over" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_the_launch_shapes_a_decode_step_gets_untimed():
    """The heuristic (under capture, in the interpreter) splits K until ~512 programs run, each slice keeping 2 K
    blocks at least; the candidates always hold the old launch shape and the heuristic's, and no split into empty slices."""
    assert heuristic(1, 2048, 2048) == Config(16, 256, 4, 4, gemv=True)  # 128 tiles x 4 slices of 512
    assert heuristic(1, 8192, 2048) == Config(16, 256, 1, 4, gemv=True)  # 512 tiles already
    assert heuristic(1, 2048, 8192) == Config(16, 256, 4, 4, gemv=True)
    assert heuristic(32, 2048, 2048) == Config(32, 128, 8, 4)  # 64 tiles of 32 x 32 x 8 slices of 256
    assert heuristic(1, 64, 300) == Config(16, 256, 1, 4, gemv=True)  # too short to split
    assert [row_bucket(r) for r in (1, 2, 16, 17, 32, 33, 64, 65, 256)] == [1, 16, 16, 32, 32, 64, 64, 256, 256]
    for rows in (1, 32):
        shapes = candidates(rows, 2048, 8192)
        assert shapes[:2] == [LEGACY, heuristic(rows, 2048, 8192)] and len(shapes) == len(set(shapes)) > 10
        assert all(c.gemv == (rows == 1) for c in shapes[1:])
    assert all(c.split_k * c.block_k <= 300 for c in candidates(1, 64, 300))
    x = torch.zeros(1, 300, dtype=torch.bfloat16)  # on the CPU: the heuristic's, nothing timed or kept
    assert config_for(x, torch.zeros(64, 300, dtype=torch.int8), None, run=None) == heuristic(1, 64, 300)
    assert tuned_configs() == {}


def test_the_matmul_path_setting():
    """FAIRSEQ_INT8_MATMUL is read at import; a bad value is one line from --quantize's check, before loading."""
    code = (
        "import torch\n"
        "from fairseq.kernels import int8_matmul as im\n"
        "from fairseq.generation.quantize import check_quantize\n"
        "try:\n"
        "    check_quantize('int8-weight-only', torch.device('cuda'), torch.bfloat16)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "print(im._path[0])\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    lines = {}
    for value in ("inductor", "cublas"):
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(env, FAIRSEQ_INT8_MATMUL=value),
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines[value] = proc.stdout.splitlines()
    assert lines["inductor"] == ["inductor"]
    assert lines["cublas"] == [
        "FAIRSEQ_INT8_MATMUL='cublas' is not an int8 matmul path: use one of triton, inductor (or unset it: triton)",
        "cublas",
    ]
    with pytest.raises(ValueError, match="^FAIRSEQ_INT8_MATMUL='x' is not an int8 matmul path"):
        set_int8_matmul("x")
    assert set_int8_matmul("inductor") == "triton" and set_int8_matmul("triton") == "inductor"


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


def test_the_kernels_compile_for_an_h100():
    """The interpreter runs the kernels as Python: this compiles them to sm_90 binaries (Triton's compiler and
    ptxas, no GPU needed), which catches what only the compiler rejects: the GEMV and tl.dot forms, with and
    without the split-K partial sums, and the split-K sum."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ASTSource / GPUTarget to compile ahead of time")
    from fairseq.kernels.int8_matmul import _kernels

    matmul, split_k_sum = _kernels()
    target = GPUTarget("cuda", 90, 32)
    pointers = dict(x_ptr="*bf16", w_ptr="*i8", scale_ptr="*fp32", bias_ptr="*bf16", partial_ptr="*fp32")
    for block_m, partial, here, has_bias, warps in (
        (1, True, True, True, 8),
        (1, True, False, False, 4),
        (1, False, False, False, 4),
        (16, True, True, False, 4),
        (64, False, False, True, 4),
    ):
        constants = dict(
            HAS_BIAS=has_bias, PARTIAL=partial, SUM_HERE=here, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=256, DOT_FP32=False
        )
        signature = dict(
            **pointers,
            out_ptr="*bf16",
            counter_ptr="*i32",
            **dict.fromkeys(("rows", "columns", "depth", "x_stride", "w_stride", "k_per_split"), "i32"),
            **dict.fromkeys(constants, "constexpr"),
        )
        compiled = triton.compile(ASTSource(matmul, signature, constants), target=target, options={"num_warps": warps})
        assert compiled.asm["cubin"]
    constants = dict(HAS_BIAS=True, SPLIT_K=3, SPLIT_BLOCK=4, BLOCK=256)
    signature = dict(
        partial_ptr="*fp32",
        scale_ptr="*fp32",
        bias_ptr="*bf16",
        out_ptr="*bf16",
        size="i32",
        columns="i32",
        **dict.fromkeys(constants, "constexpr"),
    )
    compiled = triton.compile(ASTSource(split_k_sum, signature, constants), target=target, options={"num_warps": 4})
    assert compiled.asm["cubin"]
