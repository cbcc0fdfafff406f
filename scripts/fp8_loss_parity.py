#!/usr/bin/env python3
"""Loss parity of --fp8 against bf16: the README's sample corpus, the same seed and data order, N updates each.

    python scripts/fp8_loss_parity.py --updates 300 --recipes tensorwise,rowwise --out fp8_parity
    python scripts/fp8_loss_parity.py --updates 300 --recipes tensorwise --compile --tp-mesh-of-one --out tp_parity

Prepares the sample corpus (examples/language_model/prepare_sample_corpus.py) and binarizes it once, then runs
fairseq-train with --bf16 and with --bf16 --fp8 --fp8-recipe R for each recipe (a 12 x 768 GPT-3-small shape,
dims that float8 GEMMs take), and prints the training loss at the last update and the validation loss of each,
with the relative difference from bf16. With --compile the bf16 baseline is run compiled too (a float8 run is
compared with the bf16 run of the same compile mode: inductor's fused kernels round differently from eager ones,
which is not float8's doing) and the eager bf16 run is kept as a row. With several --seeds, each seed's runs
are compared among themselves and the mean of the relative differences is printed too. --curve prints the train
loss of every log interval (--log-interval), to see whether a gap closes or grows.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, env):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc.stdout + proc.stderr


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=300)
    p.add_argument("--recipes", default="tensorwise,rowwise")
    p.add_argument("--out", default="fp8_parity")
    p.add_argument("--compile", action="store_true", help="the --fp8 runs and a second bf16 baseline with --compile")
    p.add_argument("--seeds", default="1", help="comma-separated --seed values (default 1)")
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--curve", action="store_true", help="print the train loss at every log interval")
    p.add_argument(
        "--tp-mesh-of-one",
        action="store_true",
        help="every run (bf16 too) through the tensor-parallel plan on a one-rank mesh "
        "(FAIRSEQ_TP_MESH_OF_ONE=1, --criterion vocab_parallel_cross_entropy): the TP code path "
        "on one GPU",
    )
    args = p.parse_args()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tp = []
    if args.tp_mesh_of_one:
        env["FAIRSEQ_TP_MESH_OF_ONE"] = "1"
        tp = ["--criterion", "vocab_parallel_cross_entropy"]
    text, data = os.path.join(args.out, "text"), os.path.join(args.out, "data-bin")
    if not os.path.exists(os.path.join(data, "dict.txt")):
        run([sys.executable, os.path.join(ROOT, "examples/language_model/prepare_sample_corpus.py"), text], env)
        run(
            [
                sys.executable,
                "-m",
                "fairseq_cli.preprocess",
                "--only-source",
                "--trainpref",
                f"{text}/train.txt",
                "--validpref",
                f"{text}/valid.txt",
                "--destdir",
                data,
                "--workers",
                "4",
            ],
            env,
        )
    names = ["bf16"] + (["bf16+compile"] if args.compile else []) + [r for r in args.recipes.split(",") if r]
    seeds = [int(x) for x in args.seeds.split(",")]
    rows = {}
    for seed in seeds:
        for name in names:
            rows[(name, seed)] = train_run(args, name, seed, tp, data, env)
    print(f"| run | seed | train loss @ {args.updates} | vs bf16 | valid loss | vs bf16 | wps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rel = {}
    for (name, seed), r in rows.items():
        base = rows[(baseline_of(name, args.compile), seed)]
        rel_t = r["train_loss"] / base["train_loss"] - 1
        rel_v = r["valid_loss"] / base["valid_loss"] - 1
        rel.setdefault(name, []).append((rel_t, rel_v))
        print(
            f"| {name} | {seed} | {r['train_loss']:.3f} | {100 * rel_t:+.2f}% | {r['valid_loss']:.3f} | "
            f"{100 * rel_v:+.2f}% | {r['wps']:,.0f} |"
        )
    if len(seeds) > 1:
        print(
            "\nmean over seeds: "
            + ", ".join(
                f"{name} train {100 * sum(t for t, _ in v) / len(v):+.2f}% valid {100 * sum(x for _, x in v) / len(v):+.2f}%"
                for name, v in rel.items()
            )
        )
    if args.curve:
        for seed in seeds:
            print(f"\ntrain loss per interval, seed {seed}: update | " + " | ".join(names))
            for i, update in enumerate(rows[("bf16", seed)]["curve_updates"]):
                print(f"{update} | " + " | ".join(f"{rows[(n, seed)]['curve'][i]:.4f}" for n in names))
    with open(os.path.join(args.out, "parity.json"), "w") as f:
        json.dump({f"{name}@{seed}": r for (name, seed), r in rows.items()}, f, indent=1)


def baseline_of(name: str, compiled: bool) -> str:
    """The bf16 run a row is compared with: the compiled one for compiled float8 runs."""
    return "bf16+compile" if compiled and name != "bf16" else "bf16"


def train_run(args, name: str, seed: int, tp: list, data: str, env: dict) -> dict:
    from fairseq.logging.progress_bar import read_json_log

    save = os.path.join(args.out, f"{name}-seed{seed}")
    os.makedirs(save, exist_ok=True)
    log = os.path.join(save, "train.log")
    if os.path.exists(log):
        os.remove(log)
    recipe = name.split("+")[0]
    extra = tp + ([] if recipe == "bf16" else ["--fp8", "--fp8-recipe", recipe])
    extra += ["--compile"] if args.compile and name != "bf16" else []
    run(
        [
            sys.executable,
            "-m",
            "fairseq_cli.train",
            data,
            "--task",
            "language_modeling",
            "--arch",
            "transformer_lm_gpt3_small",
            "--tokens-per-sample",
            "512",
            "--batch-size",
            "16",
            "--optimizer",
            "adam",
            "--adam-betas",
            "(0.9, 0.98)",
            "--clip-norm",
            "1.0",
            "--lr",
            "6e-4",
            "--lr-scheduler",
            "inverse_sqrt",
            "--warmup-updates",
            "50",
            "--max-update",
            str(args.updates),
            "--bf16",
            "--seed",
            str(seed),
            "--log-format",
            "json",
            "--log-interval",
            str(args.log_interval),
            "--log-file",
            log,
            "--save-dir",
            save,
            "--no-save",
            "--validate-interval-updates",
            str(args.updates),
            "--num-workers",
            "1",
            *extra,
        ],
        env,
    )
    inner = read_json_log(log, "train_inner")
    valid = read_json_log(log, "valid")[-1]
    return {
        "train_loss": float(inner[-1]["loss"]),
        "valid_loss": float(valid.get("valid_loss", valid.get("loss"))),
        "wps": float(inner[-1]["wps"]),
        "curve": [float(r["loss"]) for r in inner],
        "curve_updates": [int(r["num_updates"]) for r in inner],
    }


if __name__ == "__main__":
    main()
