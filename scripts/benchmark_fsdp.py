#!/usr/bin/env python3
"""FSDP benchmark: fairseq-train under the four combinations of --fsdp-forward-prefetch / --fsdp-sync-free
(optionally with --compile), against a plain FSDP2 training loop of the identical model, on the GPUs at hand.

    python scripts/benchmark_fsdp.py --nproc 2 --layers 12 --embed-dim 6144 --heads 48 --seq 2048 --batch 8
    python scripts/benchmark_fsdp.py --nproc 2 --arch transformer_lm_gpt3_medium --seq 2048 --batch 1

Every run is `torchrun --nproc_per_node N -m fairseq_cli.train --task dummy_lm ...` (bf16, fully_sharded,
AdamW), logged as JSON every --log-interval updates; the first interval is warm-up and is not counted. The
reference loop runs in this same script under torchrun (`--reference-worker`): fully_shard on every layer
and the root with the same mixed precision, fused AdamW, the same loss, no fairseq code in the loop.
Prints one table: tokens/s per GPU, MFU, peak allocated, peak reserved, reserved/allocated, alloc retries,
loss at the last step. Runs on CPU too (gloo, tiny dims) to check the script itself.
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024**3


def model_flags(args):
    flags = ["--arch", args.arch]
    if args.layers:
        flags += ["--decoder-layers", str(args.layers)]
    if args.embed_dim:
        flags += ["--decoder-embed-dim", str(args.embed_dim), "--decoder-ffn-embed-dim", str(4 * args.embed_dim)]
    if args.heads:
        flags += ["--decoder-attention-heads", str(args.heads)]
    return flags


def train_command(args, extra, log_file, save_dir):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.nproc),
        "-m",
        "fairseq_cli.train",
        "--task",
        "dummy_lm",
        "--dict-size",
        str(args.vocab - 4),
        "--tokens-per-sample",
        str(args.seq),
        "--batch-size",
        str(args.batch),
        *model_flags(args),
        "--dropout",
        "0",
        "--attention-dropout",
        "0",
        "--optimizer",
        "adam",
        "--adam-betas",
        "(0.9, 0.95)",
        "--lr",
        "1e-4",
        "--lr-scheduler",
        "fixed",
        "--clip-norm",
        "1.0",
        "--ddp-backend",
        "fully_sharded",
        "--max-update",
        str(args.log_interval * (args.intervals + 1)),
        "--log-format",
        "json",
        "--log-interval",
        str(args.log_interval),
        "--log-file",
        log_file,
        "--no-save",
        "--disable-validation",
        # --no-save writes nothing (but a preempted run does), and a checkpoint_last in the default --save-dir
        # would be resumed: each run gets an empty directory of its own (run_fairseq empties it)
        "--save-dir",
        save_dir,
        "--num-workers",
        str(args.num_workers),
        "--seed",
        "1",
        "--required-batch-size-multiple",
        "1",
        "--max-tokens",
        str(args.seq * args.batch),
    ]
    cmd += ["--cpu"] if args.cpu else ["--bf16"]
    return cmd + extra


def parse_log(log_file, nproc):
    from fairseq.logging.progress_bar import read_json_log

    rows = read_json_log(log_file, "train_inner")
    measured = rows[1:] or rows  # the first interval includes start-up and warm-up
    get = lambda r, k: float(r[k]) if k in r else None  # noqa: E731
    wps = [get(r, "wps") for r in measured]
    mfu = [get(r, "mfu") for r in measured if "mfu" in r]
    alloc = [get(r, "max_cuda_gb_allocated") for r in measured if "max_cuda_gb_allocated" in r]
    reserved = [get(r, "max_cuda_gb_reserved") for r in measured if "max_cuda_gb_reserved" in r]
    retries = sum(get(r, "cuda_alloc_retries") or 0 for r in rows)
    return {
        "tokens_per_s_per_gpu": sum(wps) / len(wps) / nproc if wps else None,
        "mfu": sum(mfu) / len(mfu) if mfu else None,
        "peak_alloc_gib": max(alloc) if alloc else None,
        "peak_reserved_gib": max(reserved) if reserved else None,
        "alloc_retries": retries if alloc else None,
        "loss": rows[-1].get("loss") if rows else None,
    }


def profiled_updates(args):
    """--profile: the last two updates of the warm-up interval, after the first (compiling) update; the
    profiler's overhead and its trace export then stay out of the measured intervals."""
    return args.log_interval - 1, args.log_interval


def slug_of(name):
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def run_fairseq(args, name, extra, env):
    if args.fairseq_flags:
        name = f"{name} {args.fairseq_flags}"
        extra = extra + shlex.split(args.fairseq_flags)
    slug = slug_of(name)
    log_file = os.path.join(args.out, f"{slug}.log")
    if os.path.exists(log_file):
        os.remove(log_file)
    if args.profile:
        start, end = profiled_updates(args)
        extra = extra + ["--profile-updates", f"{start}:{end}", "--profile-dir", os.path.join(args.out, slug)]
    save_dir = os.path.join(args.out, f"{slug}_checkpoints")
    shutil.rmtree(save_dir, ignore_errors=True)
    start = time.time()
    proc = subprocess.run(train_command(args, extra, log_file, save_dir), env=env, capture_output=True, text=True)
    with open(os.path.join(args.out, f"{slug}.output"), "w") as f:  # kept: TORCH_LOGS output lands here
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        return {"name": name, "error": f"exit {proc.returncode}"}
    result = parse_log(log_file, args.nproc)
    result.update(name=name, wall_s=round(time.time() - start, 1))
    if args.profile:
        result["profile"] = read_profile(os.path.join(args.out, slug))
    return result


def read_profile(directory):
    path = os.path.join(directory, "summary_rank0.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def run_reference(args, compile_layers, env):
    name = "plain FSDP2 loop" + (" + compile" if compile_layers else "")
    result_file = os.path.join(args.out, f"reference{'_compile' if compile_layers else ''}.json")
    # The worker's settings travel in the environment: torchrun would try to parse flags placed after the script.
    worker_args = dict(
        vars(args), compile=compile_layers, result_file=result_file, profile_dir=os.path.join(args.out, slug_of(name))
    )
    env = dict(env, FAIRSEQ_BENCHMARK_ARGS=json.dumps(worker_args))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.nproc),
        os.path.abspath(__file__),
        "--reference-worker",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    with open(os.path.join(args.out, f"{slug_of(name)}.output"), "w") as f:  # kept: TORCH_LOGS output lands here
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        return {"name": name, "error": f"exit {proc.returncode}"}
    with open(result_file) as f:
        result = json.load(f)
    result["name"] = name
    if args.profile:
        result["profile"] = read_profile(os.path.join(args.out, slug_of(name)))
    return result


# --------------------------------------------------------------------------------------- reference loop
def reference_worker(args):
    """A plain FSDP2 loop: the same model and loss, fully_shard per layer + root, fused AdamW."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fairseq import options
    from fairseq.logging.profiler import UpdateProfiler
    from fairseq.logging.throughput import default_peak_tflops, flops_per_token
    from fairseq.models.transformer_lm import TransformerLanguageModel

    cpu = args.cpu or not torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu") if cpu else torch.device("cuda", local_rank)
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl")

    parser = options.get_training_parser()
    targs = options.parse_args_and_arch(
        parser,
        [
            "--task",
            "dummy_lm",
            "--tokens-per-sample",
            str(args.seq),
            *model_flags(args),
            "--dropout",
            "0",
            "--attention-dropout",
            "0",
        ],
    )
    cfg = options.convert_namespace_to_config(targs)
    torch.manual_seed(1)
    with torch.device("meta"):
        model = TransformerLanguageModel.build(cfg.model, args.vocab, 1)
    flops = flops_per_token(model, cfg.model.decoder_layers, cfg.model.decoder_embed_dim, args.seq)
    mp = None if cpu else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {"mp_policy": mp} if mp else {}
    for i, layer in enumerate(model.decoder.layers):
        if args.compile:
            layer.compile()
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device=device)
    with torch.no_grad():
        model.reset_parameters()

    def loss_fn(logits, target):
        return F.cross_entropy(logits.float(), target)

    if args.compile:  # as fairseq-train --compile does: the layers and the loss
        loss_fn = torch.compile(loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=not cpu)
    gen = torch.Generator(device="cpu").manual_seed(1 + dist.get_rank())
    steps = args.log_interval * (args.intervals + 1)
    warmup = args.log_interval
    tokens = torch.randint(4, args.vocab, (steps, args.batch, args.seq + 1), generator=gen)
    profiler = None
    if args.profile:
        start, end = profiled_updates(args)
        profiler = UpdateProfiler(start, end, args.profile_dir, dist.get_rank(), device)
    loss = None
    # An event at each step's start, read after the run: each update's GPU time without a sync in the loop.
    step_events = [] if cpu else [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    for step in range(steps):
        if step_events:
            step_events[step].record()
        if step == warmup:
            if not cpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        if profiler is not None:
            profiler.before_update(step + 1)
        batch = tokens[step].to(device, non_blocking=True)
        logits = model(batch[:, :-1])[0]  # (logits, extra)
        loss = loss_fn(logits.view(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if profiler is not None:
            profiler.after_update(step + 1)
    if step_events:
        step_events[steps].record()
    loss_value = loss.item()  # synchronizes: the timed span ends when the GPU is done
    elapsed = time.perf_counter() - start
    tokens_per_s = (steps - warmup) * args.batch * args.seq / elapsed
    result = {"tokens_per_s_per_gpu": tokens_per_s, "loss": f"{loss_value / 0.6931471805599453:.3f}"}
    peak = None if cpu else default_peak_tflops(device)
    result["mfu"] = 100.0 * flops * tokens_per_s / 1e12 / peak if peak else None
    if step_events:
        result["step_ms"] = [round(a.elapsed_time(b), 1) for a, b in zip(step_events, step_events[1:])]
    if not cpu:
        stats = torch.cuda.memory_stats(device)
        values = torch.tensor(
            [stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"], stats.get("num_alloc_retries", 0)],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        result.update(
            peak_alloc_gib=round(values[0].item() / GIB, 1),
            peak_reserved_gib=round(values[1].item() / GIB, 1),
            alloc_retries=int(values[2].item()),
        )
    if dist.get_rank() == 0:
        with open(args.result_file, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- table
def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def print_table(args, results, reference):
    ref_tps = reference.get("tokens_per_s_per_gpu") if reference else None
    header = (
        "| run | tokens/s/GPU | vs plain loop | MFU % | peak alloc GiB | peak reserved GiB | reserved/alloc "
        "| alloc retries | last loss |"
    )
    print(
        f"\nmodel: {' '.join(model_flags(args))}, seq {args.seq}, batch {args.batch}/GPU, {args.nproc} "
        f"{'CPU processes' if args.cpu else 'GPUs'}, bf16={not args.cpu}"
    )
    print(header)
    print("|" + "---|" * 9)
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error']} |||||||")
            continue
        tps = r.get("tokens_per_s_per_gpu")
        alloc, res = r.get("peak_alloc_gib"), r.get("peak_reserved_gib")
        print(
            f"| {r['name']} | {fmt(tps, ',.0f')} | "
            f"{fmt(tps / ref_tps if tps and ref_tps else None, '.3f')}x | {fmt(r.get('mfu'), '.1f')} | "
            f"{fmt(alloc, '.1f')} | {fmt(res, '.1f')} | {fmt(res / alloc if alloc and res else None, '.2f')} | "
            f"{fmt(r.get('alloc_retries'), '.0f')} | {r.get('loss', '-')} |"
        )


def print_profiles(results):
    """Per update, from each run's profile: where the GPU's time went and how long it waited for the host."""
    profiled = [(r["name"], r["profile"]) for r in results if r.get("profile")]
    if not profiled:
        return
    categories = []
    for _, p in profiled:
        categories += [c for c in p["category_ms"] if c not in categories]
    print("\nper update (torch.profiler, mean of the profiled updates; ms; categories sum kernel time over streams):")
    print("| run | wall | GPU busy | GPU idle | kernels | kernel sum |" + "".join(f" {c} |" for c in categories))
    print("|" + "---|" * (6 + len(categories)))
    for name, p in profiled:
        cells = [fmt(p["category_ms"].get(c), ".1f") for c in categories]
        print(
            f"| {name} | {p['wall_ms']:.1f} | {p['gpu_busy_ms']:.1f} | {fmt(p['gpu_idle_ms'], '.1f')} | "
            f"{p['kernels']:.0f} | {p.get('kernel_sum_ms', 0):.1f} |" + "".join(f" {c} |" for c in cells)
        )
    base_name, base = profiled[0]
    for name, p in profiled[1:]:
        print(f"\nkernels that differ most, {name} minus {base_name} (ms per update, calls per update):")
        for kernel, ms, calls in kernel_differences(base, p)[:15]:
            print(f"  {ms:+8.2f} {calls:+7.1f}  {kernel[:110]}")
    for name, p in profiled:
        print(f"\nhost time (self, ms per update), {name}:")
        for op in p.get("top_host_ops", [])[:12]:
            print(f"  {op['cpu_ms']:8.2f} {op['count']:7.1f}  {op['name'][:110]}")
        print(f"\nhost time (inclusive, named ranges, ms per update), {name}:")
        for op in p.get("top_host_ranges", [])[:16]:
            print(f"  {op['cpu_total_ms']:8.2f} {op['count']:7.1f}  {op['name'][:110]}")


def kernel_differences(base, other):
    """(kernel name, ms difference, calls difference), largest absolute time difference first."""
    a, b = base.get("kernels_by_name", {}), other.get("kernels_by_name", {})
    rows = []
    for name in set(a) | set(b):
        ka, kb = a.get(name, {"count": 0, "ms": 0}), b.get(name, {"count": 0, "ms": 0})
        rows.append((name, kb["ms"] - ka["ms"], kb["count"] - ka["count"]))
    return sorted(rows, key=lambda r: -abs(r[1]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: all GPUs, or 2 on CPU)")
    parser.add_argument("--arch", default="transformer_lm_gpt", help="preset; dims below override it")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--embed-dim", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1, help="sequences per GPU")
    parser.add_argument("--vocab", type=int, default=50272)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--intervals", type=int, default=2, help="measured log intervals after the warm-up one")
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="also run --compile (and the compiled loop)")
    parser.add_argument(
        "--no-compile-rows",
        action="store_true",
        help="with --compile: compile only the --fp8 rows (no compiled loop or bf16 --compile row)",
    )
    parser.add_argument(
        "--combos",
        default="all",
        help="flag combinations to run: 'all' (the four), or a comma-separated list of none, "
        "prefetch, sync-free, both; '' for none of them (only --fp8 rows)",
    )
    parser.add_argument(
        "--fp8",
        default="",
        metavar="RECIPES",
        help="also run fairseq-train --fp8 with these comma-separated recipes (tensorwise, rowwise, "
        "rowwise_with_gw_hp; tensorwise+ag adds --fp8-fsdp-all-gather), without FSDP flags",
    )
    parser.add_argument(
        "--tp-mesh-of-one",
        action="store_true",
        help="run every --fp8 row a second time through the tensor-parallel plan on a one-rank mesh "
        "(FAIRSEQ_TP_MESH_OF_ONE=1): the TP code path's cost on one GPU",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also record a torch.profiler trace of two measured updates of every run "
        "(fairseq-train --profile-updates) and print per-update GPU busy/idle time and kernel "
        "time by category; the profiled updates are the warm-up interval's last two, so "
        "tokens/s are not affected (needs --log-interval >= 3)",
    )
    parser.add_argument(
        "--fairseq-flags",
        default="",
        metavar="FLAGS",
        help="more fairseq-train flags for every fairseq-train row, e.g. --fairseq-flags=--no-reshard-after-forward "
        "(the plain loop is not changed)",
    )
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU, fp32 (to test this script)")
    parser.add_argument("--out", default="benchmark_out")
    parser.add_argument("--reference-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reference_worker:
        return reference_worker(argparse.Namespace(**json.loads(os.environ["FAIRSEQ_BENCHMARK_ARGS"])))
    if args.profile and args.log_interval < 3:
        parser.error(
            "--profile records updates LOG_INTERVAL-1 and LOG_INTERVAL (after the first, compiling one): "
            "pass --log-interval 3 or more"
        )
    named = {"none": (False, False), "prefetch": (True, False), "sync-free": (False, True), "both": (True, True)}
    names = list(named) if args.combos == "all" else [n for n in args.combos.split(",") if n]
    unknown = [n for n in names if n not in named]
    if unknown:
        parser.error(f"--combos {args.combos!r}: unknown {', '.join(unknown)}; use all or a list of {', '.join(named)}")
    combos = [named[n] for n in names]
    import torch

    args.cpu = args.cpu or not torch.cuda.is_available()
    args.nproc = args.nproc or (2 if args.cpu else torch.cuda.device_count())
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    results = []
    reference = None
    if not args.no_reference:
        reference = run_reference(args, False, env)
        results.append(reference)
    for prefetch, sync_free in combos:
        extra = (["--fsdp-forward-prefetch"] if prefetch else []) + (["--fsdp-sync-free"] if sync_free else [])
        name = "fairseq-train " + (" ".join(extra) or "(no flags)")
        results.append(run_fairseq(args, name.replace("--fsdp-", "").strip(), extra, env))
        print_table(args, results, reference)
    for recipe in [r for r in args.fp8.split(",") if r]:
        extra = ["--fp8", "--fp8-recipe", recipe.replace("+ag", "")]  # no FSDP flags: fairseq-train's default
        extra += ["--fp8-fsdp-all-gather"] if recipe.endswith("+ag") else []
        extra += ["--compile"] if args.compile else []
        name = f"fairseq-train --fp8 {recipe}" + (" --compile" if args.compile else "")
        results.append(run_fairseq(args, name, extra, env))
        print_table(args, results, reference)
        if args.tp_mesh_of_one:
            results.append(
                run_fairseq(args, name + " (TP plan, 1-rank mesh)", extra, dict(env, FAIRSEQ_TP_MESH_OF_ONE="1"))
            )
            print_table(args, results, reference)
    if args.compile and not args.no_compile_rows:
        if not args.no_reference:
            results.append(run_reference(args, True, env))
        for prefetch, sync_free in combos[-1:]:
            extra = (
                ["--compile"]
                + (["--fsdp-forward-prefetch"] if prefetch else [])
                + (["--fsdp-sync-free"] if sync_free else [])
            )
            results.append(run_fairseq(args, "fairseq-train " + " ".join(extra).replace("--fsdp-", ""), extra, env))
    print_table(args, results, reference)
    for r in results:
        if r.get("step_ms"):
            print(f"GPU ms per update (between step starts), {r['name']}: {' '.join(map(str, r['step_ms']))}")
    if args.profile:
        print_profiles(results)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    failed = [r["name"] for r in results if "error" in r]
    if failed:  # the table says so too; a script driving the benchmark must see it in the exit status
        sys.stderr.write(
            f"benchmark_fsdp.py: {len(failed)} run(s) failed ({', '.join(failed)}); their output is above "
            f"and in {args.out}\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
