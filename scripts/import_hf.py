#!/usr/bin/env python3
"""Import a Hugging Face transformers OPT or XGLM model directory as a checkpoint of this fork.

    python scripts/import_hf.py opt-1.3b opt-1.3b-fairseq

HF_DIR is a directory transformers' save_pretrained wrote (config.json, model.safetensors or its shards, or
pytorch_model.bin, read with weights_only=True) with the model's tokenizer files (vocab.json + merges.txt or
tokenizer.json for OPT, sentencepiece.bpe.model for XGLM). Writes OUT_DIR/checkpoint_best.pt, dict.txt, the
--bpe files (encoder.json + vocab.bpe, or sentencepiece.bpe.model) and model_flags.txt (fairseq-train's flags for
the same model, for --finetune-from-model). Other architectures are refused in one line. See docs/export_hf.md.
"""

import argparse
import logging
import shlex
import sys

from fairseq_cli.console import run_console_script


def build_parser() -> argparse.ArgumentParser:
    from fairseq.export.hf_import import DTYPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("hf_dir", metavar="HF_DIR", help="transformers model directory (OPT or XGLM)")
    parser.add_argument(
        "output",
        metavar="OUT_DIR",
        help="directory to write: absent or empty, or this script's earlier output with --overwrite",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="weights' dtype in the checkpoint (default: as stored in HF_DIR)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR when it holds an earlier output of this script (its "
        "fairseq_manifest.json lists the files; nothing else is ever deleted)",
    )
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO)
    from fairseq.export import hf_import

    try:
        result = hf_import.import_hf(args.hf_dir, args.output, dtype=args.dtype, overwrite=args.overwrite)
    except ImportError as e:  # transformers / safetensors not installed: one line, like the other errors
        raise ValueError(str(e)) from None
    # A command that runs as printed once DATA is a data directory made with OUT_DIR's dict.txt (and --bpe files):
    # the model's flags (its positions as --tokens-per-sample), a batch of one block, an optimizer at a small
    # fine-tuning rate; docs/finetune_opt.md has a whole recipe.
    command = [
        "fairseq-train",
        "DATA",
        "--task",
        "language_modeling",
        *result["flags"],
        *result["bpe_flags"],
        "--optimizer",
        "adam",
        "--lr",
        "2e-05",
        "--max-tokens",
        str(result["positions"]),
        "--finetune-from-model",
        result["checkpoint"],
    ]
    print(
        f"wrote {result['checkpoint']} ({result['architecture']}; --bpe {result['bpe'] or 'none'}); fine-tune with: "
        f"{shlex.join(command)}"
    )


if __name__ == "__main__":
    sys.exit(run_console_script("import_hf", main))
