#!/usr/bin/env python3
"""Checkpoint benchmark: how long training is blocked per save with --write-checkpoints-asynchronously against
synchronous saves (same run otherwise), where the blocked time goes, and the tokens/s of a run that saves every N
updates against the same run with --no-save; for single-file and sharded (--use-sharded-state, DCP) checkpoints.

    python scripts/benchmark_checkpoint.py --cpu --nproc 2                    # the CPU tables of docs/checkpoints.md
    python scripts/benchmark_checkpoint.py --nproc 1 --layers 32 --embed-dim 2560 --heads 32   # one GPU, bf16

Every run is fairseq-train (`--task dummy_lm`, fully_sharded, Adam, json log every update) on --nproc processes
(--distributed-world-size on CPU, torchrun on GPUs), in a fresh --save-dir under --work-dir. The blocked time and
write time of each save are the log's save_blocked / save_wall (seconds; a background write's save_wall is counted
at the update that sees it done). The phases of an asynchronous save's blocked time are those its log line gives
(fairseq.checkpoint.manager: waiting for the previous write, composing the plain values, the state dicts,
gathering, allocating host buffers, copies as far as the host waits for them, the rest of the Python walk), and
the device-to-host copy's own time (on the side stream, overlapping training) from the line of the completed
write. tokens/s is counted from the log lines after --warmup updates, save intervals included. Prints markdown
tables.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASYNC = "--write-checkpoints-asynchronously"


PHASES = re.compile(r"training was blocked ([0-9.]+) seconds \(([^)]*)\)")
COPY = re.compile(r"device-to-host copy ([0-9.]+) s")
LAYOUTS = {"single": [], "sharded": ["--use-sharded-state"]}


def train_command(args, save_dir, max_update, extra):
    if args.cpu:
        launch = [sys.executable, "-m", "fairseq_cli.train"]
        where = ["--cpu"] + (["--distributed-world-size", str(args.nproc)] if args.nproc > 1 else [])
    else:
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(args.nproc),
            "-m",
            "fairseq_cli.train",
        ]
        where = ["--bf16"]
    return [
        *launch,
        "--task",
        "dummy_lm",
        "--dict-size",
        str(args.vocab - 4),
        "--tokens-per-sample",
        str(args.seq),
        "--batch-size",
        str(args.batch),
        "--arch",
        "transformer_lm_gpt",
        "--decoder-layers",
        str(args.layers),
        "--decoder-embed-dim",
        str(args.embed_dim),
        "--decoder-ffn-embed-dim",
        str(4 * args.embed_dim),
        "--decoder-attention-heads",
        str(args.heads),
        "--share-decoder-input-output-embed",
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
        "--disable-validation",
        "--max-update",
        str(max_update),
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--log-file",
        os.path.join(save_dir, "train.log"),
        "--save-dir",
        save_dir,
        "--num-workers",
        "0",
        "--seed",
        "1",
        "--required-batch-size-multiple",
        "1",
        "--no-epoch-checkpoints",
        # One name per save (the old one removed once the new one is whole): two copies on disk at most, and the
        # synchronous figure is one write, not a write and a copy to checkpoint_last.
        "--no-last-checkpoints",
        "--keep-interval-updates",
        "1",
        "--heartbeat-timeout",
        "1800",
        *where,
        *(["--no-save-optimizer-state"] if args.no_optimizer_state else []),
        *extra,
    ]


def run(args, name, max_update, extra):
    """One fairseq-train run in a fresh --save-dir; returns its train_inner rows and its console log."""
    from fairseq.logging.progress_bar import read_json_log

    save_dir = os.path.join(args.work_dir, name)
    shutil.rmtree(save_dir, ignore_errors=True)
    os.makedirs(save_dir)
    cmd = train_command(args, save_dir, max_update, extra)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = read_json_log(os.path.join(save_dir, "train.log"), "train_inner")
    params = [line.split("| ")[-1] for line in proc.stdout.splitlines() if "num. model params" in line]
    print(
        f"  {name}: {len(rows)} updates in {time.time() - start:.0f} s; {params[0] if params else ''}",
        file=sys.stderr,
        flush=True,
    )
    if not args.keep_checkpoints:
        shutil.rmtree(save_dir, ignore_errors=True)
    return rows, proc.stdout + proc.stderr


def phases(log):
    """[(blocked, {phase: seconds})] of the asynchronous saves in a console log, and the device-to-host copy
    seconds of each completed write."""
    found = []
    for blocked, parts in PHASES.findall(log):
        found.append((float(blocked), {k: float(v) for k, v in (p.rsplit(" ", 1) for p in parts.split(", "))}))
    return found, [float(c) for c in COPY.findall(log)]


def value(row, key):
    return float(row[key]) if key in row else 0.0


def save_times(rows):
    """(blocked, written) seconds of each save, from the lines that carry them (a save's blocked time is in the
    line of the update after it; a background write's time where the loop saw it done)."""
    blocked = [value(r, "save_blocked") for r in rows if value(r, "save_blocked") > 0]
    written = [value(r, "save_wall") for r in rows if value(r, "save_wall") > 0]
    return blocked, written


def tokens_per_s(rows, warmup):
    """Tokens over seconds of the lines after `warmup` updates (seconds of a line: its tokens / its wps)."""
    measured = [r for r in rows if int(r["num_updates"]) > warmup]
    tokens = sum(value(r, "wpb") for r in measured)
    seconds = sum(value(r, "wpb") / value(r, "wps") for r in measured)
    return tokens / seconds


def blocked_table(args):
    every, saves = args.save_every, args.saves
    max_update = every * saves + 1  # a line after every save
    for layout in args.layouts:
        results, logs = {}, {}
        for mode, extra in (("synchronous", []), ("asynchronous", [ASYNC])):
            rows, logs[mode] = run(
                args,
                f"blocked_{layout}_{mode[:5]}",
                max_update,
                ["--save-interval-updates", str(every), *LAYOUTS[layout], *extra],
            )
            results[mode] = save_times(rows)
        sync_blocked = results["synchronous"][0]
        print(f"\n{layout}: time training is blocked per save ({saves} saves, one every {every} updates; seconds):\n")
        print(
            "| mode | " + " | ".join(f"save {i + 1}" for i in range(saves)) + " | mean | mean after the first | "
            "write time (mean) | vs synchronous (after the first) |"
        )
        print("|---" * (saves + 5) + "|")
        for mode, (blocked, written) in results.items():
            later = blocked[1:] or blocked
            ratio = statistics.mean(later) / statistics.mean(sync_blocked[1:] or sync_blocked)
            print(
                f"| {mode} | " + " | ".join(f"{b:.2f}" for b in blocked) + f" | {statistics.mean(blocked):.2f} | "
                f"{statistics.mean(later):.2f} | {statistics.mean(written) if written else 0:.2f} | {ratio:.1%} |"
            )
        phase_table(layout, *phases(logs["asynchronous"]))


def phase_table(layout, saves, copies):
    """Where each asynchronous save's blocked time went (seconds)."""
    if not saves:
        return
    names = list(saves[0][1])
    print(
        f"\n{layout}: phases of each asynchronous save's blocked time (seconds; the device-to-host copy runs on a "
        "side stream while training goes on):\n"
    )
    print("| save | blocked | " + " | ".join(names) + " | device-to-host copy (overlapped) |")
    print("|---" * (len(names) + 3) + "|")
    for i, (blocked, parts) in enumerate(saves):
        copy = f"{copies[i]:.2f}" if i < len(copies) else "-"
        print(f"| {i + 1} | {blocked:.2f} | " + " | ".join(f"{parts[n]:.2f}" for n in names) + f" | {copy} |")


def throughput_table(args):
    """The runs alternate (no-save, asynchronous[, synchronous]) --repeats times, so that a change of the machine's
    load during the benchmark falls on every mode alike; each mode's figure is its median over the repeats."""
    updates, every = args.throughput_updates, args.throughput_save_every
    modes = [("--no-save", ["--no-save"])]
    for layout in args.layouts:
        modes.append(
            (
                f"{layout}: asynchronous save every {every}",
                ["--save-interval-updates", str(every), *LAYOUTS[layout], ASYNC],
            )
        )
        if args.with_sync_throughput:
            modes.append(
                (f"{layout}: synchronous save every {every}", ["--save-interval-updates", str(every), *LAYOUTS[layout]])
            )
    results = {mode: [] for mode, _ in modes}
    for repeat in range(args.repeats):
        for mode, extra in modes:
            load = os.getloadavg()[0]
            name = "_".join(word.strip("-:")[:6] for word in mode.split()[:2])
            rows, _ = run(args, f"tps_{name}_{repeat}", updates, extra)
            results[mode].append((tokens_per_s(rows, args.warmup), save_times(rows)[0], load))
    base = statistics.median(tps for tps, _, _ in results["--no-save"])
    print(
        f"\nTokens/s over updates {args.warmup + 1}-{updates} (saves inside that range included; median of "
        f"{args.repeats} alternating runs):\n"
    )
    print(
        "| run | tokens/s (median) | vs --no-save | each run's tokens/s | blocked per save (s) | load average at "
        "each start |"
    )
    print("|---|---|---|---|---|---|")
    for mode, runs in results.items():
        tps = statistics.median(t for t, _, _ in runs)
        blocked = ", ".join(f"{b:.2f}" for _, bs, _ in runs for b in bs) or "-"
        print(
            f"| {mode} | {tps:.1f} | {tps / base:.3f}x | {', '.join(f'{t:.1f}' for t, _, _ in runs)} | {blocked} | "
            f"{', '.join(f'{load:.1f}' for _, _, load in runs)} |"
        )


def parameters(args) -> int:
    emb = args.vocab * args.embed_dim
    layer = 12 * args.embed_dim**2 + 13 * args.embed_dim
    return emb + args.layers * layer + 2 * args.embed_dim  # tied embeddings, sinusoidal positions


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (fp32) instead of GPUs (bf16)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--embed-dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50000, help="dictionary size (a multiple of 8)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="sequences per process and update")
    p.add_argument("--saves", type=int, default=3, help="saves of the blocked-time part")
    p.add_argument("--save-every", type=int, default=2, help="updates between saves of the blocked-time part")
    p.add_argument(
        "--throughput-updates",
        type=int,
        default=41,
        help="updates of a tokens/s run (41: saves at 20 and 40, each followed by a measured update)",
    )
    p.add_argument("--repeats", type=int, default=1, help="alternating runs of each mode in the tokens/s part")
    p.add_argument("--throughput-save-every", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="updates left out of tokens/s")
    p.add_argument("--with-sync-throughput", action="store_true", help="also the synchronous run in tokens/s")
    p.add_argument("--skip", choices=["blocked", "throughput"], action="append", default=[])
    p.add_argument(
        "--layouts",
        default="single,sharded",
        help="checkpoint layouts to measure, comma-separated: single (one file), sharded (DCP)",
    )
    p.add_argument(
        "--work-dir",
        default=os.path.join(tempfile.gettempdir(), "benchmark_checkpoint"),
        help="where the runs' --save-dir go: a file system with room for two checkpoints",
    )
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument(
        "--no-optimizer-state",
        action="store_true",
        help="checkpoints without Adam's state (a third of the size), where the disk holds less than two",
    )
    args = p.parse_args(argv)
    args.layouts = [layout for layout in args.layouts.split(",") if layout]
    unknown = sorted(set(args.layouts) - set(LAYOUTS))
    if unknown or not args.layouts:
        p.error(f"--layouts {','.join(unknown) or '(none)'}: choose from {', '.join(LAYOUTS)}")
    params = parameters(args)
    print(
        f"model: transformer_lm_gpt {args.layers} x {args.embed_dim}, vocab {args.vocab}: {params / 1e6:.1f}M "
        f"parameters; with Adam a checkpoint holds {params * 12 / 1e9:.2f} GB (fp32 weights and two moments), "
        f"{params * 12 / args.nproc / 1e9:.2f} GB per process; {args.nproc} process(es), "
        f"{'CPU' if args.cpu else 'GPU'}",
        flush=True,
    )
    if "blocked" not in args.skip:
        blocked_table(args)
    if "throughput" not in args.skip:
        throughput_table(args)


if __name__ == "__main__":
    main()
