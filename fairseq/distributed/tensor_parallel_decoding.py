"""Tensor parallelism for decoding (`fairseq-serve --model-parallel-size N`): the model's own plan
(`model.tensor_parallel_plan()`, what training splits; fairseq.distributed.tensor_parallel) applied to a loaded
inference model over a 1-D mesh of N ranks, each rank keeping its part of every split weight as a plain tensor.

Training splits the residual stream along the sequence between the blocks (norms on N parts of it); a decode step
feeds one token per row, which that split would pad to N positions (and the padding would enter the KV cache).
So every rank keeps the whole sequence between the blocks (Megatron-LM's split without sequence parallelism):

- `colwise` / `colwise_from_sequence` (q/k/v, fc1): the Linear's output features split, no communication; each
  rank computes num_heads / N heads and caches their keys and values, and ffn / N of the FFN;
- `rowwise_to_sequence` (out_proj, fc2): the input features split, the outputs all-reduced, then the bias added;
- `vocab_embedding`: the embedding's rows (the vocabulary) split: ids outside a rank's rows give zeros, the
  vectors are all-reduced;
- `vocab_output`: the output projection's rows split, the logits all-gathered: every rank holds the whole
  distribution, so every rank draws the same token from the same seed;
- the others (`sequence_norm`, `gather_sequence`, `replicate`) only move the sequence split or replicate for FSDP2:
  those modules stay whole (every rank loaded the same checkpoint).

Plain tensors and `torch.distributed` collectives rather than DTensor styles: DTensor's dispatch costs tens of
microseconds per operation on the host, more than a decode step of a small model computes. A parameter shared by
two planned modules (tied input and output embeddings: both split by vocabulary rows) stays shared.
"""

import logging
from typing import Callable, Dict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh


from fairseq.distributed.tensor_parallel_checks import check_tensor_parallel_shape, model_plan

logger = logging.getLogger(__name__)


class _Part:
    """This rank's place in the mesh, and the parts of the parameters split so far (a shared one is split once)."""

    def __init__(self, mesh: DeviceMesh):
        self.group, self.rank, self.size = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        self.done: Dict[int, nn.Parameter] = {}

    def of(self, param, dim: int):
        """This rank's part of `param` along `dim` (None for None), a parameter of its own."""
        if param is None:
            return None
        if id(param) not in self.done:
            width = param.size(dim) // self.size
            part = param.detach().narrow(dim, self.rank * width, width).clone()
            self.done[id(param)] = nn.Parameter(part, requires_grad=False)
        return self.done[id(param)]


class ColumnParallelLinear(nn.Module):
    """A Linear's output features [rank * out / N, (rank + 1) * out / N): this rank's part of the output."""

    def __init__(self, linear: nn.Linear, part: _Part):
        super().__init__()
        self.weight, self.bias = part.of(linear.weight, 0), part.of(linear.bias, 0)
        self.in_features, self.out_features = self.weight.size(1), self.weight.size(0)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """A Linear over this rank's part of the input features: partial outputs all-reduced, then the bias."""

    def __init__(self, linear: nn.Linear, part: _Part):
        super().__init__()
        self.weight, self.bias, self.group = part.of(linear.weight, 1), linear.bias, part.group
        self.in_features, self.out_features = self.weight.size(1), self.weight.size(0)

    def forward(self, x):
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding: the vectors of the ids it holds, zeros for the others, all-reduced."""

    def __init__(self, embedding: nn.Embedding, part: _Part):
        super().__init__()
        self.weight, self.group = part.of(embedding.weight, 0), part.group
        self.start, self.rows = part.rank * self.weight.size(0), self.weight.size(0)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx

    def forward(self, tokens):
        local = tokens - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelOutput(ColumnParallelLinear):
    """The output projection's rows (the vocabulary) on this rank; the logits of every rank gathered whole."""

    def __init__(self, linear: nn.Linear, part: _Part):
        super().__init__(linear, part)
        self.group, self.size = part.group, part.size

    def forward(self, x):
        local = super().forward(x).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


# The plan's style names (fairseq.models.fairseq_model.TENSOR_PARALLEL_STYLES) -> the module that replaces a
# planned one; the styles left out keep their module whole.
DECODING_MODULES: Dict[str, Callable] = {
    "colwise": ColumnParallelLinear,
    "colwise_from_sequence": ColumnParallelLinear,
    "rowwise_to_sequence": RowParallelLinear,
    "vocab_embedding": VocabParallelEmbedding,
    "vocab_output": VocabParallelOutput,
}
WHOLE = ("sequence_norm", "gather_sequence", "replicate")


def split_for_decoding(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split the inference model `model` over `tp_mesh` by its plan, in place, its parts on the device the model
    is on (before any q/k/v fusion or quantization). One-line ValueError when N does not divide the heads, the
    FFN width or the vocabulary; TypeError for a model without a plan."""
    plan = model_plan(model)
    tp = tp_mesh.size()
    check_tensor_parallel_shape(tp, plan.heads, plan.ffn, plan.vocab)
    if plan.output_vocab % tp:
        check_tensor_parallel_shape(tp, plan.heads, plan.ffn, plan.output_vocab, "--output-dictionary-size")
    part = _Part(tp_mesh)
    for path, name in plan.styles.items():
        if name in WHOLE:
            continue
        if name not in DECODING_MODULES:
            raise ValueError(f"the tensor-parallel plan names style {name!r} for {path}, which decoding cannot split")
        parent, _, child = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, DECODING_MODULES[name](getattr(owner, child), part))
    logger.info(
        f"tensor-parallel decoding over {tp} ranks: {plan.heads // tp} of {plan.heads} heads, {plan.ffn // tp} "
        f"of {plan.ffn} FFN columns and 1/{tp} of the vocabulary on each rank (no sequence parallelism)"
    )
    return model
