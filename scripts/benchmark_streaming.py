#!/usr/bin/env python3
"""--task streaming_language_modeling's loader against the data-bin route, and its resume time.

    python scripts/benchmark_streaming.py --size-mb 45 --schemes gpt2 sentencepiece

For each --bpe scheme: the corpus (scripts/benchmark_bpe.py's pydoc_data.topics paragraphs, 4 per document) as
DATA/train/00/web.jsonl; `fairseq-preprocess --json-key text` of it (the dictionary, and the data-bin route);
then, in this one process (what one tokenizing worker does, plus the packing the data thread does):
- stream: read + parse + tokenize + pack every block of the file (CorpusStream, --sample-break-mode none,
  --tokens-per-sample 2048), tokens/s;
- data-bin: every block of the same text read back from train.bin by TokenBlockDataset, tokens/s;
- resume: a fresh CorpusStream restored from the state saved after 1e4 and after 1e7 tokens (when the corpus
  has them), seconds until its next block is ready (open, seek, tokenize one chunk).
GPT-2 files are a byte-level BPE of GPT-2's size trained here (GPT-2's own cannot be downloaded).

    python scripts/benchmark_streaming.py --train --size-mb 5 --schemes gpt2 --updates 40 --rounds 3

`--train` measures training instead: the same tiny CPU model (tests/train_fixtures.py's transformer_lm, 2 layers
of 32) trained for --updates updates by fairseq-train on the same text, as the data-bin (`--task
language_modeling`) and as the JSONL (`--task streaming_language_modeling`, same dictionary and --bpe), with the
same batch flags and --num-workers; the runs alternate (data-bin, stream, data-bin, ...) --rounds times so a
drift of the machine's load hits both routes. Each run's figure is the median `wps` of its JSON log lines after
the first --skip-updates; the ratio is stream / data-bin of the medians over the rounds (and the median of each
round's ratio: a round's two runs share the machine's load). Last, the training thread's wait for the streaming
task's batches (the iterator fairseq-train builds), with a consumer that keeps the CPU busy as long per batch as
a data-bin update took: whether the loader is on the critical path, whatever the load.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmark_bpe as bb  # noqa: E402
from tests.train_fixtures import TINY_MODELS  # noqa: E402

BLOCK = 2048
MARKS = (10_000, 10_000_000)


def write_jsonl(raw: str, path: str, per_doc: int = 4) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(raw, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        doc = []
        for line in f:
            doc.append(line.rstrip("\n"))
            if len(doc) == per_doc:
                out.write(json.dumps({"text": "\n".join(doc)}) + "\n")
                doc = []


def scheme_files(scheme: str, raw: str, workdir: str, args):
    """(--bpe flags for fairseq-preprocess, option values for the streaming spec)."""
    if scheme == "gpt2":
        enc, vocab, _, _ = bb.train_bpe_files(raw, workdir, args.vocab_size, args.bpe_train_mb)
        return ["--bpe", "gpt2", "--gpt2-encoder-json", enc, "--gpt2-vocab-bpe", vocab], {
            "gpt2_encoder_json": enc,
            "gpt2_vocab_bpe": vocab,
        }
    import sentencepiece as spm

    model = os.path.join(workdir, "spm")
    sample = os.path.join(workdir, "spm_train.txt")
    bb.prefix_file(raw, sample, int(args.spm_train_mb * 1e6))
    spm.SentencePieceTrainer.Train(
        input=sample, model_prefix=model, vocab_size=args.spm_vocab_size, model_type="bpe", minloglevel=2
    )
    return ["--bpe", "sentencepiece", "--sentencepiece-model", model + ".model"], {
        "sentencepiece_model": model + ".model"
    }


def stream_pass(jsonl: str, spec, eos: int):
    """(tokens, seconds, {mark: state}) of one pass over the file in this process."""
    from fairseq.data.stream_blocks import CorpusStream

    stream = CorpusStream("web", [jsonl], spec, BLOCK, "none", eos, endless=False)
    tokens, states, start = 0, {}, time.perf_counter()
    marks = list(MARKS)
    while (block := stream.next_block()) is not None:
        tokens += len(block[1])
        while marks and tokens >= marks[0]:
            states[marks.pop(0)] = (tokens, stream.state())
    return tokens, time.perf_counter() - start, states


def data_bin_pass(bin_dir: str):
    from fairseq.data import Dictionary
    from fairseq.data.indexed_dataset import MMapIndexedDataset
    from fairseq.data.token_block_dataset import TokenBlockDataset

    ds = MMapIndexedDataset(os.path.join(bin_dir, "train"))
    d = Dictionary.load(os.path.join(bin_dir, "dict.txt"))
    start = time.perf_counter()
    blocks = TokenBlockDataset(ds, ds.sizes, BLOCK, d.pad(), d.eos(), break_mode="none", include_targets=True)
    tokens = sum(len(blocks[i][1]) for i in range(len(blocks)))
    return tokens, time.perf_counter() - start


def resume_seconds(jsonl: str, spec, eos: int, state) -> float:
    from fairseq.data.stream_blocks import CorpusStream

    start = time.perf_counter()
    stream = CorpusStream("web", [jsonl], spec, BLOCK, "none", eos, endless=False)
    stream.load_state(state)
    stream.next_block()
    return time.perf_counter() - start


def prepare(scheme: str, raw: str, args):
    """(JSONL file, data-bin directory, --bpe flags, the scheme's option values, fairseq-preprocess seconds)."""
    from fairseq_cli import preprocess

    workdir = os.path.join(args.workdir, scheme)
    os.makedirs(workdir, exist_ok=True)
    jsonl = os.path.join(workdir, "d", "train", "00", "web.jsonl")
    write_jsonl(raw, jsonl)
    flags, files = scheme_files(scheme, raw, workdir, args)
    bin_dir = os.path.join(workdir, "bin")
    start = time.perf_counter()
    preprocess.main(
        preprocess.parse_args(
            [
                "--only-source",
                "--json-key",
                "text",
                "--trainpref",
                jsonl,
                "--destdir",
                bin_dir,
                "--workers",
                "1",
                *flags,
            ]
        )
    )
    return jsonl, bin_dir, flags, files, time.perf_counter() - start


def bench_scheme(scheme: str, raw: str, args) -> None:
    from fairseq.data import Dictionary
    from fairseq.data.stream_tokenizer import TokenizerSpec, bpe_spec_of

    jsonl, bin_dir, _, files, prep = prepare(scheme, raw, args)
    dict_path = os.path.join(bin_dir, "dict.txt")
    spec = TokenizerSpec("fairseq", (dict_path,), bpe=bpe_spec_of(scheme, files))
    eos = Dictionary.load(dict_path).eos()
    tokens, seconds, states = stream_pass(jsonl, spec, eos)
    bin_tokens, bin_seconds = data_bin_pass(bin_dir)
    print(
        f"{scheme}: {os.path.getsize(jsonl) / 1e6:.1f} MB JSONL, {tokens:,} tokens "
        f"(data-bin: {bin_tokens:,}); fairseq-preprocess --json-key --workers 1: {prep:.1f} s"
    )
    print(f"  stream (one process: read, parse, tokenize, pack): {tokens / seconds:,.0f} tokens/s ({seconds:.1f} s)")
    print(f"  data-bin (TokenBlockDataset reads): {bin_tokens / bin_seconds:,.0f} tokens/s ({bin_seconds:.2f} s)")
    for mark in MARKS:
        if mark in states:
            at, state = states[mark]
            best = min(resume_seconds(jsonl, spec, eos, state) for _ in range(3))
            print(f"  resume at {at:,} tokens in (byte {state['offset']:,}): {best:.3f} s to the next block")
        else:
            print(f"  resume at {mark:,} tokens: the corpus is shorter (raise --size-mb)")


# ---- --train: training tokens/s, streaming against data-bin ------------------------------------------------
TINY_MODEL = TINY_MODELS["transformer_lm"]["model"]  # the tests' tiny decoder: 2 layers of 32


def train_argv(args, updates: int) -> list:
    """The flags both routes train with (model, optimizer, batch, logging)."""
    return [
        *TINY_MODEL,
        "--optimizer",
        "adam",
        "--lr",
        "0.002",
        "--tokens-per-sample",
        str(args.tokens_per_sample),
        "--batch-size",
        str(args.batch_size),
        "--sample-break-mode",
        "none",
        "--max-update",
        str(updates),
        "--num-workers",
        str(args.num_workers),
        "--seed",
        "1",
        "--cpu",
        "--disable-validation",
        "--no-save",
        "--log-format",
        "json",
        "--log-interval",
        "1",
    ]


def run_wps(argv: list, skip: int) -> float:
    """The median wps of fairseq-train's JSON log lines after the first `skip` updates."""
    proc = subprocess.run(
        [sys.executable, "-m", "fairseq_cli.train", *argv], capture_output=True, text=True, env=dict(os.environ)
    )
    if proc.returncode != 0:
        raise SystemExit(f"fairseq-train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    wps = []
    for line in (proc.stdout + proc.stderr).splitlines():
        start = line.find("{")
        if start < 0 or '"wps"' not in line:
            continue
        try:
            record = json.loads(line[start:])
        except ValueError:
            continue
        if "num_updates" in record and int(record["num_updates"]) > skip:
            wps.append(float(record["wps"]))
    if not wps:
        raise SystemExit(f"no wps in fairseq-train's log lines:\n{proc.stderr[-2000:]}")
    return statistics.median(wps)


def loader_waits(argv: list, batch_size: int, batches: int, step_s: float):
    """(first wait, later waits: total and max, in seconds) of the training thread for the streaming task's
    batches (the task and iterator fairseq-train builds from `argv`), while it keeps the CPU busy with torch
    matrix products for `step_s` per batch, as a training step of that length would."""
    import torch

    from fairseq import options, registry

    cfg = options.convert_namespace_to_config(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = registry.TASK_REGISTRY.get(cfg.task._name).setup_task(cfg.task)
    task.load_dataset(cfg.dataset.train_subset, for_training=True)
    epoch_itr = task.get_batch_iterator(task.dataset(cfg.dataset.train_subset), max_sentences=batch_size, seed=1)
    itr, a, waits = epoch_itr.next_epoch_itr(), torch.randn(256, 256), []
    for _ in range(batches):
        start = time.perf_counter()
        next(itr)
        waits.append(time.perf_counter() - start)
        start = time.perf_counter()
        while time.perf_counter() - start < step_s:
            a = (a @ a).tanh()
    epoch_itr.close()
    return waits[0], sum(waits[1:]), max(waits[1:])


def bench_train(scheme: str, raw: str, args) -> None:
    jsonl, bin_dir, flags, _, _ = prepare(scheme, raw, args)
    data = os.path.dirname(os.path.dirname(os.path.dirname(jsonl)))  # DATA of DATA/train/00/web.jsonl
    shutil.copyfile(os.path.join(bin_dir, "dict.txt"), os.path.join(data, "dict.txt"))
    common = train_argv(args, args.updates)
    routes = {
        "data-bin": ["--task", "language_modeling", bin_dir, *common],
        "stream": ["--task", "streaming_language_modeling", data, *flags, *common],
    }
    results = {name: [] for name in routes}
    for r in range(args.rounds):
        order = list(routes) if r % 2 == 0 else list(reversed(routes))
        for name in order:
            load = os.getloadavg()[0]
            results[name].append(run_wps(routes[name], args.skip_updates))
            print(f"  round {r + 1} {name}: {results[name][-1]:,.0f} tokens/s (load average {load:.1f})", flush=True)
    binned, streamed = statistics.median(results["data-bin"]), statistics.median(results["stream"])
    pairs = statistics.median(s / b for s, b in zip(results["stream"], results["data-bin"]))
    print(
        f"{scheme}: training tokens/s, median of {args.rounds} runs x {args.updates} updates "
        f"(--batch-size {args.batch_size} --tokens-per-sample {args.tokens_per_sample} --num-workers "
        f"{args.num_workers}): data-bin {binned:,.0f}, stream {streamed:,.0f}; stream / data-bin: "
        f"{streamed / binned:.3f} of the medians, {pairs:.3f} median of the rounds' ratios"
    )
    step_s = args.batch_size * args.tokens_per_sample / binned
    first, later, worst = loader_waits(routes["stream"], args.batch_size, args.wait_batches, step_s)
    print(
        f"  stream: the training thread waited {first:.2f} s for the first batch (workers starting), then "
        f"{later:.3f} s in all for the next {args.wait_batches - 1} (at most {worst * 1e3:.1f} ms once) "
        f"while busy {step_s:.2f} s per batch"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=float, default=45.0)
    p.add_argument("--schemes", nargs="+", default=["gpt2", "sentencepiece"])
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--bpe-train-mb", type=float, default=5.0)
    p.add_argument("--spm-vocab-size", type=int, default=8000)
    p.add_argument("--spm-train-mb", type=float, default=2.0)
    p.add_argument("--workdir", default="/tmp/bench_streaming")
    p.add_argument("--train", action="store_true", help="training tokens/s of both routes instead (module docstring)")
    p.add_argument("--updates", type=int, default=40)
    p.add_argument("--skip-updates", type=int, default=5, help="updates left out of the median (start-up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokens-per-sample", type=int, default=512)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--wait-batches", type=int, default=60, help="batches of the training thread's wait probe")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    raw = os.path.join(args.workdir, "train.raw")
    if not os.path.exists(raw) or abs(os.path.getsize(raw) - args.size_mb * 1e6) > 1e6:
        bb.generate_corpus(raw, int(args.size_mb * 1e6))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for scheme in args.schemes:
        (bench_train if args.train else bench_scheme)(scheme, raw, args)


if __name__ == "__main__":
    main()
