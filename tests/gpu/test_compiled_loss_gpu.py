"""The losses on CUDA: the inductor-compiled one and the fused Triton kernels that token_cross_entropy (and
--compile's loss) runs there,
against the chunked eager cross-entropy and F.cross_entropy of fp32 logits: the same per-token losses and
gradients, and what each holds beyond the logits."""

import pytest
import torch

from fairseq.criterions.cross_entropy import (
    _fp32_cross_entropy,
    chunk_rows,
    chunked_token_cross_entropy,
    compiled_token_cross_entropy,
    compiled_fp32_cross_entropy,
    token_cross_entropy,
)
from fairseq.kernels.cross_entropy import fused_cross_entropy_available

pytestmark = pytest.mark.gpu

PAD = 1
VOCAB = 50272  # GPT-2's, padded: a row far longer than one reduction block


def _loss_and_grad(fn, logits, target, weights):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    losses = fn(logits, target, PAD)
    (losses * weights).sum().backward()
    grad, logits.grad = logits.grad, None
    torch.cuda.synchronize()
    return losses.detach(), grad, torch.cuda.max_memory_allocated() - base


def _logits_and_target(n, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(n, VOCAB, device="cuda", generator=gen) * 3).bfloat16().requires_grad_()
    target = torch.randint(0, VOCAB, (n,), device="cuda", generator=gen)
    target[::7] = PAD
    return logits, target, torch.rand(n, device="cuda", generator=gen)


def test_compiled_loss_matches_the_chunked_one_and_needs_no_more_memory():
    torch._dynamo.reset()
    compiled = compiled_fp32_cross_entropy()
    for n in (4096, 3000):  # the second token count recompiles (dynamic), as a short last batch would
        logits, target, weights = _logits_and_target(n, seed=n)
        compiled(logits, target, PAD).sum().backward()  # compile outside the measured call
        logits.grad = None
        got, got_grad, got_peak = _loss_and_grad(compiled, logits, target, weights)
        want, want_grad, want_peak = _loss_and_grad(chunked_token_cross_entropy, logits, target, weights)
        # fp32 reductions over 50272 values in another order: a few ulps of losses of order 10.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert torch.equal(got[::7], torch.zeros_like(got[::7]))
        # Gradients are cast to bf16: at most one unit in its last place apart.
        torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2**-8, atol=2**-8)
        assert got_peak <= want_peak, (got_peak / 2**30, want_peak / 2**30)


def test_chunked_loss_matches_fp32_cross_entropy_with_one_fp32_chunk_beyond_the_gradient():
    n = 4096
    logits, target, weights = _logits_and_target(n)
    want, want_grad, _ = _loss_and_grad(_fp32_cross_entropy, logits, target, weights)
    got, got_grad, got_peak = _loss_and_grad(chunked_token_cross_entropy, logits, target, weights)
    # Forward: the same fp32 log-softmax of the same rows (bf16 is upcast before the kernel either way).
    assert torch.equal(got, want)
    # Backward: exp(x - lse) against autograd's log-softmax backward, both fp32 and rounded once to bf16.
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2**-8, atol=2**-8)
    assert torch.equal(got_grad[::7], torch.zeros_like(got_grad[::7]))
    # Beyond the logits: their bf16 gradient and one fp32 chunk (the recomputed probabilities), plus per-token
    # vectors; the softmax formulation held a second chunk (its upcast copy).
    grad_bytes, chunk_bytes = n * VOCAB * 2, chunk_rows(VOCAB) * VOCAB * 4
    assert got_peak <= grad_bytes + chunk_bytes + 8 * 2**20, (got_peak / 2**20, grad_bytes / 2**20, chunk_bytes / 2**20)


def test_token_cross_entropy_on_cuda_is_the_fused_kernel_and_holds_only_the_gradient():
    assert fused_cross_entropy_available(torch.zeros(2, 3, device="cuda"))
    for n in (4096, 3000):
        logits, target, weights = _logits_and_target(n, seed=n)
        want, want_grad, _ = _loss_and_grad(_fp32_cross_entropy, logits, target, weights)
        got, got_grad, got_peak = _loss_and_grad(token_cross_entropy, logits, target, weights)
        # An online log-sum-exp in fp32 sums 50272 terms in another order: a few ulps of losses of order 10.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[::7], torch.zeros_like(got[::7]))
        torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2**-8, atol=2**-8)
        assert torch.equal(got_grad[::7], torch.zeros_like(got_grad[::7]))
        # Beyond the logits: the bf16 gradient and per-token vectors (losses, log-sum-exp), nothing [N, V] in fp32
        assert got_peak <= n * VOCAB * 2 + 2**20, (got_peak / 2**20, n * VOCAB * 2 / 2**20)


def test_compile_loss_keeps_the_fused_kernel_on_cuda():
    """--compile's loss on CUDA is the fused kernels (faster than inductor's, no recompile for a short last
    batch): the same values bit for bit, and nothing is compiled."""
    torch._dynamo.reset()
    compiled = compiled_token_cross_entropy()
    logits, target, weights = _logits_and_target(3000, seed=3)
    want, want_grad, _ = _loss_and_grad(token_cross_entropy, logits, target, weights)
    frames_before = torch._dynamo.utils.counters["frames"]["total"]
    got, got_grad, _ = _loss_and_grad(compiled, logits, target, weights)
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert torch._dynamo.utils.counters["frames"]["total"] == frames_before
