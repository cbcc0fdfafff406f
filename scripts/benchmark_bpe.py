#!/usr/bin/env python3
"""GPT-2 BPE encoding throughput and memory: examples/roberta/multiprocessing_bpe_encoder.py against a
pure-Python implementation of the published algorithm run the way upstream's script runs it.

    python scripts/benchmark_bpe.py --sizes-mb 2.5 40 --workers 2

For each corpus size both run as fresh processes with the same `--workers`, on the same generated corpus
and BPE files, with `--keep-empty`; their outputs must be byte-identical. The table gives wall time
(process start to exit, loading the BPE files included), input MB/s, output tokens/s, CPU seconds of all
processes (user + system) and input MB per CPU second, the peak RSS of the largest process (VmHWM) and
the peak of the summed proportional set size (PSS: shared pages split between the processes that share
them) of all processes, both sampled from /proc every 50 ms.

The reference (`--reference-child`, also runnable alone) is clean-room code of the published algorithm
in upstream's structure, so that it costs what upstream costs: the GPT-2 regex (the `regex` package, in
the dev extra), the byte to character table, per piece a look-up in an unbounded per-process cache of
space-joined symbols (upstream's: it grows with the number of distinct pieces seen) split again for the id
look-ups, on a miss upstream's merge loop (tuple of symbols, set of pairs, `tuple.index` scan), and
`multiprocessing.Pool(workers).imap(encode_lines, zip(*inputs), 100)` in the main process, printing each
line and "processed N lines" as upstream does.

The load average (1 minute) is sampled every 50 ms during each row; the table gives its range. The
machine should be otherwise idle: on a shared one, wall times grow with the load, CPU seconds much less.

Corpus: paragraphs of the text behind the quickstart's sample corpus (pydoc_data.topics) with a fraction of
the words replaced by words drawn from a heavy-tailed distribution over a synthetic lexicon and by numbers,
so that, as in real text, new words keep appearing as the corpus grows. BPE files: by default a byte-level
BPE trained with `tokenizers` on the first 10 MB of that corpus (`--bpe-train-mb`, `--vocab-size`, default
GPT-2's 50,257), written in GPT-2's format; pass `--encoder-json/--vocab-bpe` to use GPT-2's own files instead.
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENCODER_SCRIPT = os.path.join(ROOT, "examples", "roberta", "multiprocessing_bpe_encoder.py")


def _load_encoder_module():
    """fairseq/data/encoders/gpt2_bpe_utils.py by itself (importing `fairseq.data` would import torch)."""
    import importlib.util

    encoders = os.path.join(ROOT, "fairseq", "data", "encoders")
    if encoders not in sys.path:
        sys.path.append(encoders)  # its sibling gpt2_bpe_files (the file readers), as the encoder script does
    spec = importlib.util.spec_from_file_location("_bench_gpt2_bpe_utils", os.path.join(encoders, "gpt2_bpe_utils.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the reference: the published algorithm, as upstream's script runs it ----------------------------------
def get_pairs(word):
    """The set of adjacent symbol pairs of a word (a tuple of symbols)."""
    return set(zip(word, word[1:]))


class ReferenceEncoder:
    """Upstream's encoder, in its structure: the GPT-2 regex (the `regex` package), bytes shown as characters,
    and a per-process cache from piece to its space-joined BPE symbols that keeps every piece seen (it grows
    with the number of distinct pieces); on a miss, the merge loop over a tuple of symbols, with the set of
    pairs recomputed after each merge and each rank's occurrences found by `tuple.index`."""

    def __init__(self, encoder_json, vocab_bpe):
        import regex

        with open(encoder_json, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(vocab_bpe, encoding="utf-8") as f:
            lines = f.read().split("\n")[1:-1]
        merges = [tuple(line.split()) for line in lines]
        self.bpe_ranks = dict(zip(merges, range(len(merges))))
        self.pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
        self.byte_encoder = {}
        extra = 256
        for b in range(256):
            if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255:
                self.byte_encoder[b] = chr(b)
            else:
                self.byte_encoder[b] = chr(extra)
                extra += 1
        self.cache = {}

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        pairs = get_pairs(word)
        if not pairs:
            return token
        while True:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new_word.extend(word[i:])
                    break
                new_word.extend(word[i:j])
                i = j
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
            if len(word) == 1:
                break
            pairs = get_pairs(word)
        word = " ".join(word)
        self.cache[token] = word
        return word

    def encode(self, text):
        bpe_tokens = []
        for token in self.pat.findall(text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            bpe_tokens.extend(self.encoder[bpe_token] for bpe_token in self.bpe(token).split(" "))
        return bpe_tokens


_reference = None


def _reference_init(encoder_json, vocab_bpe):
    global _reference
    _reference = ReferenceEncoder(encoder_json, vocab_bpe)


def _reference_encode_lines(lines):
    enc_lines = []
    for line in lines:
        line = line.strip()
        if len(line) == 0 and not _keep_empty:
            return ["EMPTY", None]
        tokens = list(map(str, _reference.encode(line)))
        enc_lines.append(" ".join(tokens))
    return ["PASS", enc_lines]


_keep_empty = True


def reference_main(argv):
    """Upstream's script structure with the reference encoder (same flags and output as the real script)."""
    import contextlib
    from collections import Counter
    from multiprocessing import Pool

    global _keep_empty
    p = argparse.ArgumentParser()
    p.add_argument("--encoder-json")
    p.add_argument("--vocab-bpe")
    p.add_argument("--inputs", nargs="+", default=["-"])
    p.add_argument("--outputs", nargs="+", default=["-"])
    p.add_argument("--keep-empty", action="store_true")
    p.add_argument("--workers", type=int, default=20)
    args = p.parse_args(argv)
    _keep_empty = args.keep_empty
    with contextlib.ExitStack() as stack:
        inputs = [stack.enter_context(open(x, "r", encoding="utf-8")) if x != "-" else sys.stdin for x in args.inputs]
        outputs = [
            stack.enter_context(open(x, "w", encoding="utf-8")) if x != "-" else sys.stdout for x in args.outputs
        ]
        pool = Pool(args.workers, initializer=_reference_init, initargs=(args.encoder_json, args.vocab_bpe))
        encoded_lines = pool.imap(_reference_encode_lines, zip(*inputs), 100)
        stats = Counter()
        for i, (filt, enc_lines) in enumerate(encoded_lines, start=1):
            if filt == "PASS":
                for enc_line, output_h in zip(enc_lines, outputs):
                    print(enc_line, file=output_h)
            else:
                stats["num_filtered_" + filt] += 1
            if i % 10000 == 0:
                print("processed {} lines".format(i), file=sys.stderr)
        for k, v in stats.most_common():
            print("[{}] filtered {} lines".format(k, v), file=sys.stderr)
        pool.close()
        pool.join()


# ---- corpus and BPE files ------------------------------------------------------------------------------------
SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "ti",
    "vo",
    "ze",
    "bra",
    "sto",
    "pli",
    "qua",
    "ench",
    "ow",
    "ish",
    "tr",
    "an",
    "el",
    "um",
    "ix",
    "or",
    "ath",
    "ung",
]


def synthetic_word(index: int) -> str:
    parts = []
    index += 1
    while index:
        index, r = divmod(index, len(SYLLABLES))
        parts.append(SYLLABLES[r])
    word = "".join(parts)
    return word.capitalize() if index % 7 == 0 and len(parts) % 3 == 0 else word


def generate_corpus(path: str, size_bytes: int, seed: int = 0) -> None:
    """Lines of text (paragraphs), some words replaced by heavy-tailed synthetic words and numbers."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    paragraphs = [p for name in sorted(topics) for p in re.split(r"\n\s*\n", topics[name]) if p.strip()]
    written = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        while written < size_bytes:
            para = rng.choice(paragraphs).replace("\n", " ")
            words = para.split(" ")
            for i in range(len(words)):
                u = rng.random()
                if u < 0.10:  # Zipf-like (exponent 1.15): distinct words grow about as real text's do
                    words[i] = synthetic_word(int(rng.paretovariate(0.15)) % 50_000_000)
                elif u < 0.115:
                    words[i] = str(rng.randint(0, 10 ** rng.randint(1, 7)))
            line = " ".join(words) + "\n"
            if rng.random() < 0.05:
                line += "\n"  # some empty lines (kept with --keep-empty)
            f.write(line)
            written += len(line.encode("utf-8"))


def prefix_file(src: str, dst: str, size_bytes: int) -> None:
    """The first whole lines of `src` holding at least `size_bytes` bytes."""
    with open(src, "rb") as f, open(dst, "wb") as g:
        written = 0
        for line in f:
            if written >= size_bytes:
                break
            g.write(line)
            written += len(line)


def train_bpe_files(corpus: str, directory: str, vocab_size: int, train_mb: float):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    sample = os.path.join(directory, "bpe_train.txt")
    prefix_file(corpus, sample, int(train_mb * 1e6))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train([sample], trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    enc, bpe = os.path.join(directory, "encoder.json"), os.path.join(directory, "vocab.bpe")
    with open(enc, "w", encoding="utf-8") as f:
        json.dump(model["vocab"], f, ensure_ascii=False)
    with open(bpe, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return enc, bpe, len(model["vocab"]), len(merges)


# ---- measuring a process tree --------------------------------------------------------------------------------
def _children(pid: int):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _hwm_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def run_measured(cmd):
    """(wall s, CPU s, largest-process peak RSS MB, peak summed PSS MB, returncode, stderr, (min, max) 1-minute
    load average) of a command.

    CPU seconds are user + system time of the process and the workers it waited for (os.wait4), the
    measure that other load on a shared machine disturbs least.

    Both memory numbers are sampled from /proc every 50 ms over the process and its descendants: VmHWM
    (each process's own peak RSS) and Pss. (The kernel's ru_maxrss of a child is no use here: it keeps
    the RSS the child had as a fork of this process before exec.)"""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_pss, peak_hwm = [0], {}
    loads = [os.getloadavg()[0]]
    done = threading.Event()

    def sample():
        while not done.is_set():
            loads.append(os.getloadavg()[0])
            pids, todo = [], [proc.pid]
            while todo:
                p = todo.pop()
                pids.append(p)
                todo.extend(_children(p))
            peak_pss[0] = max(peak_pss[0], sum(_pss_kb(p) for p in pids))
            for p in pids:
                peak_hwm[p] = max(peak_hwm.get(p, 0), _hwm_kb(p))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    peak_rss = max(peak_hwm.values(), default=0)
    return (
        wall,
        usage.ru_utime + usage.ru_stime,
        peak_rss / 1024,
        peak_pss[0] / 1024,
        proc.returncode,
        stderr.decode(errors="replace"),
        (min(loads), max(loads)),
    )


def count_tokens(path: str) -> int:
    n = 0
    with open(path, "rb") as f:
        for line in f:
            n += len(line.split())
    return n


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[2.5, 40.0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=50257,
        help="of the BPE trained when no files are given (GPT-2's size by default)",
    )
    parser.add_argument("--bpe-train-mb", type=float, default=10.0, help="train that BPE on this much of the corpus")
    parser.add_argument("--encoder-json", help="GPT-2's encoder.json (default: train a BPE on the corpus)")
    parser.add_argument("--vocab-bpe", help="GPT-2's vocab.bpe")
    parser.add_argument("--workdir", help="keep the corpus, BPE files and outputs here (default: a temp dir)")
    parser.add_argument("--skip-reference", action="store_true", help="time only multiprocessing_bpe_encoder.py")
    parser.add_argument(
        "--reference-child",
        nargs=argparse.REMAINDER,
        help="run the reference encoder with upstream's script flags (what the benchmark times)",
    )
    args = parser.parse_args(argv)
    if args.reference_child is not None:
        return reference_main(args.reference_child)

    work = args.workdir or tempfile.mkdtemp(prefix="bench_bpe_")
    os.makedirs(work, exist_ok=True)
    full = os.path.join(work, "corpus.txt")
    biggest = int(max(args.sizes_mb) * 1e6)
    if not os.path.exists(full) or os.path.getsize(full) < biggest:
        generate_corpus(full, biggest)
    if args.encoder_json:
        enc, bpe = args.encoder_json, args.vocab_bpe
        with open(enc, encoding="utf-8") as f:
            vocab_desc = f"{len(json.load(f))} tokens from {enc}"
    else:
        enc, bpe, n_vocab, n_merges = train_bpe_files(full, work, args.vocab_size, args.bpe_train_mb)
        vocab_desc = (
            f"byte-level BPE trained on the first {args.bpe_train_mb:g} MB: {n_vocab} tokens, {n_merges} merges"
        )
    engine = _load_encoder_module().get_encoder(enc, bpe).engine
    print(
        f"# corpus: {full}; BPE: {vocab_desc}; workers: {args.workers}; engine: {engine}; "
        f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )

    rows = []
    for size_mb in args.sizes_mb:
        corpus = os.path.join(work, f"corpus_{size_mb:g}MB.txt")
        prefix_file(full, corpus, int(size_mb * 1e6))
        nbytes = os.path.getsize(corpus)
        impls = [(f"multiprocessing_bpe_encoder.py ({engine})", [sys.executable, ENCODER_SCRIPT])]
        if not args.skip_reference:
            impls.append(
                (
                    "pure-Python reference, upstream's script",
                    [sys.executable, os.path.abspath(__file__), "--reference-child"],
                )
            )
        outputs = []
        for name, cmd in impls:
            out = os.path.join(work, f"out_{size_mb:g}MB_{len(outputs)}.bpe")
            flags = [
                "--encoder-json",
                enc,
                "--vocab-bpe",
                bpe,
                "--inputs",
                corpus,
                "--outputs",
                out,
                "--keep-empty",
                "--workers",
                str(args.workers),
            ]
            wall, cpu, rss, pss, rc, err, load = run_measured(cmd + flags)
            if rc != 0:
                sys.exit(f"{name} failed ({rc}):\n{err[-3000:]}")
            tokens = count_tokens(out)
            outputs.append(out)
            rows.append(
                (
                    nbytes / 1e6,
                    name,
                    args.workers,
                    wall,
                    nbytes / 1e6 / wall,
                    tokens / wall,
                    cpu,
                    nbytes / 1e6 / cpu,
                    rss,
                    pss,
                    tokens,
                    load,
                )
            )
            print(f"# {size_mb:g} MB {name}: {wall:.1f} s, load {load[0]:.2f}-{load[1]:.2f}", flush=True)
        if len(outputs) == 2:
            with open(outputs[0], "rb") as a, open(outputs[1], "rb") as b:
                if a.read() != b.read():
                    sys.exit(f"outputs differ: {outputs[0]} vs {outputs[1]}")

    print()
    print(
        "| corpus MB | implementation | workers | wall s | MB/s | tokens/s | CPU s | MB per CPU s "
        "| peak RSS MB (largest process) | peak PSS MB (all processes) | tokens | load avg (1 min) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mb, name, w, wall, mbs, tps, cpu, mbc, rss, pss, tokens, load in rows:
        print(
            f"| {mb:.1f} | {name} | {w} | {wall:.2f} | {mbs:.2f} | {tps / 1e3:.0f}k | {cpu:.2f} | {mbc:.2f} "
            f"| {rss:.0f} | {pss:.0f} | {tokens} | {load[0]:.2f}-{load[1]:.2f} |"
        )
    if not args.skip_reference:
        print()
        for i in range(0, len(rows), 2):
            print(
                f"{rows[i][0]:.1f} MB: {rows[i][4] / rows[i + 1][4]:.2f}x the reference's MB/s, "
                f"{rows[i][7] / rows[i + 1][7]:.2f}x its MB per CPU second; outputs identical"
            )
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
