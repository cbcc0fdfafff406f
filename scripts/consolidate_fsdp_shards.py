#!/usr/bin/env python3
"""Merge a sharded checkpoint directory (written with --use-sharded-state) into one checkpoint file.

    python scripts/consolidate_fsdp_shards.py checkpoints/checkpoint_last checkpoint_last.pt

The output has the usual single-file layout (model, last_optimizer_state, cfg, extra_state, ...), so
fairseq-eval-lm and fairseq-train --restore-file / --finetune-from-model read it. Runs on one CPU process;
no GPU or process group is needed. Use --no-optimizer to keep only the model weights (much smaller).
The directory is read without unpickling code; --trust-legacy-checkpoint reads it with plain pickle.
"""

import argparse
import logging
import os
import sys

from fairseq.checkpoint.consolidate import consolidate
from fairseq_cli.console import run_console_script


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("checkpoint_dir", help="sharded checkpoint directory, e.g. checkpoints/checkpoint_last")
    parser.add_argument("output", help="single-file checkpoint to write (.pt)")
    parser.add_argument("--no-optimizer", action="store_true", help="leave the optimizer state out")
    parser.add_argument(
        "--trust-legacy-checkpoint",
        action="store_true",
        help="read the directory with plain pickle, which can run arbitrary code: only for files you trust "
        "(by default anything beyond torch.distributed.checkpoint's own metadata and plain values is refused)",
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.checkpoint_dir):
        parser.error(f"{args.checkpoint_dir} is not a directory (expected a sharded checkpoint)")
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.WARNING)
    consolidate(
        args.checkpoint_dir,
        args.output,
        include_optimizer=not args.no_optimizer,
        trust_legacy=args.trust_legacy_checkpoint,
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    sys.exit(run_console_script("consolidate_fsdp_shards", main))
