"""`python -m fairseq.planning.plan_memory`: predict per-GPU memory of a fairseq-train run before asking for GPUs.

    python -m fairseq.planning.plan_memory --arch transformer_lm_gpt3_175 --gpus 1024 --gpu a100-80gb \\
        --bf16 --checkpoint-activations --batch-size 1 --tokens-per-sample 2048

Training flags are spelled as fairseq-train spells them (they are generated from the same config fields);
model flags such as --decoder-layers override the --arch preset as they do in training. The model is built
on the meta device by the real model code, so `parameters:` is exact. The command line is read in
fairseq/planning/request.py; this module reports on it and advises. The arithmetic is in
fairseq/planning/memory_model.py; the formulas, their sources and the calibration are in docs/memory_planner.md.
"""

import dataclasses
import sys
from typing import List, Optional

from fairseq.planning import communication_model as cm
from fairseq.planning import compute_model
from fairseq.planning import hardware as hw
from fairseq.planning import layouts
from fairseq.planning import memory_model as mm
from fairseq.planning.request import Request, parse
from fairseq.planning.step_time import step_time
from fairseq.checkpoint.writer import async_save_host_bytes
from fairseq.distributed.mesh import ParallelLayout

# Headroom under which the plan warns that reserved memory may reach the device (allocator retries).
TIGHT_HEADROOM_FRACTION = 0.15
# --fsdp-forward-prefetch pays when the CPU, not the GPU, is the bottleneck: when a layer's work per
# micro-batch is small. Judged by tokens x layer parameters (a sixth of the layer's training FLOPs); the
# CPU-bound case of issue 5 (gpt3_medium, 2048 tokens) is 2.6e10, the GPU-bound 12 x 6144 one 9.3e11.
CPU_BOUND_TOKENS_X_LAYER_PARAMS = 1e11
# --cpu-offload is only advised when its host memory per GPU stays under this (256 GiB per GPU on an
# 8-GPU node with 2 TiB; the 2 x H200 machines here have 128 GiB per GPU).
HOST_MEMORY_PER_GPU_GIB = 128


# ------------------------------------------------------------------------------------------ report


def _flags(setup: mm.TrainingSetup) -> str:
    parts = [
        f"--ddp-backend {'fully_sharded' if setup.fully_sharded else 'pytorch_ddp (replicated)'}",
        {"fp32": "fp32", "bf16": "--bf16", "fp16": "--fp16"}[setup.dtype],
        f"--batch-size {setup.batch_size} x --tokens-per-sample {setup.tokens_per_sample}",
    ]
    for on, flag in (
        (setup.checkpoint_activations and not setup.offload_activations, "--checkpoint-activations"),
        (setup.offload_activations, "--offload-activations"),
        (not setup.reshard_after_forward, "--no-reshard-after-forward"),
        (setup.cpu_offload, "--cpu-offload"),
        (setup.forward_prefetch, f"--fsdp-forward-prefetch (depth {setup.prefetch_depth})"),
        (setup.sync_free, "--fsdp-sync-free"),
        (setup.update_freq > 1, f"--update-freq {setup.update_freq}"),
        (setup.tensor_parallel > 1, f"--model-parallel-size {setup.tensor_parallel}"),
        (setup.shard_group > 0, f"--fsdp-shard-group-size {setup.shard_group}"),
        (
            setup.float8,
            "--fp8" + (f" --fp8-recipe {setup.float8_recipe}" if setup.float8_recipe != "tensorwise" else ""),
        ),
        (setup.float8_all_gather, "--fp8-fsdp-all-gather"),
        (setup.compiled, "--compile"),
    ):
        if on:
            parts.append(flag)
    return ", ".join(parts)


def _phase_summary(plan: mm.MemoryPlan) -> str:
    """Each phase's total; the layer backward phases as their largest."""
    parts, layer_best = [], None
    for snap in plan.snapshots:
        if snap.phase.startswith("backward, layer"):
            if layer_best is None or snap.total > layer_best.total:
                layer_best = snap
            continue
        if layer_best is not None:
            parts.append(f"{layer_best.phase} {mm.gib(layer_best.total):.2f}")
            layer_best = None
        parts.append(f"{snap.phase} {mm.gib(snap.total):.2f}")
    return " | ".join(parts)


def render_plan(plan: mm.MemoryPlan, gpu_memory_gib: float) -> List[str]:
    peak = plan.peak
    width = 70
    lines = [f"per-GPU memory at the peak ({peak.phase}), GiB:"]
    lines += [f"  {label:<{width}} {mm.gib(nbytes):9.2f}" for label, nbytes in mm.breakdown_lines(peak)]
    margin_label = (
        f"allocator margin ({mm.ALLOCATOR_MARGIN_FRACTION:.0%} of the peak + "
        f"{mm.NON_PYTORCH_OVERHEAD_GIB:g} GiB outside PyTorch)"
    )
    free = gpu_memory_gib - mm.gib(plan.required_bytes)
    verdict = f"fits ({free:.2f} GiB to spare)" if free >= 0 else f"DOES NOT FIT ({-free:.2f} GiB over)"
    lines += [
        f"  {'peak allocated (compare with max_cuda_gb_allocated)':<{width}} {mm.gib(plan.peak_bytes):9.2f}",
        f"  {margin_label:<{width}} {mm.gib(plan.margin_bytes):9.2f}",
        f"  {'total':<{width}} {mm.gib(plan.required_bytes):9.2f} of {gpu_memory_gib:g}: {verdict}",
        f"peak allocated by phase, GiB: {_phase_summary(plan)}",
    ]
    if plan.host_bytes:
        lines.append(f"host memory per GPU (offloaded): {mm.gib(plan.host_bytes):.2f} GiB")
    return lines


def recommendations(request: Request) -> List[str]:
    """Flags worth changing, each with the reason; checked against the planner itself."""
    variants = _Variants(request)
    current = mm.plan(request.shape, request.setup)
    if not current.fits(request.gpu_memory_gib):
        return _advice_to_fit(request, current, variants)
    return _advice_with_room(request, current, variants)


class _Variants:
    """The plan of the request's setup with some flags changed, and whether it fits."""

    def __init__(self, request: Request):
        self.shape, self.setup, self.memory = request.shape, request.setup, request.gpu_memory_gib

    def changed(self, **changes) -> mm.MemoryPlan:
        return mm.plan(self.shape, dataclasses.replace(self.setup, **changes))

    def fits(self, **changes) -> bool:
        return self.changed(**changes).fits(self.memory)

    def fits_with_headroom(self, **changes) -> bool:
        # Advice that spends memory (dropping a saving) is only given when the result keeps the headroom
        # under which the plan warns.
        return self.changed(**changes).required_bytes <= (1 - TIGHT_HEADROOM_FRACTION) * self.memory * mm.GIB


def _advice_to_fit(request: Request, current: mm.MemoryPlan, variants: _Variants) -> List[str]:
    """A setup that does not fit: the flags that make it fit, else more GPUs or host memory."""
    shape, setup, memory, fits = request.shape, request.setup, request.gpu_memory_gib, variants.fits
    advice = []
    activations = current.peak.terms.get("activations", 0)
    if setup.dtype == "fp32":
        advice.append("--bf16: halves activations and the full parameters in flight")
    if not setup.checkpoint_activations and fits(checkpoint_activations=True):
        advice.append(
            f"--checkpoint-activations: activations are {mm.gib(activations):.2f} GiB at the peak; "
            "with it each layer keeps only its input"
        )
    if not setup.reshard_after_forward and fits(reshard_after_forward=True):
        advice.append("drop --no-reshard-after-forward: it keeps every layer's full parameters until backward")
    if setup.forward_prefetch and setup.prefetch_depth > 1 and fits(prefetch_depth=1):
        advice.append("--fsdp-prefetch-depth 1: each extra layer of prefetch holds one more layer's parameters")
    if setup.batch_size > 1 and fits(batch_size=1):
        batch = mm.largest_batch(shape, setup, memory)
        advice.append(
            f"--batch-size {batch} (the largest that fits) with --update-freq "
            f"{setup.update_freq * -(-setup.batch_size // batch)} to keep the tokens per update"
        )
    if not advice or not fits(batch_size=1, checkpoint_activations=True):
        advice += _advice_beyond_flags(request, variants)
    return advice


def _advice_beyond_flags(request: Request, variants: _Variants) -> List[str]:
    """Where batch 1 with --checkpoint-activations does not fit either: sharding, more GPUs, --cpu-offload."""
    shape, setup, memory = request.shape, request.setup, request.gpu_memory_gib
    advice = []
    best = dataclasses.replace(
        setup, batch_size=1, checkpoint_activations=True, dtype="bf16" if setup.dtype == "fp32" else setup.dtype
    )
    if not setup.fully_sharded:
        advice.append("--ddp-backend fully_sharded: DDP replicates 20 bytes per parameter on every GPU")
        best = dataclasses.replace(best, fully_sharded=True)
    gpus = mm.smallest_gpu_count(shape, best, memory)
    if gpus is not None and gpus > setup.gpus:
        advice.append(
            f"at least {gpus} GPUs (sharded model states shrink with the GPU count; "
            f"batch 1 with --checkpoint-activations)"
        )
    offloaded = variants.changed(cpu_offload=True, batch_size=1, checkpoint_activations=True)
    if (
        setup.fully_sharded
        and not setup.cpu_offload
        and offloaded.fits(memory)
        and mm.gib(offloaded.host_bytes) <= HOST_MEMORY_PER_GPU_GIB
    ):
        advice.append(
            f"--cpu-offload: sharded parameters, gradients and Adam state move to host memory "
            f"({mm.gib(offloaded.host_bytes):.1f} GiB per GPU; the optimizer steps on the CPU)"
        )
    return advice


def _advice_with_room(request: Request, current: mm.MemoryPlan, variants: _Variants) -> List[str]:
    """A setup that fits: little headroom, savings it can drop, and flags that would make it faster."""
    shape, setup, memory = request.shape, request.setup, request.gpu_memory_gib
    fits_with_headroom = variants.fits_with_headroom
    advice = []
    headroom = 1 - current.required_bytes / (memory * mm.GIB)
    if headroom < TIGHT_HEADROOM_FRACTION:
        # Not --fsdp-sync-free: on FSDP2 it changed neither reserved memory nor retries (docs/fsdp.md).
        advice.append(
            f"only {headroom:.0%} headroom: watch max_cuda_gb_reserved and cuda_alloc_retries in the "
            "first log lines; if retries appear, a smaller --batch-size or --checkpoint-activations"
        )
    if (
        setup.checkpoint_activations
        and not setup.offload_activations
        and fits_with_headroom(checkpoint_activations=False)
    ):
        advice.append(
            "drop --checkpoint-activations: it fits without, which saves recomputing every layer's "
            "forward (about a third more compute)"
        )
    if setup.cpu_offload and fits_with_headroom(cpu_offload=False):
        advice.append("drop --cpu-offload: the states fit on the GPU, and the optimizer step is much faster there")
    traffic = cm.step_traffic(shape, setup, request.gpus_per_node)
    across = sum(item.seconds(request.hardware) for item in traffic if item.crosses_nodes)
    compute = compute_model.compute_seconds(shape, setup, request.hardware.achieved_tflops)
    if across > compute and not request.recommend_layout:
        advice.append(
            f"--recommend-layout: communication across nodes (about {across:.0f} s per step) exceeds "
            "compute; tensor parallelism inside a node divides what FSDP sends across them"
        )
    small_layers = setup.tokens * shape.layer_params < CPU_BOUND_TOKENS_X_LAYER_PARAMS
    if (
        setup.fully_sharded
        and not setup.forward_prefetch
        and small_layers
        and fits_with_headroom(forward_prefetch=True)
    ):
        advice.append(
            "--fsdp-forward-prefetch: small layers are CPU-bound, and its extra layer of full parameters fits"
        )
    return advice


def report(request: Request) -> List[str]:
    shape, setup, memory = request.shape, request.setup, request.gpu_memory_gib
    gpu = f"{request.gpu_name} " if request.gpu_name else ""
    lines = [
        f"memory plan: --arch {request.arch}: {shape.num_layers} layers x {shape.embed_dim}, ffn {shape.ffn_dim}, "
        f"{shape.heads} heads, vocabulary {shape.vocab_size}",
        f"parameters: {shape.total_params}",
        f"  per layer {shape.layer_params:,}; root (embeddings, final norm, output projection"
        f"{', tied to the embeddings' if shape.output_projection_tied else ''}) {shape.root_params:,}",
        f"setup: {setup.gpus} x {gpu}GPU of {memory:g} GiB, {_flags(setup)}, optimizer {request.optimizer} "
        f"(fp32 master parameters, gradients and 2 Adam states)",
    ]
    current = mm.plan(shape, setup)
    lines += render_plan(current, memory)
    batch = mm.largest_batch(shape, setup, memory)
    lines.append(
        f"largest --batch-size that fits: {batch}"
        if batch
        else "largest --batch-size that fits: none (not even 1 sequence)"
    )
    if request.max_layers_that_fit:
        layers = mm.largest_layer_count(shape, setup, memory)
        lines.append(f"largest --decoder-layers that fits (this layer shape and these flags): {layers}")
        if layers:
            deepest = mm.plan(shape.with_layers(layers), setup)
            lines.append(
                f"  with {layers} layers: {deepest.shape.total_params} parameters, peak allocated "
                f"{mm.gib(deepest.peak_bytes):.2f} GiB, total {mm.gib(deepest.required_bytes):.2f} GiB "
                f"of {memory:g}"
            )
    lines += communication_lines(shape, setup, request.hardware, request.gpus_per_node)
    if request.async_checkpoints:
        lines += async_checkpoint_lines(request)
    advice = recommendations(request)
    lines.append("recommended: " + ("nothing to change" if not advice else advice[0]))
    lines += [f"             {item}" for item in advice[1:]]
    if request.recommend_layout:
        lines += layout_lines(request)
    return lines


def async_checkpoint_lines(request: Request) -> List[str]:
    """Host memory the snapshots of --write-checkpoints-asynchronously hold per node (fairseq.checkpoint.writer),
    and a warning when it exceeds --node-memory-gib."""
    shape, setup = request.shape, request.setup
    ranks_per_node = min(request.gpus_per_node, setup.gpus)
    shards = (setup.shard_group or setup.data_parallel) * setup.tensor_parallel if setup.fully_sharded else 1
    per_rank = async_save_host_bytes(
        shape.total_params * mm.MASTER_PARAM_BYTES,
        shape.total_params * mm.ADAM_STATE_BYTES,
        sharded=request.sharded_state,
        state_shards=shards,
    )
    per_node = per_rank * (ranks_per_node if request.sharded_state else 1)  # a single file: rank 0 alone
    kind = "sharded: every rank its shards" if request.sharded_state else "single file: rank 0 the whole state"
    lines = [
        f"asynchronous checkpoints ({kind}): {mm.gib(per_node):.2f} GiB of host memory per node "
        f"({mm.gib(per_rank):.2f} GiB per rank; docs/checkpoints.md)"
    ]
    if request.node_memory_gib is not None and mm.gib(per_node) > request.node_memory_gib:
        lines.append(
            f"WARNING: that exceeds the node's {request.node_memory_gib:g} GiB of RAM: use "
            "--use-sharded-state, more GPUs, or synchronous saves"
        )
    return lines


def _layout_name(setup: mm.TrainingSetup) -> str:
    shard = setup.shard_ranks if setup.fully_sharded else 1
    return ParallelLayout(setup.data_parallel // shard, shard, setup.tensor_parallel).describe()


def communication_lines(
    shape: mm.ModelShape, setup: mm.TrainingSetup, hardware: hw.Hardware, gpus_per_node: int
) -> List[str]:
    """Bytes per GPU per step of each collective, where it runs, and the step time they leave exposed."""
    traffic = cm.step_traffic(shape, setup, gpus_per_node)
    lines = [
        f"layout: {_layout_name(setup)} on {setup.gpus} GPUs ({gpus_per_node} per node); communication per "
        f"GPU per step ({setup.update_freq} micro-batch(es)), GiB:"
    ]
    for item in traffic:
        where = "across nodes" if item.crosses_nodes else "inside a node"
        lines.append(f"  {item.what + f' over {item.ranks} ranks, {where}':<70} {mm.gib(item.bytes):9.2f}")
    inter = sum(i.seconds(hardware) for i in traffic if i.crosses_nodes)
    intra = sum(i.seconds(hardware) for i in traffic if not i.crosses_nodes)
    time = step_time(shape, setup, hardware, gpus_per_node)
    lines.append(
        f"  transfers: {intra:.2f} s inside nodes ({hardware.intra_node_gbps:g} GB/s per GPU) + {inter:.2f} s "
        f"across nodes ({hardware.inter_node_gbps:g} GB/s)"
    )
    lines.append(
        f"estimated step: {time.total:.2f} s = compute {time.compute:.2f} s (at {hardware.achieved_tflops:g} "
        f"TFLOP/s per GPU{_float8_note(setup)}) + exposed communication {time.exposed:.2f} s"
    )
    return lines


def _float8_note(setup: mm.TrainingSetup) -> str:
    if not setup.float8:
        return ""
    return f", the layers' float8 matmuls {compute_model.float8_speedup(setup):.2f}x as fast"


def layout_lines(request: Request) -> List[str]:
    """The recommended layout of --recommend-layout, then every one that fits, fastest first."""
    shape, setup = request.shape, request.setup
    sequences = setup.batch_size * setup.update_freq * setup.data_parallel
    candidates = layouts.candidate_layouts(shape, setup, request.hardware, request.gpus_per_node)
    lines = [
        f"layouts of {setup.gpus} GPUs at {sequences} sequences per update, each at the largest micro-batch that "
        "fits, fastest first (estimated step: compute + communication not hidden behind it):"
    ]
    if not candidates:
        return lines + ["  none fits: more GPUs, or --checkpoint-activations / --bf16"]
    best = candidates[0]
    flags = [f"--model-parallel-size {best.setup.tensor_parallel}"] if best.setup.tensor_parallel > 1 else []
    flags += [f"--fsdp-shard-group-size {best.setup.shard_group}"] if best.setup.shard_group else []
    flags += [f"--batch-size {best.setup.batch_size}", f"--update-freq {best.setup.update_freq}"]
    lines.append(
        f"recommended layout: {_layout_name(best.setup)}: {' '.join(flags)} ({best.time.total:.2f} s per "
        f"step: compute {best.time.compute:.2f} s + exposed communication {best.time.exposed:.2f} s; "
        f"{mm.gib(best.plan.required_bytes):.2f} GiB per GPU)"
    )
    lines.append(
        f"  {'layout':<24} {'batch x freq':>12} {'GiB needed':>11} {'compute s':>10} {'exposed s':>10} "
        f"{'step s':>8} {'across nodes GiB':>17} {'all comm s':>11}"
    )
    # One row per tensor-parallel size (FSDP over all its data-parallel ranks), and the HSDP layouts that beat it.
    fsdp = {c.setup.tensor_parallel: c.time.total for c in candidates if not c.setup.shard_group}
    shown = [
        c
        for c in candidates
        if c is best
        or not c.setup.shard_group
        or c.time.total < fsdp.get(c.setup.tensor_parallel, float("inf")) * (1 - layouts.STEP_TIME_TIE_FRACTION)
    ]
    for candidate in shown:
        c, time = candidate.setup, candidate.time
        lines.append(
            f"  {_layout_name(c):<24} {f'{c.batch_size} x {c.update_freq}':>12} "
            f"{mm.gib(candidate.plan.required_bytes):11.2f} {time.compute:10.2f} {time.exposed:10.2f} "
            f"{time.total:8.2f} {mm.gib(candidate.inter_node_bytes):17.1f} {time.communication:11.2f}"
        )
    if len(shown) < len(candidates):
        lines.append(
            f"  not shown: {len(candidates) - len(shown)} HSDP layouts (--fsdp-shard-group-size), none "
            "faster than FSDP over all data-parallel ranks at their TP size, all needing more memory"
        )
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    request = parse(argv)
    print("\n".join(report(request)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
