#!/usr/bin/env python3
"""Encode text with GPT-2's BPE: every line becomes its GPT-2 ids separated by spaces (upstream fairseq's
examples/roberta/multiprocessing_bpe_encoder.py, same flags and output).

    python examples/roberta/multiprocessing_bpe_encoder.py --encoder-json gpt2_bpe/encoder.json \\
        --vocab-bpe gpt2_bpe/vocab.bpe --inputs train.raw --outputs train.bpe --keep-empty --workers 8

Several inputs are read in step (line i of every input together, stopping at the shortest) and written
to the outputs in the same order; `-` is stdin or stdout. Each line is stripped of surrounding whitespace
first. Without --keep-empty, a line number where any input's line is empty is dropped from every output
(and counted in the final "[num_filtered_EMPTY] filtered N lines" on stderr); with it, empty lines give
empty output lines. stderr also gets "processed N lines" every 10,000 lines, as upstream prints them.

Unlike upstream, encoding runs in Rust (tiktoken; see fairseq/data/encoders/gpt2_bpe_utils.py), with no
cache that grows (upstream's grows with every distinct word, in every worker); a single input is sent to
the workers as blocks of bytes (decoded, split, stripped and encoded there, a block's lines in one call)
so that this process only reads and writes; at most two blocks per worker are in flight, and an output
file is replaced only once it is complete. Runs from a checkout without installing fairseq and without
importing torch.
"""

import argparse
import contextlib
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker process: --workers decides

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# fairseq/data/encoders holds these torch-free modules; importing the fairseq package would import torch.
sys.path.append(os.path.join(_ROOT, "fairseq", "data", "encoders"))
import gpt2_bpe_utils  # noqa: E402
import _script_io as script_io  # noqa: E402


_bpe = None  # the encoder, in this process and (loaded by _init_worker) in every worker


def _init_worker(encoder_json: str, vocab_bpe: str) -> None:
    global _bpe
    _bpe = gpt2_bpe_utils.get_encoder(encoder_json, vocab_bpe)


def _drop_empty(rows, keep_empty):
    """Stripped rows, and how many were dropped for holding an empty line (unless `keep_empty`)."""
    kept = [[line.strip() for line in row] for row in rows]
    if keep_empty:
        return kept, 0
    full = [row for row in kept if all(row)]
    return full, len(kept) - len(full)


def encode_block(args):
    """(encoded text per output, lines dropped as empty, lines read) for a block of whole lines of the
    single input (the input's bytes: decoding and splitting happen here, in the worker)."""
    block, first_lineno, name, keep_empty = args
    lines = [line.strip() for line in script_io.split_lines(block, name, first_lineno)]
    n_rows = len(lines)
    if not keep_empty and not all(lines):
        lines = [line for line in lines if line]
    return [_bpe.encode_lines(lines, check=False)], n_rows - len(lines), n_rows


def encode_chunk(args):
    """(encoded text per output, line tuples dropped as empty, line tuples read) for a chunk of line tuples."""
    rows, keep_empty = args
    kept, dropped = _drop_empty(rows, keep_empty)
    texts = [
        _bpe.encode_lines([row[column] for row in kept], check=False) for column in range(len(rows[0]) if rows else 0)
    ]
    return texts, dropped, len(rows)


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--encoder-json", help="path to encoder.json")
    parser.add_argument("--vocab-bpe", type=str, help="path to vocab.bpe")
    parser.add_argument("--inputs", nargs="+", default=["-"], help="input files to filter/encode")
    parser.add_argument("--outputs", nargs="+", default=["-"], help="path to save encoded outputs")
    parser.add_argument("--keep-empty", action="store_true", help="keep empty lines")
    parser.add_argument("--workers", type=int, default=20)
    return parser


def main(argv=None) -> None:
    parser = get_parser()
    args = parser.parse_args(argv)
    if len(args.inputs) != len(args.outputs):
        parser.error("number of input and output paths should match")
    script_io.check_outputs(args.inputs, args.outputs)
    for flag, value in (("--encoder-json", args.encoder_json), ("--vocab-bpe", args.vocab_bpe)):
        if not value:
            parser.error(f"{flag} is required: {gpt2_bpe_utils.DOWNLOAD_HINT}")
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: must be at least 1")

    global _bpe
    _bpe = gpt2_bpe_utils.get_encoder(args.encoder_json, args.vocab_bpe)  # errors here, once, not per worker
    streams = [script_io.open_binary_input(p) for p in args.inputs]
    try:
        if len(streams) == 1:  # blocks of bytes: this process only reads and writes
            name = args.inputs[0] if args.inputs[0] != "-" else "<stdin>"
            func = encode_block
            chunks = ((block, lineno, name, args.keep_empty) for block, lineno in script_io.iter_blocks(streams[0]))
        else:  # line tuples, read here in step
            func = encode_chunk
            rows = script_io.iter_line_tuples(args.inputs, streams)
            chunks = ((chunk, args.keep_empty) for chunk in script_io.chunked(rows))
        lines = dropped = 0
        results = script_io.ordered_map(
            func, chunks, args.workers, initializer=_init_worker, initargs=(args.encoder_json, args.vocab_bpe)
        )
        with script_io.AtomicOutputs(args.outputs) as outputs, contextlib.closing(results):  # workers ended on exit
            for texts, n_dropped, n_rows in results:
                for i, text in enumerate(texts):
                    outputs.write_bytes(i, text)
                script_io.progress(lines, lines + n_rows)
                lines += n_rows
                dropped += n_dropped
        if dropped:
            print(f"[num_filtered_EMPTY] filtered {dropped} lines", file=sys.stderr)
    finally:
        for s in streams:
            if s is not sys.stdin.buffer:
                s.close()


if __name__ == "__main__":
    script_io.run_main(main, "multiprocessing_bpe_encoder.py")
