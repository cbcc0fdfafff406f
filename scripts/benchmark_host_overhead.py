#!/usr/bin/env python3
"""The trainer's own host time per update: fairseq-train against a plain loop over the same model, on the CPU.

One process, no FSDP, a decoder so narrow (width 16, 8 tokens per update) that an update is almost all host
work: Python, dispatch and autograd bookkeeping. A difference between the two rows is what fairseq-train's
update adds around the model (criterion, statistics, clipping, optimizer wrapper, scheduler, logging).

    python scripts/benchmark_host_overhead.py --layers 24 --updates 400

Prints milliseconds per update: the plain loop's mean over the updates after the first quarter, and
fairseq-train's from each `train_inner` log line (1000 / ups) after the first.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TOKENS, VOCAB = 8, 512


def model_flags(layers):
    return [
        "--arch",
        "transformer_lm_gpt",
        "--decoder-layers",
        str(layers),
        "--decoder-embed-dim",
        "16",
        "--decoder-ffn-embed-dim",
        "64",
        "--decoder-attention-heads",
        "2",
        "--dropout",
        "0",
        "--attention-dropout",
        "0",
    ]


def plain_loop_ms(layers, updates):
    import torch
    import torch.nn.functional as F

    from fairseq import options
    from fairseq.models.transformer_lm import TransformerLanguageModel

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["--task", "dummy_lm", "--tokens-per-sample", str(TOKENS), *model_flags(layers)]
    )
    model = TransformerLanguageModel.build(options.convert_namespace_to_config(args).model, VOCAB, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(4, VOCAB, (updates, 1, TOKENS + 1), generator=torch.Generator().manual_seed(1))
    warmup = updates // 4
    for step in range(updates):
        if step == warmup:
            start = time.perf_counter()
        batch = tokens[step]
        logits = model(batch[:, :-1])[0]  # (logits, extra)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / (updates - warmup) * 1e3


def fairseq_train_ms(layers, updates):
    from fairseq.logging.progress_bar import read_json_log

    interval = max(updates // 4, 1)
    with tempfile.TemporaryDirectory() as tmp:
        log_file = os.path.join(tmp, "train.log")
        cmd = [
            sys.executable,
            "-m",
            "fairseq_cli.train",
            "--task",
            "dummy_lm",
            "--dict-size",
            str(VOCAB - 4),
            "--tokens-per-sample",
            str(TOKENS),
            "--batch-size",
            "1",
            "--max-tokens",
            str(TOKENS),
            "--required-batch-size-multiple",
            "1",
            *model_flags(layers),
            "--optimizer",
            "adam",
            "--lr",
            "1e-4",
            "--lr-scheduler",
            "fixed",
            "--clip-norm",
            "1.0",
            "--max-update",
            str(updates),
            "--cpu",
            "--log-format",
            "json",
            "--log-interval",
            str(interval),
            "--no-save",
            "--disable-validation",
            "--save-dir",
            os.path.join(tmp, "checkpoints"),
            "--log-file",
            log_file,
            "--num-workers",
            "1",
        ]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0:
            raise SystemExit(f"fairseq-train failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = read_json_log(log_file, "train_inner")
    return [1000.0 / float(r["ups"]) for r in rows[1:]]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--updates", type=int, default=400)
    args = parser.parse_args(argv)
    if args.updates < 8:
        parser.error(f"--updates {args.updates}: use 8 or more (the first quarter is warm-up)")
    import torch

    torch.set_num_threads(1)  # the subprocess gets the same through OMP_NUM_THREADS
    os.environ["OMP_NUM_THREADS"] = "1"
    loop = plain_loop_ms(args.layers, args.updates)
    fairseq = fairseq_train_ms(args.layers, args.updates)
    print(f"| run ({args.layers} layers of width 16, {TOKENS} tokens per update, CPU) | ms per update |\n|---|---:|")
    print(f"| plain loop | {loop:.1f} |")
    print(f"| fairseq-train (per log interval) | {' / '.join(f'{ms:.1f}' for ms in fairseq)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
