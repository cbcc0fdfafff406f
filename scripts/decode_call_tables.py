"""The per-call tables of scripts/benchmark_generate.py (see its module doc): one Linear's int8 matmul paths, one
layer's decode attention call, and the profile of kernels per decode step; each timed on CUDA inside a captured
graph, as a decode step replays them."""

import contextlib
import itertools
import time
from typing import Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from fairseq.generation.cuda_graph_decoding import CAPACITY_MULTIPLE, attention_window
from fairseq.generation.quantize import Int8WeightOnlyLinear, quantizable_linears
from fairseq.kernels.decode_attention import (
    CACHE_BLOCK,
    decode_attention_available,
    decode_attention_enabled,
    decode_attention_kernel as split_kv_attention,
    set_decode_attention_kernel,
)
from fairseq.kernels.int8_matmul import inductor_int8_linear, int8_kernel_available, int8_matmul_kernel
from fairseq.kernels.int8_tuning import LEGACY, heuristic, row_bucket, tuned_configs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def linear_shapes(model) -> list:
    """The distinct (out, in) shapes of the Linears quantize_for_generation would make int8."""
    modules = dict(model.named_modules())
    return sorted({tuple(modules[name].weight.shape) for name in quantizable_linears(model)})


@torch.no_grad()
def int8_matmul_rows(model, batches, args, device) -> list:
    """One Linear's time per call, for each weight shape of the model and row count (batch x beam 1), the weights
    read from memory as in a decode step (CUDA: each of a graph's 20 calls reads its own copy, 20 copies being
    more than the L2 cache holds; launches replayed from the graph): bf16 F.linear; fairseq's
    Int8WeightOnlyLinear (what --quantize makes: the Triton kernels with the launch shape timed at first use);
    on CUDA also the Triton kernels with the untuned launch shape before issue 41 (BLOCK_N 32, BLOCK_K 128, no
    split-K) and with the heuristic's (under capture), and FAIRSEQ_INT8_MATMUL=inductor's form compiled
    (--compile-mode); torch's _weight_int8pack_mm on the same int8 values and scales. What int8 gains per matmul."""
    dtype = DTYPES[args.dtype]
    cuda = device.startswith("cuda")
    copies = 20 if cuda else 1
    out = []
    for shape in linear_shapes(model):
        weights = [torch.randn(shape, dtype=dtype, device=device) * shape[1] ** -0.5 for _ in range(copies)]
        ours = []
        for weight in weights:
            linear = torch.nn.Linear(shape[1], shape[0], bias=False, device=device, dtype=dtype)
            linear.weight.copy_(weight)
            ours.append(Int8WeightOnlyLinear(linear))
        for rows in batches:
            x = torch.randn(rows, shape[1], dtype=dtype, device=device)
            paths = {
                "bf16": lambda i: torch.nn.functional.linear(x, weights[i]),
                "fairseq int8": lambda i: ours[i](x),
                "_weight_int8pack_mm": lambda i: torch._weight_int8pack_mm(x, ours[i].qweight, ours[i].scale.to(dtype)),
            }
            if int8_kernel_available(x):
                untimed = heuristic(rows, *shape)
                paths["triton 32x128"] = lambda i: int8_matmul_kernel(x, ours[i].qweight, ours[i].scale, None, LEGACY)
                paths["triton heuristic"] = lambda i: int8_matmul_kernel(
                    x, ours[i].qweight, ours[i].scale, None, untimed
                )
            if cuda:
                paths["inductor"] = lambda i: compiled_int8(args.compile_mode)(x, ours[i].qweight, ours[i].scale)
            times = {}
            for path, fn in paths.items():
                try:
                    times[path] = graphed_call_time(cycled(fn, copies), device)
                except (RuntimeError, NotImplementedError) as e:  # a path this torch / device lacks
                    times[path] = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
            tuned = tuned_configs().get((row_bucket(rows), shape[0], shape[1], dtype, False, x.device))
            out.append({"shape": list(shape), "rows": rows, "seconds": times, "tuned": tuned and tuned._asdict()})
    return out


def cycled(fn, copies: int):
    """`fn(i)` as a call of no arguments, i going round 0 .. copies - 1 (each call another copy of the weights)."""
    calls = itertools.count()
    return lambda: fn(next(calls) % copies)


_COMPILED = {}


def compiled_int8(mode: str):
    """inductor_int8_linear (FAIRSEQ_INT8_MATMUL=inductor's form) compiled in `mode`, once per process (a
    recompile per weight shape and row count)."""
    if mode not in _COMPILED:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _COMPILED[mode] = torch.compile(inductor_int8_linear, dynamic=False, mode=mode)
    return _COMPILED[mode]


def call_time(fn, device: str, calls: int = 50) -> float:
    """Seconds per call of `fn`, mean of `calls` after 3 warm-up calls."""
    for _ in range(3):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) / calls


INT8_MATMUL_PATHS = ("bf16", "fairseq int8", "triton 32x128", "triton heuristic", "inductor", "_weight_int8pack_mm")


def print_int8_matmuls(rows) -> None:
    paths = INT8_MATMUL_PATHS
    print(
        "\n| Linear weight (out x in) | rows | "
        + " | ".join(f"{p} us" for p in paths)
        + " | best int8 / bf16 time | fairseq int8's launch shape (timed) |"
    )
    print("| --- | ---: |" + " ---: |" * (len(paths) + 1) + " --- |")
    for r in rows:
        t = r["seconds"]
        cells = [f"{1e6 * t[p]:,.1f}" if isinstance(t.get(p), float) else ("-" if p not in t else t[p]) for p in paths]
        int8 = [t[p] for p in paths[1:] if isinstance(t.get(p), float)]
        ratio = f"{min(int8) / t['bf16']:.2f}" if int8 and isinstance(t["bf16"], float) else "-"
        tuned = r["tuned"]
        shape = (
            "-"
            if not tuned
            else f"{'GEMV' if tuned['gemv'] else 'dot'} {tuned['block_n']}x{tuned['block_k']}, split-K "
            f"{tuned['split_k']}, {tuned['num_warps']} warps"
        )
        print(f"| {r['shape'][0]} x {r['shape'][1]} | {r['rows']} | " + " | ".join(cells) + f" | {ratio} | {shape} |")


@torch.no_grad()
def attention_call_rows(model, batches, args, device) -> list:
    """One layer's decode attention per call at the run's mean live length, for each batch size: SDPA over the
    live length's window with a mask (the path without the kernel), the split-KV kernel reading the live keys
    only; timed inside a CUDA graph on CUDA (as the decode step replays it)."""
    attention = next(m for m in model.modules() if hasattr(m, "fuse_qkv_"))
    heads, dim, dtype = attention.num_heads, attention.head_dim, DTYPES[args.dtype]
    total = args.prompt_len + args.new_tokens
    capacity = -(-total // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
    live = args.prompt_len + args.new_tokens // 2 + 1
    window = attention_window(live - 1, capacity)
    out = []
    for batch in batches:
        q = torch.randn(batch, heads, 1, dim, dtype=dtype, device=device)
        keys, values = (torch.randn(batch, heads, capacity, dim, dtype=dtype, device=device) for _ in range(2))
        mask = torch.zeros(window, dtype=dtype, device=device)
        mask[live:] = -float("inf")
        lengths = torch.tensor([live], dtype=torch.int32, device=device)
        paths = {
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                q, keys[:, :, :window], values[:, :, :window], attn_mask=mask.view(1, 1, 1, window)
            )
        }
        if decode_attention_available(q):
            paths["split-KV kernel"] = lambda: split_kv_attention(q, keys, values, lengths, max_length=window)
            # beam search's path: each 64-slot block read from the row a block table names (here a random row)
            table = torch.randint(0, batch, (batch, -(-capacity // CACHE_BLOCK)), dtype=torch.int32, device=device)
            paths["block table"] = lambda: split_kv_attention(q, keys, values, lengths, table, max_length=window)
        times = {path: graphed_call_time(fn, device) for path, fn in paths.items()}
        out.append(
            {
                "batch": batch,
                "heads": heads,
                "head_dim": dim,
                "live": live,
                "window": window,
                "kv_bytes": 2 * batch * heads * live * dim * q.element_size(),
                "seconds": times,
            }
        )
    return out


def graphed_call_time(fn, device: str, calls: int = 20, replays: int = 20) -> float:
    """Seconds per call of `fn`: on CUDA inside a captured graph of `calls` calls (no launch overhead from
    Python, as in the decode step), replayed `replays` times; elsewhere call_time."""
    if not device.startswith("cuda"):
        return call_time(fn, device)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # as the decode step
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), sdpa_kernel(backends):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with sdpa_kernel(backends), torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    sync(device)
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    sync(device)
    return (time.perf_counter() - start) / (calls * replays)


def print_attention_calls(rows) -> None:
    print(
        "\n| decode attention, one layer call | batch | heads x head dim | live keys (window) | sdpa us | "
        "split-KV kernel us | kernel GB/s of live KV | kernel through a block table us |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        t = r["seconds"]
        kernel = t.get("split-KV kernel")
        cells = [
            f"{1e6 * t['sdpa']:,.1f}",
            f"{1e6 * kernel:,.1f}" if kernel else "-",
            f"{r['kv_bytes'] / kernel / 1e9:,.0f}" if kernel else "-",
            f"{1e6 * t['block table']:,.1f}" if "block table" in t else "-",
        ]
        print(
            f"| | {r['batch']} | {r['heads']} x {r['head_dim']} | {r['live']} ({r['window']}) | "
            + " | ".join(cells)
            + " |"
        )


@contextlib.contextmanager
def decode_attention_kernel(enabled: Optional[bool]):
    """The static decode steps built inside use the split-KV attention kernel where it runs, or not (None: as
    set): the generators made here capture their graphs inside, so they keep it."""
    previous = set_decode_attention_kernel(enabled if enabled is not None else decode_attention_enabled())
    try:
        yield
    finally:
        set_decode_attention_kernel(previous)


def kernel_events(prof, device: str) -> list:
    """The profiled run's kernels (CUDA: every GPU activity, kernels inside replayed graphs included; CPU: the
    aten ops called from outside another aten op)."""
    if device.startswith("cuda"):
        return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [
        e
        for e in prof.events()
        if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    ]


def profile_rows(model, run_of, prompts_by_batch, args, device) -> list:
    """For greedy decoding at each batch size (and without the decode attention kernel where it runs): the
    kernels launched per decode step and the 10 kernels taking the most time. Two profiled greedy calls, the
    prompt's forward and one step, then the whole run: their difference is new tokens - 1 decode steps. The
    greedy-compiled row takes the greedy row's short call (a short call of its own would compile the step again
    for another cache size): its prompt's forward and one step are the uncompiled ones, so its kernels per step
    may be off by (uncompiled - compiled kernels of the prefill and one step) / (new tokens - 1). `run_of(prompts,
    row, new_tokens)`: a call that decodes them (benchmark_generate.fork_generate's)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    kernel = decode_attention_available(model_probe(model))
    rows = ["greedy"] + [r for r in args.rows.split(",") if r == "greedy-compiled" or (r == "greedy-sdpa" and kernel)]
    out, short = [], {}
    for row in rows:
        for batch, prompts in prompts_by_batch.items():
            events = {1: short[batch]} if row == "greedy-compiled" else {}
            for new in [n for n in (1, args.new_tokens) if n not in events]:
                with torch.no_grad(), decode_attention_kernel(False if row == "greedy-sdpa" else None):
                    run = run_of(prompts, row, new)
                    run()  # warm-up: allocations, autotuning, graph captures happen outside the profile
                    with profile(activities=activities) as prof:
                        run()
                        sync(device)
                events[new] = kernel_events(prof, device)
            if row == "greedy":
                short[batch] = events[1]
            steps = max(args.new_tokens - 1, 1)
            per_kernel = {}
            for sign, new in ((-1, 1), (1, args.new_tokens)):
                for e in events[new]:
                    calls, micros = per_kernel.get(e.name, (0, 0.0))
                    per_kernel[e.name] = (calls + sign, micros + sign * e.time_range.elapsed_us())
            # time differences of two runs: noise can make a kernel's negative (the CPU's); counted as none
            per_kernel = {name: (calls, max(micros, 0.0)) for name, (calls, micros) in per_kernel.items()}
            total = sum(micros for _, micros in per_kernel.values())
            top = sorted(per_kernel.items(), key=lambda item: -item[1][1])[:10]
            out.append(
                {
                    "row": row,
                    "batch": batch,
                    "kernels_per_step": sum(c for c, _ in per_kernel.values()) / steps,
                    "kernel_us_per_step": total / steps,
                    "top": [
                        {
                            "kernel": name,
                            "calls_per_step": calls / steps,
                            "us_per_step": micros / steps,
                            "share": micros / total if total else 0.0,
                        }
                        for name, (calls, micros) in top
                    ],
                }
            )
    return out


def model_probe(model) -> torch.Tensor:
    """A tensor on the model's device and dtype: what decode_attention_available is asked about."""
    parameter = next(model.parameters())
    return torch.empty(1, device=parameter.device, dtype=parameter.dtype)


def print_profile(rows, device: str) -> None:
    what = "kernels (GPU activities)" if device.startswith("cuda") else "aten ops (CPU)"
    print(f"\nprofile of greedy decoding: {what} per decode step")
    print("\n| row | batch | kernels per step | kernel us per step |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['row']} | {r['batch']} | {r['kernels_per_step']:,.1f} | {r['kernel_us_per_step']:,.1f} |")
    print("\n| row | batch | top kernels by time | calls per step | us per step | % of kernel time |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        for k in r["top"]:
            print(
                f"| {r['row']} | {r['batch']} | {k['kernel'][:90]} | {k['calls_per_step']:,.2f} | "
                f"{k['us_per_step']:,.1f} | {100 * k['share']:.1f}% |"
            )
