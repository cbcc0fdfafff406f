"""--criterion vocab_parallel_cross_entropy: cross-entropy over logits split by vocabulary across the ranks of
a tensor-parallel group (upstream's name, from its model_parallel criterions), on PyTorch's loss_parallel.

With --model-parallel-size N the output projection leaves the logits as a DTensor split over the vocabulary
(fairseq.distributed.tensor_parallel): each rank holds [tokens, vocab / N]. The loss is then computed without
gathering them: the log-sum-exp and the target's logit are reduced across the group (three small all-reduces
of one value per token), which avoids an all-gather of [tokens, vocab] logits and a full-vocabulary softmax on
every rank. On plain logits (one process, no tensor parallelism, evaluation) it is --criterion
cross_entropy, the same numbers. The logging outputs and their reduction are cross_entropy's.
"""

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import (
    CrossEntropyCriterion,
    CrossEntropyCriterionConfig,
    chunk_rows,
    token_cross_entropy,
)
from fairseq.runtime.dtensor import is_dtensor

# The registry imports every criterion to list --criterion's choices: torch.distributed.tensor (~1 s) is
# imported only where DTensor logits are at hand.
if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class _LossParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy (nats, fp32) of vocabulary-split DTensor logits [N, V].

    loss_parallel's sharded softmax must run its backward inside the context too, while the trainer calls
    backward() long after the criterion returned; so the gradient is taken here, in forward, and handed
    back in backward (scaled by the incoming gradient). As in cross_entropy.py, rows are upcast to fp32 a
    chunk at a time: besides the logits, one fp32 chunk and the [N, V / tp] gradient in the logits' dtype
    (the tensor backward would have made anyway) exist; the logits themselves are not kept.
    """

    @staticmethod
    def forward(ctx, logits: "DTensor", target: torch.Tensor, ignore_index: int, rows: int):
        from torch.distributed.tensor import DTensor  # deferred: startup (~1 s to import)
        from torch.distributed.tensor.parallel import loss_parallel  # deferred: startup

        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(logits.to_local()) if want_grad else None
        total = torch.zeros((), dtype=torch.float32, device=grad.device if want_grad else target.device)
        with torch.enable_grad(), loss_parallel():
            for start in range(0, logits.size(0), rows):
                chunk = logits[start : start + rows].detach().requires_grad_(want_grad)
                loss = F.cross_entropy(
                    chunk.float(), target[start : start + rows], ignore_index=ignore_index, reduction="sum"
                )
                if want_grad:
                    grad[start : start + rows] = torch.autograd.grad(loss, chunk)[0].to_local()
                total += loss.detach().to_local()
        ctx.grad = (
            None
            if grad is None
            else DTensor.from_local(
                grad, logits.device_mesh, logits.placements, shape=logits.shape, stride=logits.stride()
            )
        )
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        from torch.distributed.tensor import DTensor  # deferred: startup

        grad, ctx.grad = ctx.grad, None
        local = grad.to_local().mul_(grad_loss.to(grad.dtype))
        return (
            DTensor.from_local(local, grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride()),
            None,
            None,
            None,
        )


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Summed next-token cross-entropy in nats (fp32 scalar) of [N, V] logits, split or not."""
    if is_dtensor(logits):
        if not any(p.is_shard(logits.ndim - 1) for p in logits.placements):
            logits = logits.full_tensor()
        else:
            rows = chunk_rows(logits.to_local().size(-1))
            return _LossParallelCrossEntropy.apply(logits, target, ignore_index, rows)
    return token_cross_entropy(logits, target, ignore_index).sum()


@register_criterion("vocab_parallel_cross_entropy", dataclass=CrossEntropyCriterionConfig)
class VocabParallelCrossEntropyCriterion(CrossEntropyCriterion):
    def compile_loss(self, backend: str = "inductor") -> None:
        """Not compiled: the vocabulary-split loss exchanges per-row statistics between ranks (not measured
        compiled); --compile still compiles the layers."""

    def forward(self, model, sample, reduce: bool = True):
        if not reduce:
            return super().forward(model, sample, reduce=False)
        net_output = model(**sample["net_input"])
        logits = net_output[0] if isinstance(net_output, tuple) else net_output
        target = sample["target"]
        loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), target.reshape(-1), self.padding_idx)
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
