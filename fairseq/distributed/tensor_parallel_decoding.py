"""Tensor parallelism for decoding (`fairseq-serve --model-parallel-size N`): the model's own plan
(`model.tensor_parallel_plan()`, what training splits; fairseq.distributed.tensor_parallel) applied to a loaded
inference model on a 1-D mesh of N ranks, without the plan's sequence parallelism.

Training splits the residual stream along the sequence between the blocks (norms on N parts of it); a decode
step feeds one token per row, which that split would pad to N positions (and the padding would enter the KV
cache). So here every rank keeps the whole sequence between the blocks (Megatron-LM's split without sequence
parallelism): q/k/v and fc1 split by columns (each rank computes heads / N heads and caches their keys and
values, fc1's ffn / N), out_proj and fc2 by rows (their outputs all-reduced), the embedding and the output
projection split over the vocabulary (the logits all-gathered: every rank sees the whole distribution and draws
the same token from the same seed). Norms, positions and the other replicated parts stay plain tensors: each
rank loaded the same checkpoint, so they are equal on every rank.
"""

import logging
from typing import Optional

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from fairseq.distributed.tensor_parallel import _untie, model_plan
from fairseq.distributed.tensor_parallel_checks import check_tensor_parallel_shape

logger = logging.getLogger(__name__)

# The plan's styles that only move the sequence split (or replicate parameters for FSDP2): nothing to do when
# every rank holds the whole sequence.
_PLAIN = ("sequence_norm", "gather_sequence", "replicate")


def decoding_style(name: str) -> Optional[ParallelStyle]:
    """The DTensor style of a plan's style name (fairseq.models.fairseq_model.TENSOR_PARALLEL_STYLES) with the
    whole sequence on every rank; None: the module stays as it is."""
    if name in ("colwise", "colwise_from_sequence"):
        return ColwiseParallel()
    if name == "rowwise_to_sequence":
        return RowwiseParallel()
    if name == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "vocab_output":
        return ColwiseParallel(output_layouts=Replicate())
    if name in _PLAIN:
        return None
    raise ValueError(f"the tensor-parallel plan names style {name!r}, which decoding does not split")


def split_for_decoding(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split the inference model `model` over `tp_mesh` by its plan, in place (before any q/k/v fusion or
    quantization: they refuse split weights). One-line ValueError when N does not divide the heads, the FFN
    width or the vocabulary; TypeError for a model without a plan."""
    plan = model_plan(model)
    tp = tp_mesh.size()
    check_tensor_parallel_shape(tp, plan.heads, plan.ffn, plan.vocab)
    if plan.output_vocab % tp:
        check_tensor_parallel_shape(tp, plan.heads, plan.ffn, plan.output_vocab, "--output-dictionary-size")
    styles = {path: decoding_style(name) for path, name in plan.styles.items()}
    styles = {path: style for path, style in styles.items() if style is not None}
    ties = _untie(model, styles)
    for path, style in styles.items():
        parallelize_module(model.get_submodule(path), tp_mesh, style)
    for module, name, source, source_name in ties:
        setattr(module, name, getattr(source, source_name))
    logger.info(
        f"tensor-parallel decoding over {tp} ranks: {plan.heads // tp} of {plan.heads} heads, {plan.ffn // tp} "
        f"of {plan.ffn} FFN columns and 1/{tp} of the vocabulary on each rank (no sequence parallelism)"
    )
    return model
