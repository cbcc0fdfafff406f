#!/usr/bin/env python3
"""Loss parity of --fp8 against bf16: the README's sample corpus, the same seed and data order, N updates each.

    python scripts/fp8_loss_parity.py --updates 300 --recipes tensorwise,rowwise --out fp8_parity
    python scripts/fp8_loss_parity.py --updates 300 --recipes tensorwise --compile --tp-mesh-of-one --out tp_parity

Prepares the sample corpus (examples/language_model/prepare_sample_corpus.py) and binarizes it once, then runs
fairseq-train with --bf16 and with --bf16 --fp8 --fp8-recipe R for each recipe (a 12 x 768 GPT-3-small shape,
dims that float8 GEMMs take), and prints the training loss at the last update and the validation loss of each,
with the relative difference from bf16.
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
    p.add_argument("--compile", action="store_true", help="the --fp8 runs with --compile")
    p.add_argument("--tp-mesh-of-one", action="store_true",
                   help="every run (bf16 too) through the tensor-parallel plan on a one-rank mesh "
                        "(FAIRSEQ_TP_MESH_OF_ONE=1, --criterion vocab_parallel_cross_entropy): the TP code path "
                        "on one GPU")
    args = p.parse_args()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tp = []
    if args.tp_mesh_of_one:
        env["FAIRSEQ_TP_MESH_OF_ONE"] = "1"
        tp = ["--criterion", "vocab_parallel_cross_entropy"]
    text, data = os.path.join(args.out, "text"), os.path.join(args.out, "data-bin")
    if not os.path.exists(os.path.join(data, "dict.txt")):
        run([sys.executable, os.path.join(ROOT, "examples/language_model/prepare_sample_corpus.py"), text], env)
        run([sys.executable, "-m", "fairseq_cli.preprocess", "--only-source", "--trainpref", f"{text}/train.txt",
             "--validpref", f"{text}/valid.txt", "--destdir", data, "--workers", "4"], env)
    from fairseq.logging.progress_bar import read_json_log

    rows = {}
    for name in ["bf16"] + [r for r in args.recipes.split(",") if r]:
        save = os.path.join(args.out, name)
        os.makedirs(save, exist_ok=True)
        log = os.path.join(save, "train.log")
        if os.path.exists(log):
            os.remove(log)
        extra = tp + ([] if name == "bf16" else ["--fp8", "--fp8-recipe", name] + ["--compile"] * args.compile)
        run([sys.executable, "-m", "fairseq_cli.train", data, "--task", "language_modeling",
             "--arch", "transformer_lm_gpt3_small", "--tokens-per-sample", "512", "--batch-size", "16",
             "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0", "--lr", "6e-4",
             "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "50", "--max-update", str(args.updates),
             "--bf16", "--seed", "1", "--log-format", "json", "--log-interval", "50", "--log-file", log,
             "--save-dir", save, "--no-save", "--validate-interval-updates", str(args.updates),
             "--num-workers", "1", *extra], env)
        train = read_json_log(log, "train_inner")[-1]
        valid = read_json_log(log, "valid")[-1]
        rows[name] = {"train_loss": float(train["loss"]), "valid_loss": float(valid.get("valid_loss", valid.get("loss"))),
                      "wps": float(train["wps"])}
    base = rows["bf16"]
    print(f"| run | train loss @ {args.updates} | vs bf16 | valid loss | vs bf16 | wps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        rel_t = r["train_loss"] / base["train_loss"] - 1
        rel_v = r["valid_loss"] / base["valid_loss"] - 1
        print(f"| {name} | {r['train_loss']:.3f} | {100 * rel_t:+.2f}% | {r['valid_loss']:.3f} | "
              f"{100 * rel_v:+.2f}% | {r['wps']:,.0f} |")
    with open(os.path.join(args.out, "parity.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
