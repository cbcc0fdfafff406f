"""Tensor parallelism (`--model-parallel-size N`) for this fork's decoder, on PyTorch's own engine
(`torch.distributed.tensor.parallel`: DTensor parameters, ColwiseParallel / RowwiseParallel /
SequenceParallel, loss_parallel). The plan lives here, beside FSDP's; the model files hold no distributed
code. docs/parallelism.md describes the layout and its communication.

Per decoder layer (Megatron-LM's split, with sequence parallelism between the blocks):

- q_proj, k_proj, v_proj, fc1: column-parallel (each rank computes `heads / N` heads and `ffn / N` of the
  FFN; the attention's local head count is set here, from outside the model);
- out_proj, fc2: row-parallel; their partial sums are reduce-scattered along the sequence;
- self_attn_layer_norm, final_layer_norm, the residual stream and its dropout: sequence-parallel (each rank
  holds `tokens / N` positions), which divides those activations by N at no extra communication: an
  all-reduce is a reduce-scatter plus an all-gather, here placed around the norms instead of after them.

Around the layers: the token embedding is vocabulary-parallel (rows split over the ranks, outputs
all-reduced), the output projection too (the logits stay split over the vocabulary for
`--criterion vocab_parallel_cross_entropy`, or are all-gathered for `cross_entropy`), and everything
else (positions, norms, projections between dims) is replicated. Tied input/output embeddings stay one
parameter (both are split by rows).

The sequence enters the parallel region at the first layer (split into N equal parts, padded at the end to
a multiple of N: causal attention never lets earlier positions see the padding, which is cut off again when
the sequence leaves the region after the last layer), so any batch length works.

The flag checks (validate(cfg)) are in tensor_parallel_checks.py, which does not import torch.distributed.tensor:
this module does, and is imported only where a model is split (startup time).
"""

import logging
from typing import Optional

import torch
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

from fairseq.distributed.tensor_parallel_checks import (  # noqa: F401 (the checks' names, also imported from here)
    LOSS_PARALLEL_CRITERIA,
    UNSUPPORTED_OPTIONS,
    check_tensor_parallel_config,
    check_tensor_parallel_shape,
    suggested_size,
    uses_loss_parallel,
)

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
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
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
        return full.redistribute(self.mesh, [Replicate()]).to_local()[:, : self.length]


def layer_plan() -> dict:
    """The plan of one TransformerDecoderLayer (fairseq.modules.transformer_layer), pre- or post-norm."""
    sequence = Shard(1)
    return {
        "self_attn_layer_norm": SequenceParallel(use_local_output=True),
        # The attention is called as self_attn(x, incremental_state): gather the sequence for q/k/v.
        "self_attn": PrepareModuleInput(input_layouts=(sequence, None), desired_input_layouts=(Replicate(), None)),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.out_proj": RowwiseParallel(output_layouts=sequence),
        "final_layer_norm": SequenceParallel(use_local_output=True),
        "fc1": ColwiseParallel(input_layouts=sequence),
        "fc2": RowwiseParallel(output_layouts=sequence),
    }


REPLICATED_DECODER_MODULES = ("embed_positions", "layernorm_embedding", "project_in_dim", "layer_norm",
                              "project_out_dim")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> nn.Module:
    """Split `model` (a FairseqLanguageModel whose decoder is fairseq.modules' TransformerDecoder) over the
    1-D mesh `tp_mesh`, in place; before activation checkpointing, compile and FSDP. `loss_parallel`: the
    logits come out as a DTensor split over the vocabulary (for vocab_parallel_cross_entropy), otherwise
    as a plain tensor of the whole vocabulary."""
    from fairseq.distributed.fsdp import transformer_layers
    from fairseq.modules.transformer_decoder import TransformerDecoder
    from fairseq.modules.transformer_layer import TransformerDecoderLayer

    decoder = getattr(model, "decoder", None)
    if not isinstance(decoder, TransformerDecoder):
        raise TypeError(f"--model-parallel-size has a plan for fairseq's TransformerDecoder only, not for "
                        f"{type(decoder).__name__} of {type(model).__name__}")
    tp = tp_mesh.size()
    layers = transformer_layers(model)
    for index, layer in enumerate(layers):
        if type(layer) is not TransformerDecoderLayer:
            raise TypeError(f"decoder layer {index} is a {type(layer).__name__}: the tensor-parallel plan covers "
                            "TransformerDecoderLayer (apply it before checkpointing, compile and FSDP)")
    heads = layers[0].self_attn.num_heads if len(layers) else tp
    ffn = layers[0].fc1.out_features if len(layers) else tp
    check_tensor_parallel_shape(tp, heads, ffn, decoder.embed_tokens.num_embeddings)
    if decoder.output_projection.out_features % tp:
        check_tensor_parallel_shape(tp, heads, ffn, decoder.output_projection.out_features, "--output-dictionary-size")

    tied = decoder.output_projection.weight is decoder.embed_tokens.weight
    if tied:  # split once, as the embedding; the projection gets the same DTensor back below
        decoder.output_projection.weight = nn.Parameter(torch.empty_like(decoder.embed_tokens.weight, device="meta"))
    logits = Shard(-1) if loss_parallel else Replicate()
    plan = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output_projection": ColwiseParallel(output_layouts=logits, use_local_output=not loss_parallel),
    }
    for name in REPLICATED_DECODER_MODULES:
        module = getattr(decoder, name, None)
        if module is not None and any(True for _ in module.parameters()):
            plan[name] = ReplicateParallel()
    parallelize_module(decoder, tp_mesh, plan)
    if tied:
        decoder.output_projection.weight = decoder.embed_tokens.weight
    for layer in layers:
        parallelize_module(layer, tp_mesh, layer_plan())
        layer.self_attn.num_heads = layer.self_attn.num_heads // tp  # heads computed on this rank
    if len(layers):
        region = SequenceRegion(tp_mesh)
        layers[0].register_forward_pre_hook(region.enter)
        layers[-1].register_forward_hook(region.leave)
        model._tensor_parallel_sequence_region = region
    left = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if left:
        raise TypeError(f"the tensor-parallel plan does not cover parameter(s) {', '.join(left[:5])} of "
                        f"{type(model).__name__}")
    logger.info(f"tensor parallelism over {tp} ranks: {len(layers)} layers split (q/k/v/fc1 by columns, "
                f"out_proj/fc2 by rows, norms sequence-parallel), vocabulary-parallel embedding and output"
                f"{' (logits kept split for the loss)' if loss_parallel else ''}")
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
    this plan applies to, read from the plan itself (the memory planner uses it)."""
    def dim(style, module, param_name):
        if isinstance(style, ColwiseParallel):
            return 1 if isinstance(module, nn.Embedding) else 0
        if isinstance(style, RowwiseParallel):
            if isinstance(module, nn.Embedding):
                return 0
            return 1 if param_name == "weight" else None
        return None

    decoder = model.decoder
    dims = {}
    root_styles = {"embed_tokens": RowwiseParallel(), "output_projection": ColwiseParallel()}
    for prefix, owner, styles in [("decoder.", decoder, root_styles)] + [
            (f"decoder.layers.{i}.", layer, layer_plan()) for i, layer in enumerate(decoder.layers)]:
        for path, style in styles.items():
            module = owner.get_submodule(path)
            for param_name, _ in module.named_parameters(recurse=False):
                dims[f"{prefix}{path}.{param_name}"] = dim(style, module, param_name)
    return {name: dims.get(name) for name, _ in model.named_parameters()}
