"""The fused cross-entropy kernels (fairseq.kernels.cross_entropy) run in Triton's interpreter on the CPU
(TRITON_INTERPRET=1, in a subprocess: the mode is read when the kernels are built), against
F.cross_entropy of fp32 logits: the same losses and gradients, rows of several column blocks, ignored rows.
On CUDA the compiled kernels are checked in tests/gpu/test_compiled_loss_gpu.py."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fairseq.kernels.cross_entropy import fused_cross_entropy_available

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

INTERPRETED = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from fairseq.kernels import cross_entropy as kernels

    kernels.BLOCK = 64  # rows of 150 columns take three blocks, the last one partly masked
    torch.manual_seed(0)
    PAD = 1
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = (torch.randn(9, 150) * 3).to(dtype).requires_grad_()
        target = torch.randint(0, 150, (9,))
        target[[2, 5]] = PAD
        target[0] = 149  # the last column
        weights = torch.rand(9)
        losses = kernels.fused_token_cross_entropy(logits, target, PAD)
        (losses * weights).sum().backward()
        grad, logits.grad = logits.grad, None
        want = F.cross_entropy(logits.float(), target, ignore_index=PAD, reduction="none")
        (want * weights).sum().backward()
        assert losses.dtype == torch.float32 and grad.dtype == dtype
        # another summation order of the same fp32 terms: a few ulps of losses of order 10
        torch.testing.assert_close(losses, want, rtol=1e-6, atol=1e-5)
        assert torch.equal(losses[[2, 5]], torch.zeros(2))
        tol = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]  # one unit, last place
        torch.testing.assert_close(grad.float(), logits.grad.float(), rtol=tol, atol=tol)
        assert torch.equal(grad[[2, 5]], torch.zeros(2, 150, dtype=dtype))
    empty = torch.zeros(0, 5, requires_grad=True)
    kernels.fused_token_cross_entropy(empty, torch.zeros(0, dtype=torch.long), PAD).sum().backward()
    assert empty.grad.shape == (0, 5)
    print("interpreted kernels agree")
""")


def test_kernels_in_the_interpreter_match_fp32_cross_entropy():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "interpreted kernels agree" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_only_plain_cuda_tensors_take_the_kernels():
    assert not fused_cross_entropy_available(torch.zeros(4, 8))  # the CPU: the chunked eager path
    assert not fused_cross_entropy_available(torch.zeros(4, 8, dtype=torch.int64))
    assert not fused_cross_entropy_available(torch.zeros(2, 4, 8))  # not [N, V]
