#!/usr/bin/env python3
"""One pass (`fairseq-preprocess --bpe gpt2|sentencepiece` on raw text) against the two-step route run in
sequence (the encoder script with --keep-empty, then `fairseq-preprocess` on its output), same --workers,
same text; the outputs (dict.txt, train.bin/.idx) must be byte-identical (checked).

    python scripts/benchmark_preprocess_bpe.py --size-mb 20 --workers 2 --schemes gpt2 sentencepiece

Corpus and GPT-2 files as scripts/benchmark_bpe.py makes them (pydoc_data.topics paragraphs with synthetic
words; a byte-level BPE of GPT-2's size trained with `tokenizers` on the first --bpe-train-mb MB, since GPT-2's
own files cannot be downloaded here). The sentencepiece model (BPE, --spm-vocab-size) is trained on the first
--spm-train-mb MB; spm_encode.py drops empty lines, so its corpus has none. Each row is fresh processes;
wall and CPU seconds (user + system of the process tree) and the 1-minute load average range are given.
"""

import argparse
import filecmp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark_bpe as bb  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def preprocess_cmd(train, dest, workers, extra=()):
    return [
        PY,
        "-m",
        "fairseq_cli.preprocess",
        "--only-source",
        "--trainpref",
        train,
        "--destdir",
        dest,
        "--workers",
        str(workers),
        *extra,
    ]


def measure(cmd):
    wall, cpu, rss, pss, rc, err, loads = bb.run_measured(cmd)
    if rc != 0:
        raise SystemExit(f"command failed ({rc}): {' '.join(cmd)}\n{err[-2000:]}")
    return wall, cpu, rss, loads


def same_outputs(a, b):
    names = ["dict.txt", "train.bin", "train.idx"]
    return all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size-mb", type=float, default=20.0)
    p.add_argument("--workers", type=int, nargs="+", default=[2])
    p.add_argument("--schemes", nargs="+", default=["gpt2", "sentencepiece"])
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--bpe-train-mb", type=float, default=5.0)
    p.add_argument("--spm-vocab-size", type=int, default=8000)
    p.add_argument("--spm-train-mb", type=float, default=2.0)
    p.add_argument("--workdir", default="/tmp/bench_preprocess_bpe")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    w = lambda *names: os.path.join(args.workdir, *names)  # noqa: E731
    raw = w("train.raw")
    if not os.path.exists(raw) or abs(os.path.getsize(raw) - args.size_mb * 1e6) > 1e6:
        bb.generate_corpus(raw, int(args.size_mb * 1e6))
    rows = []
    for scheme in args.schemes:
        if scheme == "gpt2":
            if not os.path.exists(w("encoder.json")):
                bb.train_bpe_files(raw, args.workdir, args.vocab_size, args.bpe_train_mb)
            text = raw
            flags = ["--bpe", "gpt2", "--gpt2-encoder-json", w("encoder.json"), "--gpt2-vocab-bpe", w("vocab.bpe")]

            def encode_cmd(out, workers):
                return [
                    PY,
                    os.path.join(ROOT, "examples", "roberta", "multiprocessing_bpe_encoder.py"),
                    "--encoder-json",
                    w("encoder.json"),
                    "--vocab-bpe",
                    w("vocab.bpe"),
                    "--inputs",
                    text,
                    "--outputs",
                    out,
                    "--keep-empty",
                    "--workers",
                    str(workers),
                ]
        else:
            text = w("train.noempty.raw")
            if not os.path.exists(text):
                with open(raw, encoding="utf-8") as f, open(text, "w", encoding="utf-8") as g:
                    g.writelines(line for line in f if line.strip())
            if not os.path.exists(w("spm.model")):
                import sentencepiece as spm

                bb.prefix_file(text, w("spm_train.txt"), int(args.spm_train_mb * 1e6))
                spm.SentencePieceTrainer.Train(
                    f"--input={w('spm_train.txt')} --model_prefix={w('spm')} "
                    f"--vocab_size={args.spm_vocab_size} --model_type=bpe --minloglevel=2"
                )
            flags = ["--bpe", "sentencepiece", "--sentencepiece-model", w("spm.model")]

            def encode_cmd(out, workers):  # spm_encode.py has no --workers
                return [
                    PY,
                    os.path.join(ROOT, "scripts", "spm_encode.py"),
                    "--model",
                    w("spm.model"),
                    "--inputs",
                    text,
                    "--outputs",
                    out,
                ]

        for workers in args.workers:
            enc = w(f"{scheme}.encoded")
            two, one = w(f"{scheme}.two.{workers}"), w(f"{scheme}.one.{workers}")
            e = measure(encode_cmd(enc, workers))
            b = measure(preprocess_cmd(enc, two, workers))
            o = measure(preprocess_cmd(text, one, workers, flags))
            ok = same_outputs(two, one)
            mb = os.path.getsize(text) / 1e6
            rows.append((scheme, workers, mb, "encoder script", e))
            rows.append((scheme, workers, mb, "fairseq-preprocess on encoded text", b))
            seq = (e[0] + b[0], e[1] + b[1], max(e[2], b[2]), (min(e[3][0], b[3][0]), max(e[3][1], b[3][1])))
            rows.append((scheme, workers, mb, "**two steps in sequence**", seq))
            rows.append((scheme, workers, mb, f"**one pass: fairseq-preprocess {flags[0]} {flags[1]}**", o))
            rows.append(
                (
                    scheme,
                    workers,
                    mb,
                    f"identical outputs: {ok}; speed-up {seq[0] / o[0]:.2f}x wall, {seq[1] / o[1]:.2f}x CPU",
                    None,
                )
            )
            if not ok:
                raise SystemExit("outputs differ")
    print(f"date {time.strftime('%Y-%m-%d %H:%M')}, nproc {os.cpu_count()}")
    print("| scheme | workers | text MB | route | wall s | CPU s | peak RSS MB (largest process) | load avg (1 min) |")
    print("|---|---|---|---|---|---|---|---|")
    for scheme, workers, mb, route, m in rows:
        if m is None:
            print(f"| {scheme} | {workers} | {mb:.1f} | {route} | | | | |")
        else:
            print(
                f"| {scheme} | {workers} | {mb:.1f} | {route} | {m[0]:.1f} | {m[1]:.1f} | {m[2]:.0f} | "
                f"{m[3][0]:.1f}-{m[3][1]:.1f} |"
            )


if __name__ == "__main__":
    main()
