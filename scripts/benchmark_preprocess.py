#!/usr/bin/env python3
"""Time fairseq-preprocess (dictionary building + binarization) on a ~40 MB corpus.

The corpus is the sample corpus (examples/language_model/prepare_sample_corpus.py) repeated until it
reaches --size-mb. Each configuration runs in a fresh process through the real CLI code
(`fairseq_cli.preprocess.parse_args` + `main`), so worker processes, file writes and the log are all
included. Reported per run:
  main s      time inside preprocess.main (dictionary + binarization of train)
  process s   wall time of the whole process, including Python start-up and imports (torch)
  tok/s       train tokens (with </s>) / main s
  RSS MB      peak resident memory of the main process and of its largest worker; `import` is the
              main process's RSS right after imports, before any data is read

Each configuration runs --repeat times; the table shows the fastest run and the largest RSS seen.

Usage: python scripts/benchmark_preprocess.py [--size-mb 40] [--workers 1 2] [--repeat 3] [--workdir DIR]
       [--memory-scale 4]   (also run the largest worker count on a corpus this many times larger)
"""

import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPSTREAM_TOKENS_PER_S = 0.24e6  # upstream fairseq-preprocess, 2 workers, this 2-core machine (issue 2)


def build_corpus(workdir: str, size_mb: float) -> str:
    sample_dir = os.path.join(workdir, "sample")
    subprocess.run(
        [sys.executable, os.path.join(REPO, "examples/language_model/prepare_sample_corpus.py"), sample_dir],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    with open(os.path.join(sample_dir, "train.txt"), "rb") as f:
        sample = f.read()
    path = os.path.join(workdir, f"corpus_{size_mb:g}mb.txt")
    target = int(size_mb * 1e6)
    with open(path, "wb") as f:
        for _ in range(max(1, -(-target // len(sample)))):
            f.write(sample)
    return path


def child(argv):
    """Run one preprocess in this process and print its measurements as JSON."""
    from fairseq_cli import preprocess  # imported before the clock starts, as a CLI run would be

    args = preprocess.parse_args(argv)
    import_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    preprocess.main(args)
    elapsed = time.perf_counter() - start
    print(
        json.dumps(
            {
                "main_s": elapsed,
                "import_rss_kb": import_rss,
                "self_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "workers_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
            }
        )
    )


def best_of(repeat: int, corpus: str, workers: int, workdir: str) -> dict:
    runs = [run_config(corpus, workers, workdir) for _ in range(repeat)]
    best = dict(min(runs, key=lambda r: r["main_s"]))
    best["process_s"] = min(r["process_s"] for r in runs)
    for key in ("import_rss_kb", "self_rss_kb", "workers_rss_kb"):
        best[key] = max(r[key] for r in runs)
    return best


def run_config(corpus: str, workers: int, workdir: str) -> dict:
    dest = os.path.join(workdir, f"out_w{workers}_{os.path.basename(corpus)}")
    shutil.rmtree(dest, ignore_errors=True)
    argv = ["--only-source", "--trainpref", corpus, "--destdir", dest, "--workers", str(workers)]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *argv], check=True, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(os.path.join(dest, "preprocess.log"), encoding="utf-8") as f:
        m = re.search(r": (\d+) sents, (\d+) tokens", f.read())
    result.update(
        workers=workers,
        process_s=wall,
        sents=int(m.group(1)),
        tokens=int(m.group(2)),
        corpus_mb=os.path.getsize(corpus) / 1e6,
        dest=dest,
    )
    return result


def same_outputs(a: str, b: str) -> bool:
    names = ("dict.txt", "train.bin", "train.idx")
    return all(open(os.path.join(a, n), "rb").read() == open(os.path.join(b, n), "rb").read() for n in names)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description="benchmark fairseq-preprocess")
    parser.add_argument("--size-mb", type=float, default=40.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration; the fastest is shown")
    parser.add_argument(
        "--memory-scale",
        type=float,
        default=4.0,
        help="also run the largest worker count on a corpus this many times larger (0: skip)",
    )
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one, removed)")
    args = parser.parse_args()

    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(workdir, exist_ok=True)
    try:
        import numpy
        import torch

        print(
            f"python {platform.python_version()}, torch {torch.__version__}, numpy {numpy.__version__}, "
            f"{os.cpu_count()} CPUs ({platform.machine()}), {platform.platform()}"
        )
        corpus = build_corpus(workdir, args.size_mb)
        runs = [best_of(args.repeat, corpus, w, workdir) for w in args.workers]
        if args.memory_scale > 0:
            big = build_corpus(workdir, args.size_mb * args.memory_scale)
            runs.append(best_of(1, big, max(args.workers), workdir))
        header = (
            "| corpus MB | workers | sents | tokens | main s | process s | tok/s (main) | "
            "vs upstream 0.24M | RSS MB import / main / worker |"
        )
        print(header)
        print("|" + "---|" * 9)
        for r in runs:
            tps = r["tokens"] / r["main_s"]
            print(
                f"| {r['corpus_mb']:.1f} | {r['workers']} | {r['sents']} | {r['tokens']} | {r['main_s']:.2f} | "
                f"{r['process_s']:.2f} | {tps / 1e6:.2f}M | {tps / UPSTREAM_TOKENS_PER_S:.1f}x | "
                f"{r['import_rss_kb'] / 1024:.0f} / {r['self_rss_kb'] / 1024:.0f} / "
                f"{r['workers_rss_kb'] / 1024:.0f} |"
            )
        same = [same_outputs(runs[0]["dest"], r["dest"]) for r in runs[1 : len(args.workers)]]
        print(f"outputs identical across --workers {args.workers}: {all(same)}")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
