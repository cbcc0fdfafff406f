"""Per-GPU memory of training a transformer_lm, walked through one training step (see docs/memory_planner.md).

The arithmetic behind `python -m fairseq.planning.plan_memory`, free of any command line. The model's shapes come from
the real model code built on the meta device (`model_shape`), so parameter counts are exact; everything else
is a model of what this fork allocates, in bytes, at the moments of a training step where memory can peak:

- forward, last layer; the loss backward (logits gradient); the backward of every decoder layer; the
  embedding backward; the root's reduce-scatter; the optimizer step.

The peak is the largest of those snapshots (`MemoryPlan.peak`), which is what `max_cuda_gb_allocated`
measures. `MemoryPlan.required_bytes` adds the allocator margin and what lies outside PyTorch; a plan fits when that is at most the
device's memory.

Calibration: every assumption that a measurement could correct is a named constant in
fairseq/planning/memory_calibration.py.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from fairseq.criterions.cross_entropy import chunk_rows
from fairseq.distributed.tensor_parallel import split_dims

# the calibration constants (memory_calibration), under the names plan_memory and the tests read as mm.NAME
from fairseq.planning.memory_calibration import (  # noqa: F401
    ADAM_STATE_BYTES, ALLOCATOR_MARGIN_FRACTION, DDP_GRADIENT_BUCKET_COPY, DTYPE_BYTES, FLASH_DQ_ACCUM_BYTES,
    FLOAT8_BYTES, FSDP_FORWARD_BUFFERS, FSDP_IMPLICIT_BACKWARD_PREFETCH, FSDP_RETAINED_REDUCE_BUFFERS, GIB,
    GRAD_BYTES, LOSS_FP32_CHUNK_COPIES, MASTER_PARAM_BYTES, NON_PYTORCH_OVERHEAD_GIB, REDUCE_BYTES,
)


# ------------------------------------------------------------------------------------------ model shape


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a transformer_lm: parameter shapes and the dims activations scale with."""

    total_params: int  # unique parameters of the built model (tied weights once)
    num_layers: int
    layer_param_shapes: Tuple[Tuple[int, ...], ...]  # one decoder layer (all layers are identical)
    layer_norm_params: int  # of those, the layer norms' (autocast runs layer_norm in fp32: never cast)
    root_param_shapes: Tuple[Tuple[int, ...], ...]  # everything else: embeddings, norms, output projection
    vocab_size: int
    embed_dim: int
    ffn_dim: int
    heads: int
    output_dim: int
    output_projection_tied: bool
    activation_fn: str
    dropout: float
    activation_dropout: float
    layernorm_embedding: bool
    # Per parameter (same order as the shapes): the dim --model-parallel-size splits, None when replicated
    # (fairseq.distributed.tensor_parallel.split_dims, read from the tensor-parallel plan itself).
    layer_param_splits: Tuple[Optional[int], ...] = ()
    root_param_splits: Tuple[Optional[int], ...] = ()

    @property
    def layer_params(self) -> int:
        return sum(math.prod(s) for s in self.layer_param_shapes)

    @property
    def root_params(self) -> int:
        return sum(math.prod(s) for s in self.root_param_shapes)

    @property
    def output_projection_params(self) -> int:
        return self.vocab_size * self.output_dim

    def with_layers(self, num_layers: int) -> "ModelShape":
        """The same layer shape, `num_layers` deep (what `--decoder-layers num_layers` would build)."""
        total = num_layers * self.layer_params + self.root_params
        return dataclasses.replace(self, num_layers=num_layers, total_params=total)


def model_shape(cfg, vocab_size: int, padding_idx: int = 1) -> ModelShape:
    """Build the model of `cfg` on the meta device with the real model code and read its shapes.

    `padding_idx` 1 is what fairseq's Dictionary gives; it sets the learned position table's offset rows.
    """
    from fairseq.models.transformer_lm import TransformerLanguageModel

    cfg = dataclasses.replace(cfg)  # build() fills max_target_positions in place
    with torch.device("meta"):
        model = TransformerLanguageModel.build(cfg, vocab_size, padding_idx)
    layers = model.transformer_layers()
    layer_ids = {id(p) for p in layers.parameters()}
    layer_shapes = [tuple(tuple(p.shape) for p in layer.parameters()) for layer in layers]
    if any(s != layer_shapes[0] for s in layer_shapes):
        raise ValueError("decoder layers of different shapes: the planner assumes identical layers")
    root = tuple(tuple(p.shape) for p in model.parameters() if id(p) not in layer_ids)
    splits = split_dims(model)
    root_splits = tuple(splits[n] for n, p in model.named_parameters() if id(p) not in layer_ids)
    probe = model
    if layer_shapes:
        one_layer = layer_shapes[0]
    else:  # --decoder-layers 0: still know a layer's shape, for --max-layers-that-fit
        with torch.device("meta"):
            probe = TransformerLanguageModel.build(dataclasses.replace(cfg, decoder_layers=1), vocab_size, padding_idx)
        layers = probe.transformer_layers()
        one_layer = tuple(tuple(p.shape) for p in layers[0].parameters())
    probe_splits = split_dims(probe)
    layer_splits = tuple(probe_splits[f"decoder.layers.0.{n}"] for n, _ in layers[0].named_parameters())
    norm_params = sum(p.numel() for m in layers[0].modules() if isinstance(m, torch.nn.LayerNorm)
                      for p in m.parameters())
    activation_dropout = cfg.activation_dropout or cfg.relu_dropout or 0.0
    shape = ModelShape(
        total_params=sum(p.numel() for p in model.parameters()),
        num_layers=len(model.transformer_layers()), layer_param_shapes=one_layer, layer_norm_params=norm_params,
        root_param_shapes=root,
        vocab_size=vocab_size, embed_dim=cfg.decoder_embed_dim, ffn_dim=cfg.decoder_ffn_embed_dim,
        heads=cfg.decoder_attention_heads, output_dim=cfg.decoder_output_dim,
        output_projection_tied=bool(cfg.share_decoder_input_output_embed), activation_fn=cfg.activation_fn,
        dropout=cfg.dropout, activation_dropout=activation_dropout, layernorm_embedding=cfg.layernorm_embedding,
        layer_param_splits=layer_splits, root_param_splits=root_splits,
    )
    assert shape.total_params == shape.num_layers * shape.layer_params + shape.root_params
    return shape


def local_shape(shape: ModelShape, tp: int) -> ModelShape:
    """What one rank of a tensor-parallel group of `tp` holds: every split parameter dim divided by `tp`, and
    the per-rank widths activations scale with (vocabulary, heads, FFN: each rank computes its share)."""
    if tp == 1:
        return shape

    def split(shapes, dims):
        return tuple(tuple(n // tp if i == d else n for i, n in enumerate(s)) for s, d in zip(shapes, dims))

    layer = split(shape.layer_param_shapes, shape.layer_param_splits)
    root = split(shape.root_param_shapes, shape.root_param_splits)
    local = dataclasses.replace(shape, layer_param_shapes=layer, root_param_shapes=root,
                                vocab_size=shape.vocab_size // tp, heads=shape.heads // tp, ffn_dim=shape.ffn_dim // tp,
                                total_params=0)
    return dataclasses.replace(local, total_params=local.num_layers * local.layer_params + local.root_params)


# ------------------------------------------------------------------------------------------ training setup


@dataclass(frozen=True)
class TrainingSetup:
    """The training flags memory depends on, per GPU."""

    gpus: int = 1
    batch_size: int = 1  # sequences per data-parallel rank per micro-batch (a tensor-parallel group shares them)
    tokens_per_sample: int = 2048
    dtype: str = "fp32"  # compute dtype: fp32, bf16 or fp16 (parameters and optimizer stay fp32)
    fully_sharded: bool = True  # --ddp-backend fully_sharded; otherwise replicated (DDP)
    checkpoint_activations: bool = False
    offload_activations: bool = False
    reshard_after_forward: bool = True  # False: --no-reshard-after-forward
    cpu_offload: bool = False
    forward_prefetch: bool = False
    prefetch_depth: int = 1
    sync_free: bool = False  # bounds reserved memory, not allocated memory: no term of its own
    update_freq: int = 1
    tensor_parallel: int = 1  # --model-parallel-size (sequence-parallel norms, vocabulary-parallel loss)
    shard_group: int = 0  # --fsdp-shard-group-size: ranks that shard the states (0: every data-parallel rank)
    float8: bool = False  # --fp8 (the decoder layers' Linear layers)
    float8_all_gather: bool = False  # --fp8-fsdp-all-gather: the layers' weight matrices gathered in float8
    compiled: bool = False  # --compile (changes what a float8 layer saves; nothing in bf16)

    @property
    def data_parallel(self) -> int:
        return self.gpus // self.tensor_parallel

    @property
    def shard_ranks(self) -> int:
        """How many ranks FSDP2 shards each (tensor-parallel-local) parameter over."""
        return self.shard_group or self.data_parallel

    @property
    def tokens(self) -> int:
        return self.batch_size * self.tokens_per_sample

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def autocast(self) -> bool:
        """DDP runs bf16/fp16 under autocast (fp32 weights, cast per op); FSDP2 casts the parameters."""
        return not self.fully_sharded and self.dtype != "fp32"


# ------------------------------------------------------------------------------------------ activations


def _ffn_saved_tensors(activation_fn: str, activation_dropout: bool) -> int:
    """How many ffn-wide tensors one layer saves: fc1's output if the activation needs its input (gelu),
    the activation's output if it needs that (relu, tanh), and fc2's input (often one of those)."""
    if activation_fn in ("gelu", "gelu_accurate", "gelu_fast"):
        return 2  # gelu saves its input; fc2 saves gelu's output (or the dropout's)
    if activation_fn in ("relu", "tanh"):
        return 2 if activation_dropout else 1  # the activation's output is fc2's input unless dropped out
    return 1  # linear: fc2's input is fc1's output (or the dropout's)


def layer_activation_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """Bytes one decoder layer saves for its backward, without checkpointing.

    Per token, with c the compute dtype's bytes (2 in bf16/fp16): the two layer-norm inputs (residual dtype),
    the q/k/v projections' input, q, k, v, the attention output (saved by SDPA and by out_proj as one tensor),
    fc1's input: 6 embed-wide tensors in c; the ffn-wide tensors of `_ffn_saved_tensors`; 1-byte dropout
    masks (2 residual dropouts, one after the activation); SDPA's fp32 logsumexp per head. Flash/efficient
    SDPA keeps no seq x seq matrix. For gelu, ffn = 4d and dropout > 0 in bf16 that is 34 bytes per token and
    embed dim, Korthikanti et al. 2022's 34*s*b*h minus its 5*a*s^2*b attention-score term.

    Under DDP autocast the residual stream stays fp32 and each of q/k/v casts the norm's output separately.

    With tensor parallelism (t ranks; `shape` is then the local one, see `local_shape`): the residual stream,
    the norms' inputs and the residual dropout masks are split along the sequence (/ t); q, k, v, the
    attention output and the ffn-wide tensors along the features (/ t); the inputs of q/k/v and fc1 are the
    all-gathered sequence, which the column-parallel matmuls save whole.

    With --fp8 --compile (tensorwise; measured on an H200 at 32 x 2560, docs/benchmarks_h200.md) the compiled layer
    saves the float8 casts of the inputs of q/k/v and fc1 (1 byte) instead of the bf16 tensors, and
    recomputes fc2's float8 input from fc1's output instead of saving it: 10 bytes per token and embed dim
    less than bf16, against 11.8 measured (the plan stays on the safe side). Eager float8 saves what bf16
    saves (measured: the same peak).
    """
    d, f, c, t = shape.embed_dim, shape.ffn_dim, setup.compute_bytes, setup.tensor_parallel
    residual = 4 if setup.autocast else c
    qkv_inputs = 3 if setup.autocast else 1
    compiled_float8 = setup.float8 and setup.compiled
    split = 2 * d * residual + 4 * d * c + (2 * d if shape.dropout > 0 else 0)  # per token, divided by t
    whole = (qkv_inputs + 1) * d * (FLOAT8_BYTES if compiled_float8 else c)  # the inputs of q/k/v and fc1
    ffn_tensors = _ffn_saved_tensors(shape.activation_fn, shape.activation_dropout > 0)
    if compiled_float8:
        ffn_tensors -= 1  # fc2's input, recomputed
        whole += f * FLOAT8_BYTES if ffn_tensors == 0 else 0  # no other ffn-wide tensor to recompute it from
    whole += ffn_tensors * f * c
    whole += (f if shape.activation_dropout > 0 else 0) + 4 * shape.heads
    return setup.tokens * whole + setup.tokens * split // t


def checkpointed_layer_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """With --checkpoint-activations a layer keeps only its input (2*s*b*d in bf16); none on the GPU with
    --offload-activations (it is held in pinned host memory)."""
    if setup.offload_activations:
        return 0
    residual = 4 if setup.autocast else setup.compute_bytes
    return setup.tokens * shape.embed_dim * residual // setup.tensor_parallel  # split along the sequence


def saved_layer_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    if setup.checkpoint_activations or setup.offload_activations:
        return checkpointed_layer_bytes(shape, setup)
    return layer_activation_bytes(shape, setup)


def backward_workspace_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """Gradients alive inside one layer's backward: the residual-stream gradient and the branch gradient
    (embed-wide each) plus the larger of the ffn-wide gradient and attention's dq, dk, dv with flash
    attention's fp32 dq accumulator."""
    d, f, c, t = shape.embed_dim, shape.ffn_dim, setup.compute_bytes, setup.tensor_parallel
    if t == 1:
        return setup.tokens * (2 * d * c + max(f * c, 3 * d * c + FLASH_DQ_ACCUM_BYTES * d))
    # Local heads and ffn; the residual gradients split along the sequence; the gathered input's gradient whole.
    return setup.tokens * (2 * d * c // t + max(f * c, (3 * d * c + FLASH_DQ_ACCUM_BYTES * d) // t) + d * c)


def root_activation_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """Saved outside the layers: the final norm's input and output (the output projection's input), the
    embedding dropout mask, the embedding layer norm's input."""
    d, c = shape.embed_dim, setup.compute_bytes
    residual = 4 if setup.autocast else c
    per_token = d * residual + shape.output_dim * c
    per_token += d if shape.dropout > 0 else 0
    per_token += d * residual if shape.layernorm_embedding else 0
    return setup.tokens * per_token


def logits_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """The loss backward's peak: the compute-dtype logits (saved by the loss), their gradient being written
    in the same dtype, and at most LOSS_FP32_CHUNK_COPIES chunks of rows in fp32 (the chunked eager loss)."""
    rows = min(setup.tokens, chunk_rows(shape.vocab_size))
    return (2 * setup.compute_bytes * setup.tokens + LOSS_FP32_CHUNK_COPIES * 4 * rows) * shape.vocab_size


# ------------------------------------------------------------------------------------------ the walk

# Snapshot keys -> the labels printed, in print order.
TERMS = {
    "parameters": "parameters (fp32)",
    "gradients": "gradients (fp32)",
    "optimizer_state": "optimizer state (Adam, 2 x fp32)",
    "ddp_buckets": "DDP gradient buckets (fp32)",
    "layers_in_flight": "full parameters of layers in flight",
    "layer_gradients": "current layer's full gradients (FSDP: + fp32 reduce-scatter buffers)",
    "root_parameters": "root full parameters (embeddings, output projection)",
    "root_gradients": "root full gradients (+ fp32 reduce-scatter buffer)",
    "autocast_copies": "autocast weight copies",
    "activations": "activations",
    "logits": "logits and loss (fp32)",
    "offload_staging": "CPU-offload staging copies",
}


@dataclass(frozen=True)
class Snapshot:
    """Bytes per GPU by term at one moment of the step."""

    phase: str
    terms: Dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())


@dataclass(frozen=True)
class MemoryPlan:
    shape: ModelShape
    setup: TrainingSetup
    snapshots: Tuple[Snapshot, ...]
    host_bytes: int  # per GPU, in host memory (--cpu-offload states, --offload-activations inputs)

    @property
    def peak(self) -> Snapshot:
        return max(self.snapshots, key=lambda s: s.total)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    @property
    def margin_bytes(self) -> int:
        return int(self.peak_bytes * ALLOCATOR_MARGIN_FRACTION) + int(NON_PYTORCH_OVERHEAD_GIB * GIB)

    @property
    def required_bytes(self) -> int:
        return self.peak_bytes + self.margin_bytes

    def fits(self, gpu_memory_gib: float) -> bool:
        return self.required_bytes <= gpu_memory_gib * GIB

    def snapshot(self, phase: str) -> Snapshot:
        for snap in self.snapshots:
            if snap.phase == phase:
                return snap
        raise KeyError(phase)


def sharded_numel(shapes, gpus: int) -> int:
    """Elements per rank: FSDP2 shards every parameter on dim 0, padded to a multiple of the world size."""
    return sum(math.ceil(s[0] / gpus) * math.prod(s[1:]) if s else 1 for s in shapes)


def _snapshot(phase: str, **terms: int) -> Snapshot:
    unknown = set(terms) - set(TERMS)
    assert not unknown, unknown
    return Snapshot(phase, {key: value for key, value in terms.items() if value})


def plan(shape: ModelShape, setup: TrainingSetup) -> MemoryPlan:
    """Walk one training step and return the per-GPU bytes at each moment that can be the peak."""
    _check_setup(setup)
    walk = _walk_fully_sharded if setup.fully_sharded else _walk_replicated
    snapshots, host = walk(local_shape(shape, setup.tensor_parallel), setup)
    return MemoryPlan(shape, setup, tuple(snapshots), host)


def _check_setup(setup: TrainingSetup) -> None:
    for name in ("gpus", "batch_size", "tokens_per_sample", "update_freq", "prefetch_depth"):
        if getattr(setup, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(setup, name)}")
    if setup.dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {setup.dtype!r}")
    if setup.tensor_parallel < 1 or setup.gpus % setup.tensor_parallel:
        raise ValueError(f"--model-parallel-size {setup.tensor_parallel} must divide the {setup.gpus} GPUs")
    if setup.shard_group < 0 or (setup.shard_group and setup.data_parallel % setup.shard_group):
        raise ValueError(f"--fsdp-shard-group-size {setup.shard_group} must divide the {setup.data_parallel} "
                         "data-parallel ranks")


def _walk_fully_sharded(shape: ModelShape, setup: TrainingSetup):
    n, c, layers = setup.shard_ranks, setup.compute_bytes, shape.num_layers
    layer_shard = sharded_numel(shape.layer_param_shapes, n)
    root_shard = sharded_numel(shape.root_param_shapes, n)
    all_shard = layers * layer_shard + root_shard
    gathered = n * layer_shard  # one layer's padded all-gather / reduce-scatter buffer, in elements
    root_gathered = n * root_shard
    full_layer = c * gathered  # bytes of one layer's gathered parameters
    if setup.float8_all_gather:  # the weight matrices travel and stay gathered in float8, the rest in c
        matrices = [s for s in shape.layer_param_shapes if len(s) == 2]
        others = [s for s in shape.layer_param_shapes if len(s) != 2]
        full_layer = n * (FLOAT8_BYTES * sharded_numel(matrices, n) + c * sharded_numel(others, n))
    on_gpu = 0 if setup.cpu_offload else 1
    states = dict(parameters=on_gpu * MASTER_PARAM_BYTES * all_shard,
                  optimizer_state=on_gpu * ADAM_STATE_BYTES * all_shard)
    staging = 2 * 4 * layer_shard if setup.cpu_offload else 0  # fp32 shard copied in; reduced shard copied out

    def grads(layers_done: int, root_done: bool) -> int:
        if setup.update_freq > 1:  # earlier micro-batches' gradients stay for the whole update
            layers_done, root_done = layers, True
        return on_gpu * GRAD_BYTES * (layers_done * layer_shard + (root_shard if root_done else 0))

    saved = saved_layer_bytes(shape, setup)
    full = layer_activation_bytes(shape, setup)
    root_full = c * root_gathered
    depth = setup.prefetch_depth if setup.forward_prefetch else 0
    backward_prefetch = setup.prefetch_depth if setup.forward_prefetch else FSDP_IMPLICIT_BACKWARD_PREFETCH
    if setup.reshard_after_forward:
        forward_flight = (FSDP_FORWARD_BUFFERS + depth) * full_layer
    else:  # every layer's parameters stay gathered, plus the last flat all-gather buffer
        forward_flight = (layers + 1) * full_layer
    kept_after_forward = 0 if setup.reshard_after_forward else layers * full_layer
    snaps = [
        _snapshot("forward, last layer", **states, gradients=grads(0, False),
                  layers_in_flight=forward_flight if layers else 0,
                  root_parameters=root_full, activations=layers * saved, offload_staging=staging),
        _snapshot("loss backward", **states, gradients=grads(0, False),
                  layers_in_flight=kept_after_forward, root_parameters=root_full,
                  activations=layers * saved + root_activation_bytes(shape, setup),
                  logits=logits_bytes(shape, setup)),
    ]
    output_grad = c * shape.output_projection_params
    for i in reversed(range(layers)):
        if setup.reshard_after_forward:
            flight = (1 + min(backward_prefetch, i)) * full_layer
        else:
            flight = (i + 1) * full_layer
        retained_reduce = REDUCE_BYTES * gathered * FSDP_RETAINED_REDUCE_BUFFERS if i < layers - 1 else 0
        snaps.append(_snapshot(
            f"backward, layer {i}", **states, gradients=grads(layers - 1 - i, False),
            layers_in_flight=flight,
            layer_gradients=c * gathered + retained_reduce,
            root_parameters=root_full, root_gradients=output_grad,
            activations=i * saved + full + backward_workspace_bytes(shape, setup),
            offload_staging=staging,
        ))
    # The embedding's gradient arrives while the output projection's is still held (a second V x d tensor
    # when the two are tied, summed into one afterwards).
    tied_extra = shape.output_projection_params if shape.output_projection_tied else 0
    snaps.append(_snapshot(
        "embedding backward", **states, gradients=grads(layers, False),
        layer_gradients=REDUCE_BYTES * gathered if layers else 0,
        root_parameters=root_full,
        root_gradients=c * (root_gathered + tied_extra),
    ))
    # FSDP2 frees the root's full parameters and the last layer's reduce buffer before the root reduces.
    snaps.append(_snapshot(
        "root reduce-scatter", **states, gradients=grads(layers, False),
        root_gradients=(c + REDUCE_BYTES) * root_gathered,
        offload_staging=4 * root_shard if setup.cpu_offload else 0,
    ))
    snaps.append(_snapshot("optimizer step", **states, gradients=grads(layers, True)))
    host = (1 - on_gpu) * (MASTER_PARAM_BYTES + GRAD_BYTES + ADAM_STATE_BYTES) * all_shard
    host += layers * checkpointed_layer_bytes(shape, dataclasses.replace(setup, offload_activations=False)) \
        if setup.offload_activations else 0
    return snaps, host


def _walk_replicated(shape: ModelShape, setup: TrainingSetup):
    """DDP: every rank holds every parameter, gradient and Adam state, plus DDP's gradient buckets. With tensor
    parallelism (`shape` local) the replicas are FSDP2's, which keep no buckets."""
    c, layers, total = setup.compute_bytes, shape.num_layers, shape.total_params
    states = dict(parameters=MASTER_PARAM_BYTES * total, optimizer_state=ADAM_STATE_BYTES * total,
                  ddp_buckets=GRAD_BYTES * total if DDP_GRADIENT_BUCKET_COPY and setup.tensor_parallel == 1 else 0)

    def grads(layers_done: int, root_done: bool) -> int:
        if setup.update_freq > 1:
            layers_done, root_done = layers, True
        return GRAD_BYTES * (layers_done * shape.layer_params + (shape.root_params if root_done else 0))

    # Autocast casts every linear's weight and bias (not the norms: layer_norm runs in fp32) once per forward
    # and caches the copy until autocast exits; linear saves it for backward unless the layer is recomputed.
    layer_cast = c * (shape.layer_params - shape.layer_norm_params) if setup.autocast else 0
    root_cast = c * shape.output_projection_params if setup.autocast else 0
    recomputed = setup.checkpoint_activations or setup.offload_activations
    saved_cast = 0 if recomputed else layer_cast
    saved = saved_layer_bytes(shape, setup)
    full = layer_activation_bytes(shape, setup)
    snaps = [
        _snapshot("forward, last layer", **states, gradients=grads(0, False),
                  autocast_copies=layers * layer_cast + root_cast, activations=layers * saved),
        _snapshot("loss backward", **states, gradients=grads(0, False),
                  autocast_copies=layers * saved_cast + root_cast,
                  activations=layers * saved + root_activation_bytes(shape, setup),
                  logits=logits_bytes(shape, setup)),
    ]
    for i in reversed(range(layers)):
        snaps.append(_snapshot(
            f"backward, layer {i}", **states, gradients=grads(layers - 1 - i, True),
            layer_gradients=c * shape.layer_params,
            autocast_copies=i * saved_cast + layer_cast,
            activations=i * saved + full + backward_workspace_bytes(shape, setup),
        ))
    # A tied embedding's gradient (fp32: the lookup runs in fp32 under autocast) is a second V x d tensor
    # until it is summed into the output projection's.
    tied_extra = 4 * shape.output_projection_params if shape.output_projection_tied else 0
    snaps.append(_snapshot("embedding backward", **states, gradients=grads(layers, True), root_gradients=tied_extra))
    snaps.append(_snapshot("optimizer step", **states, gradients=grads(layers, True)))
    host = layers * checkpointed_layer_bytes(shape, dataclasses.replace(setup, offload_activations=False)) \
        if setup.offload_activations else 0
    return snaps, host


# ------------------------------------------------------------------------------------------ searches


def largest_fitting(fits: Callable[[int], bool], start: int = 1, limit: int = 1 << 20) -> int:
    """The largest k in [start, limit] with fits(k), for fits monotone (true then false); start - 1 if none."""
    if not fits(start):
        return start - 1
    low, high = start, start
    while high < limit and fits(min(2 * high, limit)):
        low = high = min(2 * high, limit)
    if high >= limit:
        return limit
    high = min(2 * high, limit)  # fits(low) is true, fits(high) is false
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def largest_batch(shape: ModelShape, setup: TrainingSetup, gpu_memory_gib: float) -> int:
    """The largest --batch-size (sequences per GPU) whose plan fits; 0 when even one sequence does not."""
    return largest_fitting(lambda b: plan(shape, dataclasses.replace(setup, batch_size=b)).fits(gpu_memory_gib))


def largest_layer_count(shape: ModelShape, setup: TrainingSetup, gpu_memory_gib: float) -> int:
    """The largest --decoder-layers of this layer shape that fits; 0 when not even one layer does."""
    return largest_fitting(lambda n: plan(shape.with_layers(n), setup).fits(gpu_memory_gib))


def smallest_gpu_count(shape: ModelShape, setup: TrainingSetup, gpu_memory_gib: float,
                       limit: int = 1 << 16) -> Optional[int]:
    """The fewest GPUs for which the plan fits, or None when no count up to `limit` does.

    Only sharded states shrink with more GPUs (DDP replicates them). The search doubles and then bisects:
    per-GPU memory falls with the GPU count except for FSDP2's dim-0 padding, which only matters when there
    are more GPUs than rows in a parameter. With tensor parallelism the count is a multiple of its size, and
    the states are sharded over all the data-parallel ranks (no hybrid shard group).
    """
    tp = setup.tensor_parallel

    def fits(n: int) -> bool:  # n data-parallel ranks
        return plan(shape, dataclasses.replace(setup, gpus=n * tp, shard_group=0)).fits(gpu_memory_gib)

    if not setup.fully_sharded:
        return setup.gpus if fits(setup.data_parallel) else None
    high = 1
    while not fits(high):
        if high * tp >= limit:
            return None
        high = min(2 * high, limit // tp)
    low = high // 2  # 0, or a count that did not fit
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high * tp


def gib(nbytes: float) -> float:
    return nbytes / GIB


def breakdown_lines(snapshot: Snapshot) -> List[Tuple[str, int]]:
    """(label, bytes) in the order of TERMS, nonzero terms only."""
    return [(label, snapshot.terms[key]) for key, label in TERMS.items() if snapshot.terms.get(key)]
