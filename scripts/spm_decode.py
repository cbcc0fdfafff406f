#!/usr/bin/env python3
"""Decode sentencepiece pieces or ids back to text, one line per input line, on stdout (upstream fairseq's
scripts/spm_decode.py, same flags and output).

    python scripts/spm_decode.py --model spm.model --input_format piece --input hyp.spm > hyp.txt

With `--input_format id`, the token `<<unk>>` (fairseq's escaped unknown word) is read as id 0.
`--input -` reads stdin.
"""

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fairseq/data/encoders holds these torch-free modules; importing the fairseq package would import torch.
sys.path.append(os.path.join(_ROOT, "fairseq", "data", "encoders"))
import _script_io as script_io  # noqa: E402


CHUNK = 1024


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="sentencepiece model to use for decoding")
    parser.add_argument("--input", required=True, help="input file to decode")
    parser.add_argument("--input_format", choices=["piece", "id"], default="piece")
    return parser


def _tok2int(tok: str, lineno: int, name: str) -> int:
    if tok == "<<unk>>":
        return 0
    try:
        return int(tok)
    except ValueError:
        raise script_io.ScriptError(
            f"{name}, line {lineno}: {tok!r} is not an id (--input_format id expects "
            "space-separated integers; use --input_format piece for pieces)"
        ) from None


def main(argv=None) -> None:
    args = get_parser().parse_args(argv)
    sp = script_io.load_sentencepiece(args.model)
    name = "<stdin>" if args.input == "-" else args.input
    size = sp.GetPieceSize()
    stream = script_io.open_binary_input(args.input)
    try:
        batch = []
        for lineno, line in enumerate(script_io.iter_lines(stream, name), start=1):
            tokens = line.rstrip().split()
            if args.input_format == "id":
                tokens = [_tok2int(t, lineno, name) for t in tokens]
                for t in tokens:
                    if not 0 <= t < size:
                        raise script_io.ScriptError(
                            f"{name}, line {lineno}: id {t} is out of range for {args.model} "
                            f"({size} pieces); was it encoded with another model?"
                        )
            batch.append(tokens)
            if len(batch) >= CHUNK:
                _write(sp, batch)
                batch = []
        _write(sp, batch)
        sys.stdout.flush()
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def _write(sp, batch) -> None:
    if batch:
        sys.stdout.write("".join(text + "\n" for text in sp.Decode(batch)))


if __name__ == "__main__":
    script_io.run_main(main, "spm_decode.py")
