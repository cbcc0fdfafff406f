#!/usr/bin/env python3
"""Plot loss, throughput and GPU memory over updates from a fairseq-train JSON log (--log-format json).

    python scripts/plot_log.py checkpoints/train.log memory.png [--title "12x6144, batch 8"]

Memory shows the interval peaks of allocated and reserved memory and the device total (peak reserved +
cuda_gb_free, the headroom the log reports), so the gap between the allocator's reservation and what tensors
use is visible. Needs matplotlib.
"""

import argparse
import sys

from fairseq.logging.progress_bar import read_json_log


def read_train_inner(path):
    rows = read_json_log(path, "train_inner")
    if not rows:
        raise SystemExit(f"{path}: no train_inner lines (was it written with --log-format json?)")
    return rows


def series(rows, key):
    points = [(int(r["num_updates"]), float(r[key])) for r in rows if key in r and "num_updates" in r]
    return [p[0] for p in points], [p[1] for p in points]


def plot(rows, output, title=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(*series(rows, "loss"), label="loss (base 2)")
    axes[0].set_ylabel("loss")
    axes[1].plot(*series(rows, "wps"), label="tokens/s (all GPUs)")
    axes[1].set_ylabel("tokens/s")
    x_alloc, alloc = series(rows, "max_cuda_gb_allocated")
    x_res, reserved = series(rows, "max_cuda_gb_reserved")
    _, free = series(rows, "cuda_gb_free")
    if alloc:
        axes[2].plot(x_alloc, alloc, label="peak allocated")
        axes[2].plot(x_res, reserved, label="peak reserved")
        if free:
            axes[2].plot(x_res, [r + f for r, f in zip(reserved, free)], "k--", label="device total")
        axes[2].set_ylabel("GiB")
    else:
        axes[2].text(0.5, 0.5, "no CUDA memory statistics in this log", ha="center", transform=axes[2].transAxes)
    axes[2].set_xlabel("updates")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("output")
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    plot(read_train_inner(args.log), args.output, args.title)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    sys.exit(main())
