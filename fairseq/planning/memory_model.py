"""Per-GPU memory of training a transformer_lm, walked through one training step (see docs/memory_planner.md).

The arithmetic behind `python -m fairseq.planning.plan_memory`, free of any command line. The model's shapes come from
the real model code built on the meta device (fairseq/planning/shapes.py), so parameter counts are exact;
everything else is a model of what this fork allocates, in bytes, at the moments of a training step where memory
can peak:

- forward, last layer; the loss backward (logits gradient); the backward of a decoder layer (of the layers
  where it can peak: `backward_layers`); the embedding backward; the root's reduce-scatter; the optimizer step.

The peak is the largest of those snapshots (`MemoryPlan.peak`), which is what `max_cuda_gb_allocated`
measures. `MemoryPlan.required_bytes` adds the allocator margin and what lies outside PyTorch; a plan fits when
that is at most the device's memory. What a layer saves for backward is fairseq/planning/activation_memory.py's.

Calibration: every assumption that a measurement could correct is a named constant in
fairseq/planning/memory_calibration.py.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

# The shapes, the activation terms and the calibration constants, under the names plan_memory and the tests read
# as mm.NAME (each is defined once, in its own module).
from fairseq.planning.activation_memory import (  # noqa: F401
    backward_workspace_bytes,
    checkpointed_layer_bytes,
    layer_activation_bytes,
    logits_bytes,
    root_activation_bytes,
    saved_layer_bytes,
)
from fairseq.planning.memory_calibration import (  # noqa: F401
    ADAM_STATE_BYTES,
    ALLOCATOR_MARGIN_FRACTION,
    DDP_GRADIENT_BUCKET_COPY,
    DTYPE_BYTES,
    FLASH_DQ_ACCUM_BYTES,
    FLOAT8_BYTES,
    FLOAT8_SCALE_BYTES,
    FSDP_FORWARD_BUFFERS,
    FSDP_RETAINED_REDUCE_BUFFERS,
    GIB,
    GRAD_BYTES,
    LOSS_FP32_CHUNK_COPIES,
    MASTER_PARAM_BYTES,
    NON_PYTORCH_OVERHEAD_GIB,
    REDUCE_BYTES,
)
from fairseq.planning.shapes import ModelShape, TrainingSetup, local_shape, model_shape  # noqa: F401


# The most GPUs the planner takes (--gpus) and searches (smallest_gpu_count): more than any one job has used.
MAX_GPUS = 1 << 17

# ------------------------------------------------------------------------------------------ the walk

# Snapshot keys -> the labels printed, in print order.
TERMS = {
    "parameters": "parameters (fp32)",
    "gradients": "gradients (fp32)",
    "optimizer_state": "optimizer state (Adam, 2 x fp32)",
    "float8_scales": "float8 weight scales (fp32, one per weight)",
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


def gathered_layer_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """One layer's parameters as FSDP2 all-gathers them (`shape` is tensor-parallel-local): in the compute dtype;
    with --fp8-fsdp-all-gather the float8 weights travel, and stay gathered, in 1 byte (torchao's
    fsdp_pre_all_gather casts each shard; its post_all_gather wraps the gathered bytes without a bf16 copy)."""
    n, c = setup.shard_ranks if setup.fully_sharded else 1, setup.compute_bytes
    float8 = (
        shape.float8_params(setup.tensor_parallel)
        if setup.float8_all_gather
        else (False,) * len(shape.layer_param_shapes)
    )
    weights = [s for s, is_float8 in zip(shape.layer_param_shapes, float8) if is_float8]
    others = [s for s, is_float8 in zip(shape.layer_param_shapes, float8) if not is_float8]
    return n * (FLOAT8_BYTES * sharded_numel(weights, n) + c * sharded_numel(others, n))


def float8_scale_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """What torchao keeps between steps for float8 (FLOAT8_SCALE_BYTES): with --fp8-fsdp-all-gather one fp32
    scale per float8 weight of every layer (a few KiB); dynamic scaling keeps no amax history."""
    if not (setup.float8 and setup.float8_all_gather):
        return 0
    return FLOAT8_SCALE_BYTES * shape.num_layers * sum(shape.float8_params(setup.tensor_parallel))


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
        raise ValueError(
            f"--fsdp-shard-group-size {setup.shard_group} must divide the {setup.data_parallel} data-parallel ranks"
        )


def backward_layers(layers: int, bend: int = 0) -> List[int]:
    """The layers whose backward the walks take a snapshot of, the last first: the first layer, the last two and
    layer `bend`. Between two of these every term of a layer's backward snapshot is linear in the layer's index
    (activations of the layers below it, gradients of those above, FSDP's prefetched layers up to `bend`; the
    last layer alone has no retained reduce buffer), so the largest snapshot, and the layer it is at, are those
    a walk through every layer finds, at a cost that does not grow with --decoder-layers."""
    return sorted({i for i in (0, bend, layers - 2, layers - 1) if 0 <= i < layers}, reverse=True)


def _walk_fully_sharded(shape: ModelShape, setup: TrainingSetup):
    walk = _FullyShardedWalk(shape, setup)
    return walk.forward() + walk.backward() + walk.root_and_step(), walk.host_bytes()


class _FullyShardedWalk:
    """The snapshots of one FSDP2 step, from the sizes every phase shares (shards, gathered buffers, states)."""

    def __init__(self, shape: ModelShape, setup: TrainingSetup):
        self.shape, self.setup = shape, setup
        n, c, self.layers = setup.shard_ranks, setup.compute_bytes, shape.num_layers
        self.layer_shard = sharded_numel(shape.layer_param_shapes, n)
        self.root_shard = sharded_numel(shape.root_param_shapes, n)
        self.all_shard = self.layers * self.layer_shard + self.root_shard
        self.gathered = n * self.layer_shard  # one layer's padded all-gather / reduce-scatter buffer, in elements
        self.root_gathered = n * self.root_shard
        self.full_layer = c * self.gathered  # bytes of one layer's gathered parameters
        if setup.float8_all_gather:
            self.full_layer = gathered_layer_bytes(shape, setup)
        self.on_gpu = 0 if setup.cpu_offload else 1
        self.states = dict(
            parameters=self.on_gpu * MASTER_PARAM_BYTES * self.all_shard,
            optimizer_state=self.on_gpu * ADAM_STATE_BYTES * self.all_shard,
            float8_scales=float8_scale_bytes(shape, setup),
        )
        # fp32 shard copied in; reduced shard copied out
        self.staging = 2 * 4 * self.layer_shard if setup.cpu_offload else 0
        self.saved = saved_layer_bytes(shape, setup)
        self.root_full = c * self.root_gathered

    def grads(self, layers_done: int, root_done: bool) -> int:
        if self.setup.update_freq > 1:  # earlier micro-batches' gradients stay for the whole update
            layers_done, root_done = self.layers, True
        return self.on_gpu * GRAD_BYTES * (layers_done * self.layer_shard + (self.root_shard if root_done else 0))

    def forward(self) -> List[Snapshot]:
        shape, setup, layers, full_layer = self.shape, self.setup, self.layers, self.full_layer
        depth = setup.fsdp.forward_prefetch_layers
        if setup.reshard_after_forward:
            forward_flight = (FSDP_FORWARD_BUFFERS + depth) * full_layer
        else:  # every layer's parameters stay gathered, plus the last flat all-gather buffer
            forward_flight = (layers + 1) * full_layer
        kept_after_forward = 0 if setup.reshard_after_forward else layers * full_layer
        return [
            _snapshot(
                "forward, last layer",
                **self.states,
                gradients=self.grads(0, False),
                layers_in_flight=forward_flight if layers else 0,
                root_parameters=self.root_full,
                activations=layers * self.saved,
                offload_staging=self.staging,
            ),
            _snapshot(
                "loss backward",
                **self.states,
                gradients=self.grads(0, False),
                layers_in_flight=kept_after_forward,
                root_parameters=self.root_full,
                activations=layers * self.saved + root_activation_bytes(shape, setup),
                logits=logits_bytes(shape, setup),
            ),
        ]

    def backward(self) -> List[Snapshot]:
        shape, setup, layers, full_layer = self.shape, self.setup, self.layers, self.full_layer
        c, backward_prefetch = setup.compute_bytes, setup.fsdp.backward_prefetch_layers
        full = layer_activation_bytes(shape, setup)
        output_grad = c * shape.output_projection_params
        snaps = []
        for i in backward_layers(layers, backward_prefetch if setup.reshard_after_forward else 0):
            if setup.reshard_after_forward:
                flight = (1 + min(backward_prefetch, i)) * full_layer
            else:
                flight = (i + 1) * full_layer
            retained_reduce = REDUCE_BYTES * self.gathered * FSDP_RETAINED_REDUCE_BUFFERS if i < layers - 1 else 0
            snaps.append(
                _snapshot(
                    f"backward, layer {i}",
                    **self.states,
                    gradients=self.grads(layers - 1 - i, False),
                    layers_in_flight=flight,
                    layer_gradients=c * self.gathered + retained_reduce,
                    root_parameters=self.root_full,
                    root_gradients=output_grad,
                    activations=i * self.saved + full + backward_workspace_bytes(shape, setup),
                    offload_staging=self.staging,
                )
            )
        return snaps

    def root_and_step(self) -> List[Snapshot]:
        shape, layers, c = self.shape, self.layers, self.setup.compute_bytes
        # The embedding's gradient arrives while the output projection's is still held (a second V x d tensor
        # when the two are tied, summed into one afterwards).
        tied_extra = shape.output_projection_params if shape.output_projection_tied else 0
        return [
            _snapshot(
                "embedding backward",
                **self.states,
                gradients=self.grads(layers, False),
                layer_gradients=REDUCE_BYTES * self.gathered if layers else 0,
                root_parameters=self.root_full,
                root_gradients=c * (self.root_gathered + tied_extra),
            ),
            # FSDP2 frees the root's full parameters and the last layer's reduce buffer before the root reduces.
            _snapshot(
                "root reduce-scatter",
                **self.states,
                gradients=self.grads(layers, False),
                root_gradients=(c + REDUCE_BYTES) * self.root_gathered,
                offload_staging=4 * self.root_shard if self.setup.cpu_offload else 0,
            ),
            _snapshot("optimizer step", **self.states, gradients=self.grads(layers, True)),
        ]

    def host_bytes(self) -> int:
        host = (1 - self.on_gpu) * (MASTER_PARAM_BYTES + GRAD_BYTES + ADAM_STATE_BYTES) * self.all_shard
        return host + _offloaded_activation_bytes(self.shape, self.setup)


def _offloaded_activation_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """Host memory of --offload-activations: every layer's checkpointed input."""
    if not setup.offload_activations:
        return 0
    return shape.num_layers * checkpointed_layer_bytes(shape, dataclasses.replace(setup, offload_activations=False))


def _walk_replicated(shape: ModelShape, setup: TrainingSetup):
    """DDP: every rank holds every parameter, gradient and Adam state, plus DDP's gradient buckets. With tensor
    parallelism (`shape` local) the replicas are FSDP2's, which keep no buckets."""
    c, layers, total = setup.compute_bytes, shape.num_layers, shape.total_params
    states = dict(
        parameters=MASTER_PARAM_BYTES * total,
        optimizer_state=ADAM_STATE_BYTES * total,
        ddp_buckets=GRAD_BYTES * total if DDP_GRADIENT_BUCKET_COPY and setup.tensor_parallel == 1 else 0,
    )

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
        _snapshot(
            "forward, last layer",
            **states,
            gradients=grads(0, False),
            autocast_copies=layers * layer_cast + root_cast,
            activations=layers * saved,
        ),
        _snapshot(
            "loss backward",
            **states,
            gradients=grads(0, False),
            autocast_copies=layers * saved_cast + root_cast,
            activations=layers * saved + root_activation_bytes(shape, setup),
            logits=logits_bytes(shape, setup),
        ),
    ]
    for i in backward_layers(layers):
        snaps.append(
            _snapshot(
                f"backward, layer {i}",
                **states,
                gradients=grads(layers - 1 - i, True),
                layer_gradients=c * shape.layer_params,
                autocast_copies=i * saved_cast + layer_cast,
                activations=i * saved + full + backward_workspace_bytes(shape, setup),
            )
        )
    # A tied embedding's gradient (fp32: the lookup runs in fp32 under autocast) is a second V x d tensor
    # until it is summed into the output projection's.
    tied_extra = 4 * shape.output_projection_params if shape.output_projection_tied else 0
    snaps.append(_snapshot("embedding backward", **states, gradients=grads(layers, True), root_gradients=tied_extra))
    snaps.append(_snapshot("optimizer step", **states, gradients=grads(layers, True)))
    return snaps, _offloaded_activation_bytes(shape, setup)


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


def smallest_gpu_count(
    shape: ModelShape, setup: TrainingSetup, gpu_memory_gib: float, limit: int = MAX_GPUS
) -> Optional[int]:
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
