"""Profiling a training run.

`--profile` is upstream's flag: the whole run inside `torch.cuda.profiler.profile()` and
`torch.autograd.profiler.emit_nvtx()`, so that `nsys profile --capture-range=cudaProfilerApi` records it with
one NVTX range per op.

`--profile-updates A:B` records a torch.profiler trace of updates A to B (1-based, inclusive) on every rank and
writes, into `--profile-dir`:

    trace_rank{R}.json     the Chrome/Perfetto trace (open in https://ui.perfetto.dev)
    summary_rank{R}.txt    per update: wall time, GPU busy and idle time, kernels launched; kernel time by
                           category; the ops with the most device time
    summary_rank{R}.json   the same numbers, for scripts (scripts/benchmark_fsdp.py --profile compares
                           fairseq-train with the plain FSDP2 loop from these)

GPU busy time is the union of the kernels' intervals, so kernels that overlap on several streams (compute
and NCCL) count once; idle = wall - busy is time the GPU waited for the host.
"""

import contextlib
import json
import logging
import os
import time
from typing import Dict, List, Optional, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

logger = logging.getLogger(__name__)

# Kernel name fragments -> category, checked in order (the first match wins).
KERNEL_CATEGORIES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("communication", ("nccl", "allgather", "reducescatter", "allreduce")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "sm90_", "sm80_", "wgmma", "_mm_")),
    ("optimizer", ("multi_tensor", "foreach", "adam", "fused_adam")),
    ("copy", ("memcpy", "memset", "copy_", "cat_", "catarray")),
    ("triton (compiled)", ("triton_",)),
)


# CUPTI also reports markers on the device timeline ("Command Buffer Full": the launch queue was full, i.e. the
# host ran far ahead); they are not GPU work.
CUPTI_MARKERS = frozenset({"Command Buffer Full"})
GPU_ACTIVITIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(fragment in lowered for fragment in fragments):
            return category
    return "elementwise/reduction"


def gpu_activities(records) -> list:
    """The kernels, copies and memsets among kineto's activity records (`kineto_results.events()`).

    Read from these rather than from the FunctionEvent list (`profile.events()`), which misses kernels
    launched through the driver API outside an aten op, such as inductor's triton launches: a compiled run
    would look a third idle."""
    cuda = torch.autograd.DeviceType.CUDA
    if records and hasattr(records[0], "activity_type"):
        return [e for e in records if e.device_type() == cuda and e.activity_type() in GPU_ACTIVITIES]
    # torch < 2.12 names no activity type. record_function ranges are mirrored on the device as user
    # annotations; names do not tell them from kernels, as inductor names a launch's range after its kernel.
    return [
        e for e in records if e.device_type() == cuda and not e.is_user_annotation() and e.name() not in CUPTI_MARKERS
    ]


def parse_update_range(spec: str) -> Tuple[int, int]:
    """ "A:B" (or "A") -> (A, B), 1-based and inclusive."""
    parts = str(spec).split(":")
    try:
        start, end = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        start = end = None
    if start is None or start < 1 or end < start:
        raise ValueError(
            f"--profile-updates {spec!r}: expected START:END with 1 <= START <= END, e.g. 10:12 (updates 10, 11 and 12)"
        )
    return start, end


@contextlib.contextmanager
def nvtx_profiling(enabled: bool):
    """--profile: NVTX ranges for nsys/nvprof, as upstream."""
    if not enabled or not torch.cuda.is_available():
        yield
        return
    with torch.cuda.profiler.profile(), torch.autograd.profiler.emit_nvtx():
        yield


def _union_length(intervals: List[Tuple[float, float]]) -> float:
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


class UpdateProfiler:
    """Records updates [start, end] with torch.profiler. Call `before_update(n)` before update n and
    `after_update(n)` after it (n counts from 1); the files are written after update `end`."""

    def __init__(self, start: int, end: int, out_dir: str, rank: int = 0, device: Optional[torch.device] = None):
        self.start, self.end = start, end
        self.out_dir = out_dir
        self.rank = rank
        self.cuda = device is not None and device.type == "cuda"
        self._profiler = None
        self._update_span = None
        self._wall_start = 0.0
        self.updates = 0  # updates completed inside the range
        self.wall_ms = 0.0  # of the whole range
        self.done = False

    @classmethod
    def from_config(cls, cfg, device, rank: int) -> Optional["UpdateProfiler"]:
        spec = cfg.common.profile_updates
        if not spec:
            return None
        start, end = parse_update_range(spec)
        out_dir = cfg.common.profile_dir or os.path.join(cfg.checkpoint.save_dir, "profile")
        return cls(start, end, out_dir, rank, device)

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def before_update(self, update: int) -> None:
        if self.done or not self.start <= update <= self.end:
            return
        if self._profiler is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profiler = profile(activities=activities, record_shapes=False, with_stack=False)
            self._sync()
            self._profiler.start()
            # Synchronized only here and at the end: a sync per update would drain the GPU's queue and show
            # every update starting with an idle GPU.
            self._wall_start = time.perf_counter()
        self._update_span = torch.profiler.record_function(f"update {update}")
        self._update_span.__enter__()

    def after_update(self, update: int) -> None:
        if self._profiler is None or self.done or self._update_span is None:
            return
        self._update_span.__exit__(None, None, None)
        self._update_span = None
        self.updates += 1
        if update >= self.end:
            self._stop()

    def _stop(self) -> None:
        self._sync()  # the range's wall time includes the GPU finishing its last update
        self.wall_ms = (time.perf_counter() - self._wall_start) * 1e3
        self._profiler.stop()
        self.done = True
        if self.updates:
            self.write()

    def finish(self) -> None:
        """Stop early (training ended inside the range) and write what was recorded."""
        if self._profiler is not None and not self.done:
            if self._update_span is not None:
                self._update_span.__exit__(None, None, None)
                self._update_span = None
            self._stop()

    def summary(self) -> Dict:
        kernels = [
            (e.name(), e.start_ns() / 1e3, e.duration_ns() / 1e3)
            for e in gpu_activities(self._profiler.profiler.kineto_results.events())
        ]
        updates = max(self.updates, 1)
        busy_us = _union_length([(start, start + duration) for _, start, duration in kernels])
        categories: Dict[str, float] = {}
        by_name: Dict[str, List[float]] = {}
        for name, _, duration in kernels:
            ms = duration / 1e3 / updates
            category = kernel_category(name)
            categories[category] = categories.get(category, 0.0) + ms
            entry = by_name.setdefault(name, [0.0, 0.0])
            entry[0] += 1 / updates
            entry[1] += ms
        wall_ms = self.wall_ms / updates
        kernel_sum_ms = sum(categories.values())
        ops = []
        for avg in self._profiler.key_averages():
            if avg.key in CUPTI_MARKERS:
                continue
            device_us = getattr(avg, "self_device_time_total", 0.0) or 0.0
            ops.append(
                {
                    "name": avg.key,
                    "count": avg.count / updates,
                    "device_ms": device_us / 1e3 / updates,
                    "cpu_ms": avg.self_cpu_time_total / 1e3 / updates,
                    "cpu_total_ms": avg.cpu_time_total / 1e3 / updates,
                }
            )
        by_cpu = sorted(ops, key=lambda o: o["cpu_ms"], reverse=True)
        # Inclusive host time of the named ranges (FSDP's hooks, compiled regions, the optimizer step, ...):
        # which part of the update the host's time went to; aten ops nest, so these overlap.
        ranges = sorted(
            (o for o in ops if not o["name"].startswith(("aten::", "cuda", "cu"))),
            key=lambda o: o["cpu_total_ms"],
            reverse=True,
        )
        ops.sort(key=lambda o: (o["device_ms"], o["cpu_ms"]), reverse=True)
        busy_ms = busy_us / 1e3 / updates
        return {
            "updates": self.updates,
            "wall_ms": wall_ms,
            "gpu_busy_ms": busy_ms,
            "gpu_idle_ms": max(wall_ms - busy_ms, 0.0) if self.cuda else None,
            "kernels": len(kernels) / updates,
            # kernel time summed over streams; sum - busy is the time kernels ran concurrently
            "kernel_sum_ms": kernel_sum_ms,
            "category_ms": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "kernels_by_name": {
                name: {"count": c, "ms": ms} for name, (c, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])
            },
            "top_ops": ops[:40],
            # where the host spent its time (self time): CUDA runtime calls that block (cudaStreamSynchronize,
            # cudaEventSynchronize, pageable cudaMemcpyAsync) show up here
            "top_host_ops": by_cpu[:40],
            "top_host_ranges": ranges[:40],
        }

    def write(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        prefix = os.path.join(self.out_dir, f"%s_rank{self.rank}.%s")
        self._profiler.export_chrome_trace(prefix % ("trace", "json"))
        summary = self.summary()
        with open(prefix % ("summary", "json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(prefix % ("summary", "txt"), "w") as f:
            f.write(format_summary(summary))
        logger.info(
            f"profiled updates {self.start}-{self.end}: {summary['wall_ms']:.1f} ms per update, "
            f"trace and summary in {self.out_dir}"
        )


def format_summary(summary: Dict) -> str:
    lines = [
        f"per update, mean of {summary['updates']}:",
        f"  wall {summary['wall_ms']:.2f} ms, GPU busy {summary['gpu_busy_ms']:.2f} ms"
        + (f", GPU idle {summary['gpu_idle_ms']:.2f} ms" if summary["gpu_idle_ms"] is not None else "")
        + f", {summary['kernels']:.0f} kernels ({summary['kernel_sum_ms']:.2f} ms summed over streams)",
        "",
        "kernel time by category (ms per update):",
    ]
    lines += [f"  {name:<24} {ms:10.2f}" for name, ms in summary["category_ms"].items()]
    lines += ["", f"  {'kernel':<90} {'calls':>8} {'ms':>9}"]
    lines += [
        f"  {name[:90]:<90} {k['count']:8.1f} {k['ms']:9.2f}"
        for name, k in list(summary["kernels_by_name"].items())[:40]
    ]
    for title, key, cpu_key in (
        ("ops by device time", "top_ops", "cpu_ms"),
        ("ops by host (self) time", "top_host_ops", "cpu_ms"),
        ("ranges by host (inclusive) time", "top_host_ranges", "cpu_total_ms"),
    ):
        lines += ["", f"  {title:<70} {'calls':>8} {'device ms':>10} {'cpu ms':>9}"]
        lines += [
            f"  {o['name'][:70]:<70} {o['count']:8.1f} {o['device_ms']:10.2f} {o.get(cpu_key, 0.0):9.2f}"
            for o in summary.get(key, [])
        ]
    return "\n".join(lines) + "\n"
