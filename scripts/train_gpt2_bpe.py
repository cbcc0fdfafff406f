#!/usr/bin/env python3
"""Train a byte-level BPE on your own text and write it as GPT-2's files, for `--bpe gpt2`.

Writes, in OUTDIR:
- encoder.json: token -> id, GPT-2's format (tokens spelled with GPT-2's byte-to-character table, ids 0..N-1,
  `<|endoftext|>` last, as in GPT-2's file);
- vocab.bpe: `#version: 0.2`, then one merge `A B` per line in rank order;
- dict.txt: the fairseq dictionary that `fairseq-preprocess --srcdict` takes for text encoded with them: each
  id as a symbol in id order (index = id + 4, after the 4 special symbols), padded with `madeupwordNNNN` rows
  to a multiple of --pad-to (as examples/large_lm/README.md's snippet writes it for GPT-2's own files).

The BPE is trained with the `tokenizers` library (installed with transformers: `pip install
'fairseq[export]'`), pre-tokenized as GPT-2 (its regular expression, no prefix space), on each line of the
inputs stripped, as the encoder script and `fairseq-preprocess --bpe gpt2` read them.

Usage: python scripts/train_gpt2_bpe.py --vocab-size 8000 --outdir gpt2_bpe corpus/train.raw [more.txt ...]
"""

import argparse
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fairseq/data/encoders holds these torch-free modules; importing the fairseq package would import torch.
sys.path.append(os.path.join(_ROOT, "fairseq", "data", "encoders"))
import _write_errors  # noqa: E402

ENDOFTEXT = "<|endoftext|>"


def train(paths, vocab_size: int, min_frequency: int = 2):
    """(vocab, merges): token -> id and the merges in rank order, of a byte-level BPE trained on the files."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError:
        raise SystemExit(
            "train_gpt2_bpe.py needs the `tokenizers` library: pip install tokenizers "
            "(or pip install 'fairseq[export]', which brings it with transformers)"
        ) from None

    def lines():
        for path in paths:
            with open(path, encoding="utf-8", newline="\n") as f:
                for line in f:
                    line = line.strip()
                    if line:
                        yield line

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[ENDOFTEXT],
    )
    tok.train_from_iterator(lines(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    # GPT-2 keeps <|endoftext|> last; `tokenizers` gives special tokens the first ids.
    tokens = sorted((t for t in model["vocab"] if t != ENDOFTEXT), key=model["vocab"].get) + [ENDOFTEXT]
    return {t: i for i, t in enumerate(tokens)}, merges


def write(outdir, vocab, merges, pad_to: int = 16):
    os.makedirs(outdir, exist_ok=True)
    files = {name: os.path.join(outdir, name) for name in ("encoder.json", "vocab.bpe", "dict.txt")}
    with open(files["encoder.json"], "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(files["vocab.bpe"], "w", encoding="utf-8", newline="\n") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    ids = sorted(vocab.values())
    padding = -(4 + len(ids)) % pad_to
    with open(files["dict.txt"], "w", encoding="utf-8", newline="\n") as f:
        f.writelines(f"{i} 1\n" for i in ids)
        f.writelines(f"madeupword{k:04d} 0\n" for k in range(padding))
    return files


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="UTF-8 text files, one line per paragraph or document")
    parser.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help="tokens in encoder.json, <|endoftext|> and the 256 bytes included (GPT-2: 50257)",
    )
    parser.add_argument("--outdir", required=True, help="where encoder.json, vocab.bpe and dict.txt go")
    parser.add_argument("--min-frequency", type=int, default=2, help="merge pairs seen at least this often")
    parser.add_argument(
        "--pad-to",
        type=int,
        default=16,
        help="dictionary size (4 specials + ids + padding) a multiple of this (GPT-2: 50272)",
    )
    args = parser.parse_args(argv)
    if args.vocab_size < 257:
        parser.error(f"--vocab-size {args.vocab_size}: at least 257 (the 256 bytes and <|endoftext|>)")
    for path in args.inputs:
        if not os.path.isfile(path):
            parser.error(f"{path}: no such file")
    try:
        with _write_errors.writing(args.outdir, "--outdir"):  # an unusable --outdir fails before training
            os.makedirs(args.outdir, exist_ok=True)
        vocab, merges = train(args.inputs, args.vocab_size, args.min_frequency)
        with _write_errors.writing(args.outdir, "--outdir"):  # e.g. a read-only directory
            files = write(args.outdir, vocab, merges, args.pad_to)
    except _write_errors.OutputError as e:
        print(f"train_gpt2_bpe.py: error: {e}", file=sys.stderr)
        return 1
    size = 4 + len(vocab) + (-(4 + len(vocab)) % args.pad_to)
    print(f"{len(vocab)} tokens, {len(merges)} merges; dictionary of {size} symbols: " + ", ".join(files.values()))
    if len(vocab) < args.vocab_size:
        print(f"note: the text has fewer distinct merges than --vocab-size {args.vocab_size} asks for", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
