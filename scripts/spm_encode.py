#!/usr/bin/env python3
"""Encode text with a sentencepiece model: every line becomes its pieces (or ids) separated by spaces
(upstream fairseq's scripts/spm_encode.py, same flags and output).

    python scripts/spm_encode.py --model spm.model --output_format piece --inputs train.de train.en \\
        --outputs train.spm.de train.spm.en --min-len 1 --max-len 250

Several inputs are read in step (line i of every input together, stopping at the shortest); `-` is stdin
or stdout. Each line is stripped of surrounding whitespace. A line number is dropped from every output when
any input's line there is empty or, after encoding, has fewer than --min-len or more than --max-len
tokens; stderr gets "processed N lines" every 10,000 lines, then "skipped N empty lines" and "filtered N
lines" (each input's line counted). An output file is replaced only once it is complete.
"""

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fairseq/data/encoders holds these torch-free modules; importing the fairseq package would import torch.
sys.path.append(os.path.join(_ROOT, "fairseq", "data", "encoders"))
import _script_io as script_io  # noqa: E402


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="sentencepiece model to use for encoding")
    parser.add_argument("--inputs", nargs="+", default=["-"], help="input files to filter/encode")
    parser.add_argument("--outputs", nargs="+", default=["-"], help="path to save encoded outputs")
    parser.add_argument("--output_format", choices=["piece", "id"], default="piece")
    parser.add_argument("--min-len", type=int, metavar="N", help="filter sentence pairs with fewer than N tokens")
    parser.add_argument("--max-len", type=int, metavar="N", help="filter sentence pairs with more than N tokens")
    return parser


def main(argv=None) -> None:
    parser = get_parser()
    args = parser.parse_args(argv)
    if len(args.inputs) != len(args.outputs):
        parser.error("number of input and output paths should match")
    script_io.check_outputs(args.inputs, args.outputs)
    sp = script_io.load_sentencepiece(args.model)
    out_type = str if args.output_format == "piece" else int
    min_len, max_len = args.min_len, args.max_len

    def valid(tokens) -> bool:
        return (min_len is None or len(tokens) >= min_len) and (max_len is None or len(tokens) <= max_len)

    streams = [script_io.open_binary_input(p) for p in args.inputs]
    try:
        stats = {"num_empty": 0, "num_filtered": 0}
        lines = 0
        rows = script_io.iter_line_tuples(args.inputs, streams)
        with script_io.AtomicOutputs(args.outputs) as outputs:
            for chunk in script_io.chunked(rows):
                columns = list(zip(*chunk))
                encoded = []  # per column: the tokens of each line, or None (empty / filtered)
                for column in columns:
                    stripped = [line.strip() for line in column]
                    todo = [s for s in stripped if s]
                    pieces = iter(sp.Encode(todo, out_type=out_type) if todo else [])
                    result = []
                    for s in stripped:
                        if not s:
                            stats["num_empty"] += 1
                            result.append(None)
                            continue
                        tokens = next(pieces)
                        if valid(tokens):
                            result.append(tokens)
                        else:
                            stats["num_filtered"] += 1
                            result.append(None)
                    encoded.append(result)
                texts = [[] for _ in columns]
                for row in zip(*encoded):
                    if all(tokens is not None for tokens in row):
                        for text, tokens in zip(texts, row):
                            text.append(" ".join(map(str, tokens)) + "\n")
                for i, text in enumerate(texts):
                    outputs.write(i, "".join(text))
                script_io.progress(lines, lines + len(chunk))
                lines += len(chunk)
        print(f"skipped {stats['num_empty']} empty lines", file=sys.stderr)
        print(f"filtered {stats['num_filtered']} lines", file=sys.stderr)
    finally:
        for s in streams:
            if s is not sys.stdin.buffer:
                s.close()


if __name__ == "__main__":
    script_io.run_main(main, "spm_encode.py")
