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
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark_bpe as bb  # noqa: E402

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


def bench_scheme(scheme: str, raw: str, args) -> None:
    from fairseq.data import Dictionary
    from fairseq.data.stream_tokenizer import TokenizerSpec, bpe_spec_of
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
    prep = time.perf_counter() - start
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=float, default=45.0)
    p.add_argument("--schemes", nargs="+", default=["gpt2", "sentencepiece"])
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--bpe-train-mb", type=float, default=5.0)
    p.add_argument("--spm-vocab-size", type=int, default=8000)
    p.add_argument("--spm-train-mb", type=float, default=2.0)
    p.add_argument("--workdir", default="/tmp/bench_streaming")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    raw = os.path.join(args.workdir, "train.raw")
    if not os.path.exists(raw) or abs(os.path.getsize(raw) - args.size_mb * 1e6) > 1e6:
        bb.generate_corpus(raw, int(args.size_mb * 1e6))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for scheme in args.schemes:
        bench_scheme(scheme, raw, args)


if __name__ == "__main__":
    main()
