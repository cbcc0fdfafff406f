#!/usr/bin/env python3
"""Export a checkpoint to a Hugging Face transformers model directory (OPTForCausalLM or XGLMForCausalLM).

    python scripts/export_hf.py checkpoints/checkpoint_best.pt hf_model --dict data-bin/dict.txt \\
        --bpe gpt2 --gpt2-encoder-json gpt2_bpe/encoder.json --gpt2-vocab-bpe gpt2_bpe/vocab.bpe

CHECKPOINT is a checkpoint file or a sharded checkpoint directory (--use-sharded-state). Writes config.json,
generation_config.json, model.safetensors (or shards and their index), dict.txt and, with a GPT-2 BPE or a
sentencepiece model (given here or saved in the checkpoint), tokenizer.json and tokenizer_config.json.
Architectures without an exact transformers equivalent are refused, naming the option. See docs/export_hf.md.
"""

import argparse
import logging
import sys

from fairseq_cli.console import run_console_script


def build_parser() -> argparse.ArgumentParser:
    from fairseq.export.hf import DTYPES, MODEL_TYPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("checkpoint", help="checkpoint file (.pt) or sharded checkpoint directory")
    parser.add_argument(
        "output",
        metavar="OUTPUT",
        help="directory to write: absent or empty, or this script's earlier output with --overwrite",
    )
    parser.add_argument(
        "--dict",
        dest="dict_path",
        metavar="DICT_TXT",
        help="the dictionary the model was trained with (default: dict.txt beside the checkpoint, "
        "else in the checkpoint's data directory)",
    )
    parser.add_argument(
        "--model-type",
        choices=MODEL_TYPES,
        default="auto",
        help="transformers architecture: opt (OPTForCausalLM), xglm (XGLMForCausalLM), or auto: OPT "
        "for learned positions, XGLM for sinusoidal ones where it fits, else OPT",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="weights' dtype in the export (default: as stored in the checkpoint)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file before the weights are split into shards (default: 5GB)",
    )
    parser.add_argument(
        "--bpe",
        choices=("gpt2", "sentencepiece"),
        default=None,
        help="the BPE the data was encoded with (default: the one saved in the checkpoint)",
    )
    parser.add_argument("--gpt2-encoder-json", help="GPT-2 BPE encoder.json (with --bpe gpt2)")
    parser.add_argument("--gpt2-vocab-bpe", help="GPT-2 BPE vocab.bpe (with --bpe gpt2)")
    parser.add_argument("--sentencepiece-model", help="sentencepiece .model file (with --bpe sentencepiece)")
    parser.add_argument("--no-tokenizer", action="store_true", help="write the model only, no tokenizer files")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUTPUT when it holds an earlier output of this script (its "
        "fairseq_manifest.json lists the files; nothing else is ever deleted)",
    )
    parser.add_argument(
        "--trust-legacy-checkpoint",
        action="store_true",
        help="read an upstream fairseq checkpoint with plain pickle (only for files you trust)",
    )
    return parser


def bpe_from_args(args, parser) -> dict:
    given = {
        "gpt2_encoder_json": args.gpt2_encoder_json,
        "gpt2_vocab_bpe": args.gpt2_vocab_bpe,
        "sentencepiece_model": args.sentencepiece_model,
    }
    if args.bpe is None:
        stray = [f"--{k.replace('_', '-')}" for k, v in given.items() if v]
        if stray:
            parser.error(f"{stray[0]} needs --bpe {'gpt2' if 'gpt2' in stray[0] else 'sentencepiece'}")
        return None
    keys = ("gpt2_encoder_json", "gpt2_vocab_bpe") if args.bpe == "gpt2" else ("sentencepiece_model",)
    return {"_name": args.bpe, **{k: given[k] for k in keys}}


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.no_tokenizer and args.bpe:
        parser.error("--no-tokenizer and --bpe contradict each other; drop one")
    bpe = bpe_from_args(args, parser)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO)
    from fairseq.export import hf

    try:
        result = hf.export(
            args.checkpoint,
            args.output,
            dict_path=args.dict_path,
            model_type=args.model_type,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            bpe=bpe,
            tokenizer=not args.no_tokenizer,
            overwrite=args.overwrite,
            trust_legacy=args.trust_legacy_checkpoint,
        )
    except ImportError as e:  # transformers / safetensors not installed: one line, like the other errors
        raise ValueError(str(e)) from None
    print(f"wrote {args.output} ({result['architecture']}; tokenizer: {result['tokenizer'] or 'none'})")


if __name__ == "__main__":
    sys.exit(run_console_script("export_hf", main))
