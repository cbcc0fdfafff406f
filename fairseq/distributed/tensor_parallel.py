"""Tensor parallelism (`--model-parallel-size N`) on PyTorch's own engine (`torch.distributed.tensor.parallel`:
DTensor parameters, ColwiseParallel / RowwiseParallel / SequenceParallel, loss_parallel): the generic machinery
that applies a model's own plan. The model says what is split and how (`model.tensor_parallel_plan()`: module
paths -> style names, fairseq.models.fairseq_model.TENSOR_PARALLEL_STYLES; transformer_lm's is Megatron-LM's
split with sequence parallelism between the blocks); this module turns the names into DTensor styles, splits
the sequence where the plan says, keeps tied parameters tied and checks that every parameter is covered.
docs/parallelism.md describes the layout and its communication.

The sequence enters the parallel region at the plan's first module (split into N equal parts, padded at the end
to a multiple of N: causal attention never lets earlier positions see the padding, which is cut off again when
the sequence leaves the region after the plan's last module), so any batch length works.

The flag checks (validate(cfg)) are in tensor_parallel_checks.py, which does not import torch.distributed.tensor:
this module does, and is imported only where a model is split (startup time).
"""

import logging
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from fairseq.distributed.float8 import casts_tensorwise
from fairseq.distributed.tensor_parallel_checks import check_tensor_parallel_shape, model_plan
from fairseq.models.fairseq_model import TENSOR_PARALLEL_STYLES

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ styles


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over the TP mesh (DTensor, Replicate), plain tensors in and out.

    For the parts of the model that are not split: every parameter then lives on one mesh, which FSDP2 and
    the optimizer's multi-tensor kernels need; the computation is the same on every TP rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs_replicated(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def output_local(mod, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, None, inputs_replicated, output_local)


class SequenceRegion:
    """Where the residual stream is split along the sequence: from the first layer's input to the last
    layer's output. Entering pads the sequence at its end to a multiple of the TP size; leaving gathers the
    parts and cuts the padding off (the length is remembered between the two, per forward)."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.length: Optional[int] = None

    def enter(self, module, args):
        x, *rest = args
        self.length = x.size(1)
        pad = -self.length % self.mesh.size()
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        # Replicate -> Shard is a local slice; in backward the gradient parts are all-gathered.
        x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return (x.redistribute(self.mesh, [Shard(1)]).to_local(), *rest)

    def leave(self, module, args, output):
        full = DTensor.from_local(output, self.mesh, [Shard(1)], run_check=False)
        full = full.redistribute(self.mesh, [Replicate()]).to_local()[:, : self.length]
        # FSDP2 warns about a layer output that is a view (an in-place op on it would skip the layer's backward
        # hook): the gathered sequence is one, so it is copied (once per forward, after the last layer).
        return full.clone() if full._base is not None else full


# Styles whose Linear inputs torchao can cast to float8 before they are all-gathered (half the bytes of bf16)
FLOAT8_STYLES = ("colwise", "colwise_from_sequence", "rowwise_to_sequence", "gather_sequence")


def build_style(name: str, loss_parallel: bool = False, float8: bool = False) -> ParallelStyle:
    """The DTensor style of a TENSOR_PARALLEL_STYLES name. `loss_parallel`: a vocab_output's logits come out
    as a DTensor split over the vocabulary (for vocab_parallel_cross_entropy), else whole and plain. `float8`:
    the module's Linears are tensorwise Float8Linear (`--fp8`, converted before the split): torchao's float8
    styles, which cast activations before the all-gather and keep the gradients' casts in float8."""
    sequence = Shard(1)
    if float8 and name in FLOAT8_STYLES:
        return _float8_style(name)
    if name == "colwise":
        return ColwiseParallel()
    if name == "colwise_from_sequence":
        return ColwiseParallel(input_layouts=sequence)
    if name == "rowwise_to_sequence":
        return RowwiseParallel(output_layouts=sequence)
    if name == "sequence_norm":
        return SequenceParallel(use_local_output=True)
    if name == "gather_sequence":  # the first input only (the attention's incremental_state passes through)
        return PrepareModuleInput(input_layouts=(sequence, None), desired_input_layouts=(Replicate(), None))
    if name == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "vocab_output":
        return ColwiseParallel(
            output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
        )
    if name == "replicate":
        return ReplicateParallel()
    raise ValueError(f"unknown tensor-parallel style {name!r} (one of {', '.join(TENSOR_PARALLEL_STYLES)})")


def _collectives_take_float8(tp_mesh: DeviceMesh) -> bool:
    """NCCL all-gathers float8 tensors; gloo refuses their dtype ("Invalid scalar type"), so on CPU ranks the
    Float8Linear modules are split with the plain styles (activations gathered in bf16, the matmuls still
    float8): what the CPU tests of --fp8 with tensor parallelism run."""
    return dist.get_backend(tp_mesh.get_group()) == "nccl"


def _float8_style(name: str) -> ParallelStyle:
    from torchao.float8.float8_tensor_parallel import (  # deferred: optional
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    sequence = Shard(1)
    if name == "colwise":
        return Float8ColwiseParallel()
    if name == "colwise_from_sequence":
        return Float8ColwiseParallel(input_layouts=sequence)
    if name == "rowwise_to_sequence":
        return Float8RowwiseParallel(output_layouts=sequence)
    return PrepareFloat8ModuleInput(input_layouts=(sequence, None), desired_input_layouts=(Replicate(), None))


def _untie(model: nn.Module, paths) -> list:
    """A parameter shared by two planned modules is split once, as the first one's: the later owners get a
    placeholder now and the split parameter back after (`_retie`). Returns [(module, name, source, name)]."""
    owners, ties = {}, []
    for path in paths:
        module = model.get_submodule(path)
        for name, param in module.named_parameters(recurse=False):
            if id(param) in owners:
                ties.append((module, name) + owners[id(param)])
                setattr(module, name, nn.Parameter(torch.empty_like(param, device="meta")))
            else:
                owners[id(param)] = (module, name)
    return ties


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> nn.Module:
    """Split `model` over the 1-D mesh `tp_mesh` by its own plan (`model.tensor_parallel_plan()`), in place;
    after the float8 conversion (--fp8: tensorwise Float8Linear modules get torchao's float8 styles), before
    activation checkpointing, compile and FSDP. `loss_parallel`: the logits come out as a DTensor split over the
    vocabulary (for vocab_parallel_cross_entropy), otherwise as a plain tensor of the whole vocabulary."""
    plan = model_plan(model)
    tp = tp_mesh.size()
    check_tensor_parallel_shape(tp, plan.heads, plan.ffn, plan.vocab)
    if plan.output_vocab % tp:
        check_tensor_parallel_shape(tp, plan.heads, plan.ffn, plan.output_vocab, "--output-dictionary-size")
    ties = _untie(model, plan.styles)
    float8, gathers_float8 = [], _collectives_take_float8(tp_mesh)
    for path, name in plan.styles.items():
        module = model.get_submodule(path)
        cast_first = gathers_float8 and casts_tensorwise(module)
        if cast_first and name in FLOAT8_STYLES:
            float8.append(path)
        parallelize_module(module, tp_mesh, build_style(name, loss_parallel, float8=cast_first))
    for module, name, source, source_name in ties:
        setattr(module, name, getattr(source, source_name))
    if plan.sequence_parallel is not None:
        first, last = plan.sequence_parallel
        region = SequenceRegion(tp_mesh)  # kept alive by its hooks
        model.get_submodule(first).register_forward_pre_hook(region.enter)
        model.get_submodule(last).register_forward_hook(region.leave)
    left = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if left:
        raise TypeError(
            f"the tensor-parallel plan does not cover parameter(s) {', '.join(left[:5])} of {type(model).__name__}"
        )
    logger.info(
        f"tensor parallelism over {tp} ranks: {plan.description}"
        f"{' (logits kept split for the loss)' if loss_parallel else ''}"
        f"{f'; {len(float8)} modules all-gather their input in float8' if float8 else ''}"
    )
    return model


def reduce_partial_gradients(model: nn.Module) -> None:
    """Without FSDP2 (tensor parallelism alone), a replicated parameter used on split activations (the norms,
    the row-parallel biases) gets its gradient as a pending sum over the TP group (Partial); FSDP2 reduces
    those itself. Here each one is all-reduced as soon as it is accumulated, so every gradient has its
    parameter's placement (what clipping and the optimizer expect)."""

    def reduce(param):
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(grad.device_mesh, param.placements)

    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(reduce)


def split_dims(model: nn.Module) -> dict:
    """{parameter name: the dim --model-parallel-size splits it along, or None if replicated} for a model
    with a plan, read from the plan itself (the memory planner uses it)."""

    def dim(style, module, param_name):
        if isinstance(style, ColwiseParallel):
            return 1 if isinstance(module, nn.Embedding) else 0
        if isinstance(style, RowwiseParallel):
            if isinstance(module, nn.Embedding):
                return 0
            return 1 if param_name == "weight" else None
        return None

    dims = {}
    for path, name in model_plan(model).styles.items():
        module = model.get_submodule(path)
        for param_name, _ in module.named_parameters(recurse=False):
            dims.setdefault(f"{path}.{param_name}", dim(build_style(name), module, param_name))
    return {name: dims.get(name) for name, _ in model.named_parameters()}
