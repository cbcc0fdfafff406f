"""--criterion cross_entropy: next-token cross-entropy, summed in nats, logged in base 2 as upstream."""

import math
from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fairseq.criterions import register_criterion
from fairseq.criterions.fairseq_criterion import FairseqCriterion
from fairseq.dataclass.configs import II
from fairseq.kernels.cross_entropy import fused_cross_entropy_available, fused_token_cross_entropy
from fairseq.logging import metrics


@dataclass
class CrossEntropyCriterionConfig:
    sentence_avg: bool = II("optimization.sentence_avg", False)  # owned by the optimization group, as upstream


@register_criterion("cross_entropy", dataclass=CrossEntropyCriterionConfig)
class CrossEntropyCriterion(FairseqCriterion):
    def __init__(self, task, sentence_avg: bool):
        super().__init__(task)
        self.sentence_avg = bool(sentence_avg)
        self._token_loss = token_cross_entropy

    def compile_loss(self, backend: str = "inductor") -> None:
        self._token_loss = compiled_token_cross_entropy(backend)

    def forward(self, model, sample, reduce: bool = True):
        """Returns (loss, sample_size, logging_output); loss is the sum over target tokens in nats, fp32.

        Nothing here waits for the device: logging values stay tensors or plain ints.
        """
        net_output = model(**sample["net_input"])
        logits = net_output[0] if isinstance(net_output, tuple) else net_output
        target = sample["target"]
        loss = self._token_loss(logits.reshape(-1, logits.size(-1)), target.reshape(-1), self.padding_idx)
        if reduce:
            loss = loss.sum()
        nsentences = target.size(0)
        ntokens = sample["ntokens"]
        sample_size = nsentences if self.sentence_avg else ntokens
        logging_output = {
            "loss": loss.detach(),
            "ntokens": ntokens,
            "nsentences": nsentences,
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs: List[Dict]) -> Dict[str, float]:
        """Loss per sample_size unit in base 2 and perplexity, from the summed logging outputs.

        Meant for log intervals (e.g. given `LoggingOutputSums.reduce()`): each summed tensor is read from
        the device once. The values are also logged into the active `fairseq.logging.metrics` aggregators as
        upstream does (loss weighted by sample_size, ppl derived from the averaged loss). When sample_size is
        not the token count (--sentence-avg), `nll_loss` is the per-token loss and perplexity follows it.
        """
        loss_sum = _sum_to_float([log.get("loss", 0.0) for log in logging_outputs])
        ntokens = _sum_to_float([log.get("ntokens", 0) for log in logging_outputs])
        sample_size = _sum_to_float([log.get("sample_size", 0) for log in logging_outputs])
        values = {"loss": _base2_mean(loss_sum, sample_size)}
        per_token_key = "loss"
        if sample_size != ntokens:
            values["nll_loss"] = _base2_mean(loss_sum, ntokens)
            per_token_key = "nll_loss"
        values["ppl"] = perplexity(values[per_token_key])
        if sample_size > 0:
            metrics.log_scalar("loss", values["loss"], sample_size, round=3)
            if per_token_key == "nll_loss":
                metrics.log_scalar("nll_loss", values["nll_loss"], ntokens, round=3)
            metrics.log_derived("ppl", lambda meters: metrics.get_perplexity(meters[per_token_key].avg))
        return values

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        """Every logging value is a sum, so outputs of several workers may be summed before reducing."""
        return True


# Rows of logits computed in fp32 at once. The fp32 log-softmax of all [tokens, vocab] logits is the largest
# transient of a large-vocabulary step (8 x 2048 tokens x 50k vocab: 3.1 GiB, and its backward holds three
# such tensors); computed a chunk at a time, only one chunk of fp32 values exists. 2**26 fp32 = 256 MiB.
FP32_CHUNK_ELEMENTS = 2**26


def chunk_rows(vocab_size: int, chunk_elements: int = FP32_CHUNK_ELEMENTS) -> int:
    return max(1, chunk_elements // vocab_size)


def token_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, chunk_elements: int = FP32_CHUNK_ELEMENTS
) -> torch.Tensor:
    """Per-token cross-entropy in nats (fp32, 0 at `ignore_index`) of [N, V] logits in any float dtype: the
    values of `F.cross_entropy(logits.float(), target, reduction="none")` without an fp32 [N, V] tensor.

    On CUDA with Triton: two fused kernels (fairseq.kernels.cross_entropy: one read of the logits forward, one
    read and the gradient's write backward). Elsewhere: computed in fp32 a chunk of `chunk_elements` at a time,
    backward recomputing each chunk's probabilities from the saved log-sum-exp, so the memory beyond the logits
    is one fp32 chunk plus the logits' gradient (in the logits' dtype). A target whose logit is -inf has an
    infinite loss and a NaN gradient.
    """
    if fused_cross_entropy_available(logits):
        return fused_token_cross_entropy(logits, target, ignore_index)
    return chunked_token_cross_entropy(logits, target, ignore_index, chunk_elements)


def chunked_token_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, chunk_elements: int = FP32_CHUNK_ELEMENTS
) -> torch.Tensor:
    """token_cross_entropy's eager path, on any device (see there)."""
    return _ChunkedCrossEntropy.apply(logits, target, ignore_index, chunk_rows(logits.size(-1), chunk_elements))


def _fp32_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="none")


def compiled_token_cross_entropy(backend: str = "inductor"):
    """token_cross_entropy for --compile: the fused kernels where they run (CUDA with Triton: 1.37 ms forward
    and backward at 16384 x 50272 bf16 logits on an H200, against 2.21 ms for the compiled loss below, and no
    recompile for a short last batch), elsewhere the fp32 cross-entropy compiled. Inductor fuses the upcast,
    the log-softmax and the target's pick into row reductions and the backward into one pass over the logits,
    so no fp32 [N, V] tensor exists either (docs/benchmarks_h200.md, "Compiled loss" and "gpt3_medium b8
    profiled, and a fused cross-entropy"). The token count is marked dynamic when it first changes
    (torch.compile's default), so a short last batch costs one recompile, not one per length."""
    compiled = compiled_fp32_cross_entropy(backend)

    def loss(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        if fused_cross_entropy_available(logits):
            return fused_token_cross_entropy(logits, target, ignore_index)
        return compiled(logits, target, ignore_index)

    loss.fallback = compiled
    return loss


def compiled_fp32_cross_entropy(backend: str = "inductor"):
    """The fp32 cross-entropy under torch.compile with `backend` (compiled at its first call)."""
    return torch.compile(_fp32_cross_entropy, backend=backend)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward keeps each row's log-sum-exp (fp32, one value a token), so backward needs no softmax: a chunk's
    gradient is exp(x - lse) - onehot(t), scaled, made in three elementwise passes (the subtraction reads the
    low-precision logits and writes fp32, the exponential runs in place, and the scaling writes the logits'
    dtype directly), and holds one fp32 chunk instead of two. It is only a little faster than recomputing the
    softmax (15.2 against 15.6 ms at 16384 x 50272 bf16 logits on an H200): the casting passes dominate either
    way, which is why CUDA runs the fused kernels instead (docs/benchmarks_h200.md, "gpt3_medium b8 profiled,
    and a fused cross-entropy")."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, rows):
        losses, lses = [], []
        for chunk, chunk_target in zip(logits.split(rows), target.split(rows)):
            # dtype=float32 computes in fp32 (fp16 on CUDA without an upcast copy; other dtypes are upcast first)
            log_probs = torch.log_softmax(chunk, dim=-1, dtype=torch.float32)
            losses.append(F.nll_loss(log_probs, chunk_target, ignore_index=ignore_index, reduction="none"))
            ignored, safe_target = _ignored_and_safe_target(chunk_target, ignore_index)
            # lse = x[t] - log_softmax(x)[t]; +inf on ignored rows makes their exp(x - lse) exactly 0 in backward
            lse = (chunk.gather(1, safe_target).float() - log_probs.gather(1, safe_target)).squeeze(1)
            lses.append(lse.masked_fill(ignored, math.inf))
            del log_probs  # one fp32 chunk at a time
        ctx.save_for_backward(logits, target, torch.cat(lses))  # split() gives one chunk even of no rows
        ctx.ignore_index, ctx.rows = ignore_index, rows
        return torch.cat(losses)

    @staticmethod
    @once_differentiable  # first-order only: the gradient is built in place
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.size(0), ctx.rows):
            rows = slice(start, start + ctx.rows)
            chunk_target = target[rows]
            # d(-log softmax(x)[t]) / dx = softmax(x) - onehot(t) = exp(x - lse) - onehot(t), times grad_loss.
            grad = torch.sub(logits[rows], lse[rows].unsqueeze(1)).exp_()  # fp32: the logits upcast on reading
            ignored, safe_target = _ignored_and_safe_target(chunk_target, ctx.ignore_index)
            grad.scatter_add_(1, safe_target, torch.full_like(safe_target, -1.0, dtype=grad.dtype))
            scale = grad_loss[rows].float().masked_fill(ignored, 0.0)
            torch.mul(grad, scale.unsqueeze(1), out=grad_logits[rows])  # fp32 product, rounded once on writing
            del grad  # else the next chunk's fp32 gradient is made while this one is still alive
        return grad_logits, None, None, None


def _ignored_and_safe_target(target: torch.Tensor, ignore_index: int):
    """The rows whose target is `ignore_index`, and the targets as a [rows, 1] index with those rows at 0."""
    ignored = target == ignore_index
    return ignored, target.masked_fill(ignored, 0).unsqueeze(1)


def _sum_to_float(values) -> float:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    total = sum(float(v) for v in values if not isinstance(v, torch.Tensor))
    if tensors:
        total += torch.stack([t.detach().reshape(()).double() for t in tensors]).sum().item()
    return total


def _base2_mean(total_nats: float, count: float) -> float:
    return total_nats / count / math.log(2) if count else float("nan")


def perplexity(loss_base2: float) -> float:
    try:
        return 2.0**loss_base2
    except OverflowError:
        return float("inf")
