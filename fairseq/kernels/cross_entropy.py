"""Per-token cross-entropy of [N, V] logits in two Triton kernels, one a direction, one program a row.

Forward reads each row once, keeping a running maximum and a running sum of exponentials in fp32 (an online
log-sum-exp), and writes the token's loss and the row's log-sum-exp (fp32, one value each). Backward reads the
row once more and writes the gradient, (exp(x - lse) - onehot(target)) * grad_loss, in the logits' dtype. No
[N, V] tensor besides the gradient exists, and no fp32 one at all: forward and backward of 16384 x 50272 bf16
logits take 1.37 ms on an H200, against 15.2 for the chunked eager loss and 10.7 for F.cross_entropy of fp32
logits (docs/benchmarks_h200.md, "gpt3_medium b8 profiled, and a fused cross-entropy").

Values: the fp32 arithmetic of `F.cross_entropy(logits.float(), ...)` in another summation order (a few ulps of
the loss), and the gradient rounded once to the logits' dtype. Rows whose target is `ignore_index` give 0 and
a zero gradient.
"""

import torch
from torch.autograd.function import once_differentiable

from fairseq.kernels import built_with_triton

BLOCK = 4096  # columns a program handles per step (GPT-2's 50k vocabulary: 13 steps)
# The vocabulary size is a compile-time constant of the kernels (the loop's trip count): one compilation per
# vocabulary size, which a run keeps.
NUM_WARPS = 8


def fused_cross_entropy_available(logits: torch.Tensor) -> bool:
    """Whether `logits` can take the kernels: a plain (not subclassed) CUDA tensor of a float dtype, with
    Triton importable."""
    return (
        type(logits) is torch.Tensor
        and logits.is_cuda
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and _kernels() is not None
    )


def fused_token_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Per-token cross-entropy in nats, fp32, 0 at `ignore_index` (see the module's docstring)."""
    return _FusedCrossEntropy.apply(logits, target, ignore_index)


@built_with_triton
def _kernels(triton, tl):
    """The two jitted kernels, built on first use; None without Triton."""

    @triton.jit
    def forward_kernel(
        logits_ptr, row_stride, target_ptr, loss_ptr, lse_ptr, ignore_index, n_cols: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * row_stride
        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        target = tl.load(target_ptr + row)
        ignored = target == ignore_index
        target_logit = tl.load(row_ptr + tl.where(ignored, 0, target)).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - target_logit))
        # +inf on ignored rows: backward's exp(x - lse) is then exactly 0 there
        tl.store(lse_ptr + row, tl.where(ignored, float("inf"), lse))

    @triton.jit
    def backward_kernel(
        logits_ptr,
        row_stride,
        grad_ptr,
        target_ptr,
        lse_ptr,
        grad_loss_ptr,
        grad_loss_stride,
        ignore_index,
        n_cols: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * row_stride
        grad_row_ptr = grad_ptr + row * n_cols
        target = tl.load(target_ptr + row)
        ignored = target == ignore_index
        scale = tl.where(ignored, 0.0, tl.load(grad_loss_ptr + row * grad_loss_stride).to(tl.float32))
        lse = tl.load(lse_ptr + row)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            prob = tl.exp(x - lse)
            grad = tl.where((cols == target) & (~ignored), prob - 1.0, prob) * scale
            tl.store(grad_row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)

    return forward_kernel, backward_kernel


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        forward_kernel, _ = _kernels()
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        target = target.contiguous()
        rows, cols = logits.shape
        loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        if rows:
            forward_kernel[(rows,)](
                logits, logits.stride(0), target, loss, lse, ignore_index, n_cols=cols, BLOCK=BLOCK, num_warps=NUM_WARPS
            )
        ctx.save_for_backward(logits, target, lse)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        _, backward_kernel = _kernels()
        logits, target, lse = ctx.saved_tensors
        rows, cols = logits.shape
        grad = torch.empty((rows, cols), dtype=logits.dtype, device=logits.device)
        if rows:
            backward_kernel[(rows,)](
                logits,
                logits.stride(0),
                grad,
                target,
                lse,
                grad_loss,
                grad_loss.stride(0),
                ctx.ignore_index,
                n_cols=cols,
                BLOCK=BLOCK,
                num_warps=NUM_WARPS,
            )
        return grad, None, None
