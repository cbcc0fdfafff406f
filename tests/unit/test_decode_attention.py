"""The split-KV decode attention kernels (fairseq.kernels.decode_attention) in Triton's interpreter on the CPU
(TRITON_INTERPRET=1, in a subprocess: the mode is read when the kernels are built) against the PyTorch
reference, which is itself checked against SDPA over each row's live keys; the static decode step through the
kernels against the SDPA path (logits, and the hypotheses of greedy, sampling and beam search). At real sizes
on CUDA: tests/gpu/test_decode_attention_gpu.py."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from fairseq.kernels.decode_attention import (
    decode_attention,
    decode_attention_available,
    decode_attention_reference,
    splits_for,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def interpret(script: str, done: str) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("FAIRSEQ_DECODE_ATTENTION_KERNEL", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0 and done in proc.stdout, proc.stdout + proc.stderr[-4000:]


KERNELS = """
    import torch
    from fairseq.kernels import decode_attention as da

    da.BLOCK_N = 16  # rows of up to 70 keys take several blocks; lengths sit on and beside block boundaries
    da.CACHE_BLOCK = 32  # block tables of 3 blocks over the 80 slots; lengths cross their edges too
    torch.manual_seed(0)
    B, H, CAPACITY, ROWS = 7, 2, 80, 9
    lengths = torch.tensor([1, 15, 16, 17, 32, 33, 70], dtype=torch.int32)
    # fp32: another summation order of the same fp32 terms; bf16 / fp16: fp32 results that close rounded once
    # to the dtype by both, so at most one unit in the last place apart (2**-7 / 2**-10 of the value)
    tolerance = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}
    for dtype, dim in ((torch.float32, 16), (torch.bfloat16, 16), (torch.float16, 12)):  # 12: a partial block
        q = torch.randn(B, H, 1, dim).to(dtype)
        keys = (torch.randn(ROWS, H, CAPACITY, dim) * 2).to(dtype)
        values = torch.randn(ROWS, H, CAPACITY, dim).to(dtype)
        # one cache row per query row (a [B, 1] column expanded: column stride 0); a block table [B, 3] of random
        # rows, blocks shared by several rows
        row_map = torch.tensor([8, 0, 3, 3, 1, 6, 2], dtype=torch.int32).view(B, 1).expand(B, 3)
        table = torch.randint(0, ROWS, (B, 3), dtype=torch.int32)
        table[1:4, 0] = table[0, 0]
        table[5, :2] = table[6, :2]
        cases = [
            dict(),
            dict(block_rows=row_map),
            dict(max_length=72),
            dict(block_rows=row_map, scale=0.3),
            dict(block_rows=table),
            dict(block_rows=table, max_length=40),
        ]
        for number, case in enumerate(cases):
            want = da.decode_attention_reference(q, keys, values, lengths, **case)
            # one part; 8 parts of 16 keys (the last ones past every row's length); what splits_for says
            for splits in (1, 8) if number else (1, 8, None):
                got = da.decode_attention_kernel(q, keys, values, lengths, splits=splits, **case)
                assert got.dtype == dtype and got.shape == (B, H, 1, dim)
                tol = tolerance[dtype]
                torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-5)
        # through a table, each key is the one its block's row holds (the reference's own check)
        gathered = da.gather_blocks(keys, table, CAPACITY)
        for b, t in ((0, 5), (2, 31), (3, 32), (5, 63), (6, 79)):
            assert torch.equal(gathered[b, :, t], keys[table[b, t // 32], :, t])
        # one length for every row ([1], as the static step passes it), int64; the caches' row views
        one = torch.tensor([33])
        got = da.decode_attention_kernel(q, keys[:B], values[:B], one, splits=4)
        want = da.decode_attention_reference(q, keys[:B], values[:B], one.expand(B))
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-5)
    # q as fused q/k/v give it at batch > 1: a strided view of one projection, read through its strides
    qkv = torch.randn(B, 1, 3 * H * 16)
    q = qkv[..., : H * 16].view(B, 1, H, 16).transpose(1, 2)
    assert not q.is_contiguous() and q.stride(-1) == 1
    keys, values = torch.randn(B, H, CAPACITY, 16), torch.randn(B, H, CAPACITY, 16)
    for splits in (1, 8):
        got = da.decode_attention_kernel(q, keys, values, lengths, splits=splits)
        want = da.decode_attention_reference(q.contiguous(), keys, values, lengths)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-5)
    # a length of 0 reads nothing and gives zeros, in both
    q = torch.randn(2, 1, 1, 16)
    keys = values = torch.randn(2, 1, 40, 16)
    zero = torch.tensor([0, 5], dtype=torch.int32)
    for splits in (1, 4):
        got = da.decode_attention_kernel(q, keys, values, zero, splits=splits)
        assert torch.equal(got[0], torch.zeros(1, 1, 16)) and torch.isfinite(got).all()
    assert torch.equal(da.decode_attention_reference(q, keys, values, zero)[0], torch.zeros(1, 1, 16))
    # decode_attention takes the kernels here (the interpreter) and gives the reference's values
    assert da.decode_attention_available(q)
    torch.testing.assert_close(da.decode_attention(q, keys, values, zero),
                               da.decode_attention_reference(q, keys, values, zero), rtol=2e-6, atol=2e-6)
    print("interpreted kernels agree")
"""


def test_kernels_in_the_interpreter_match_the_reference():
    interpret(KERNELS, "interpreted kernels agree")


STEPS = """
    import sys
    import torch
    sys.path.insert(0, "tests/unit")
    import test_sequence_generator as t
    from fairseq.generation import search
    from fairseq.kernels.decode_attention import set_decode_attention_kernel

    # the static step's logits, kernel against SDPA, step by step from a prompt
    model = t.build(seed=4)
    x = torch.randint(4, t.V, (3, 7))
    logits = []
    for kernel in (True, False):
        set_decode_attention_kernel(kernel)
        state = {}
        model.decoder.reserve_incremental_state(state, 64, 3)
        model(x[:, :2], incremental_state=state)
        steps = []
        for step in range(2, 7):
            steps.append(model.decoder.forward_static_step(x[:, step:step + 1], torch.tensor([step]), state))
            model.decoder.set_incremental_length(state, step + 1)
        logits.append(torch.cat(steps, 1))
    torch.testing.assert_close(logits[0], logits[1], atol=2e-5, rtol=2e-5)
    # whole generations on the static step path (the CUDA graph path run eagerly): the same hypotheses
    for beam, sampling in ((1, dict(sampling_topk=4)), (3, None)):
        results = []
        for kernel in (True, False):
            set_decode_attention_kernel(kernel)
            step = model.decoder._static_step_attention(torch.zeros(1, 1, 16), torch.tensor([0]), 64)
            assert (step.mask is None) == kernel
            strategy = None if sampling is None else search.Sampling(t.D, **sampling)
            generator = t.EagerStaticGenerator([model], t.D, beam_size=beam, max_len_b=8, search_strategy=strategy)
            sample, prefix = t.sample_of(t.PROMPTS)
            torch.manual_seed(0)
            results.append(generator.generate([model], sample, prefix_tokens=prefix))
        t.assert_same_hypotheses(results[0], results[1])
    print("kernel steps agree")
"""


def test_the_static_step_through_the_kernels_gives_the_sdpa_paths_hypotheses():
    interpret(STEPS, "kernel steps agree")


BEAMS = """
    import sys
    import torch
    sys.path.insert(0, "tests/unit")
    import test_sequence_generator as t
    from test_beam_block_table import CopyReorder, assert_equal_hypotheses
    from test_device_decoding import MIXED
    from fairseq.generation import device_beam_search, step_model
    from fairseq.kernels import decode_attention as da
    from fairseq.modules import causal_attention

    # blocks of 4 slots: outputs of ~16 tokens fill and share three of them (the block size is read where it is
    # used: the kernel, the table's width, the reorder, the block copy); two sentences: the interpreter is slow
    da.BLOCK_N, da.MAX_SPLITS = 4, 2  # two parts a row (with the combining kernel), not one per block
    for module in (da, device_beam_search, step_model, causal_attention):
        module.CACHE_BLOCK = 4
    model = t.build(seed=4)
    sample, prefix = t.sample_of([MIXED[0], MIXED[2]])
    results = {}
    for kernel, reorder in ((True, "table"), (True, "copy"), (False, "table")):
        da.set_decode_attention_kernel(kernel)
        generator = t.EagerStaticGenerator([model], t.D, beam_size=2, max_len_b=16, min_len=14)
        if reorder == "copy":
            generator.step_model.__class__ = CopyReorder
        results[kernel, reorder] = generator.generate([model], sample, prefix_tokens=prefix)
    # the kernel through the table reads the values the copied caches hold, in the same order: equal
    assert_equal_hypotheses(results[True, "table"], results[True, "copy"])
    t.assert_same_hypotheses(results[True, "table"], results[False, "table"])  # SDPA: its own summation order
    assert max(len(h["tokens"]) for s in results[True, "table"] for h in s) > 3 * 4
    print("beams through block tables agree")
"""


def test_beam_search_through_block_tables_in_the_kernels_equals_the_copy_reorder():
    interpret(BEAMS, "beams through block tables agree")


def test_the_reference_is_sdpa_over_each_rows_live_keys():
    torch.manual_seed(0)
    q, keys, values = torch.randn(3, 2, 1, 8), torch.randn(4, 2, 20, 8), torch.randn(4, 2, 20, 8)
    lengths, row_map = torch.tensor([1, 7, 20], dtype=torch.int32), torch.tensor([3, 0, 1], dtype=torch.int32)
    # one cache row per query row: a one-block table (the capacity 20 is under CACHE_BLOCK)
    got = decode_attention_reference(q, keys, values, lengths, row_map.view(3, 1), scale=0.5)
    for b in range(3):
        live = slice(0, int(lengths[b]))
        row = int(row_map[b])
        want = F.scaled_dot_product_attention(
            q[b : b + 1], keys[row : row + 1, :, live], values[row : row + 1, :, live], scale=0.5
        )
        torch.testing.assert_close(got[b : b + 1], want, rtol=1e-6, atol=1e-6)


def test_the_cpu_takes_the_reference_and_bad_shapes_are_named():
    q, cache = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 16, 8)
    assert not decode_attention_available(q)
    lengths = torch.tensor([3, 16])
    assert torch.equal(decode_attention(q, cache, cache, lengths), decode_attention_reference(q, cache, cache, lengths))
    with pytest.raises(ValueError, match=r"one query per row, q \[B, H, 1, D\]"):
        decode_attention(torch.randn(2, 2, 3, 8), cache, cache, lengths)
    with pytest.raises(ValueError, match="lengths must be integers"):
        decode_attention(q, cache, cache, torch.tensor([3.0, 4.0]))
    with pytest.raises(ValueError, match="block_rows must be"):
        decode_attention(q, cache, cache, lengths, block_rows=torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_rows must be"):  # a table narrower than the capacity
        decode_attention(q, torch.randn(2, 2, 130, 8), torch.randn(2, 2, 130, 8), lengths, torch.zeros(2, 2).int())
    with pytest.raises(ValueError, match="3 query rows but the caches hold 2"):
        decode_attention(torch.randn(3, 2, 1, 8), cache, cache, torch.tensor([1]))


def test_splits_fill_the_gpu_and_stay_a_power_of_two():
    # batch 1 x 32 heads over 768 slots: 12 blocks of 64 -> 16 parts (a power of 2); batch 32: one part
    assert splits_for(32, 768) == 16
    assert splits_for(32 * 32, 768) == 1
    assert splits_for(4, 64) == 1  # one block: no more parts than blocks
    assert splits_for(1, 100_000) == 64  # at most MAX_SPLITS


def test_the_kernels_compile_for_an_h100():
    """The interpreter runs the kernels as Python: this compiles them to an sm_90 binary (Triton's own
    compiler and ptxas, no GPU needed), which catches what only the compiler rejects."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ASTSource / GPUTarget to compile ahead of time")
    from fairseq.kernels.decode_attention import _kernels

    split_kernel, combine_kernel = _kernels()
    pointers = dict(
        q_ptr="*bf16",
        k_ptr="*bf16",
        v_ptr="*bf16",
        lengths_ptr="*i32",
        out_ptr="*bf16",
        part_out_ptr="*fp32",
        part_max_ptr="*fp32",
        part_sum_ptr="*fp32",
    )
    ints = ["stride_b", "stride_h", "stride_n", "length_stride", "window"]
    signature = {**pointers, **{name: "i32" for name in ints + ["split_size"]}, "scale_log2": "fp32"}
    signature.update(rows_strides=("i32", "i32"), q_strides=("i32", "i32"))  # tuple arguments
    signature["block_rows_ptr"] = "*i32"
    for table in (True, False):  # with a block table and parts; without one, the one part writing the output
        constants = dict(
            HEADS=32,
            DIM=64,
            BLOCK_D=64,
            BLOCK_N=64,
            SPLITS=16 if table else 1,
            CACHE_BLOCK=64,
            HAS_BLOCK_ROWS=table,
            DIRECT=not table,
        )
        source = ASTSource(split_kernel, {**signature, **{name: "constexpr" for name in constants}}, constants)
        assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["cubin"]
    constants = dict(DIM=64, BLOCK_D=64, SPLITS=16)
    signature = dict(
        part_out_ptr="*fp32",
        part_max_ptr="*fp32",
        part_sum_ptr="*fp32",
        out_ptr="*bf16",
        **{name: "constexpr" for name in constants},
    )
    compiled = triton.compile(
        ASTSource(combine_kernel, signature, constants), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}
    )
    assert compiled.asm["cubin"]
