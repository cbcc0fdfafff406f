"""fairseq-train: train a model (upstream's command line, flags and log lines). The loop itself is
fairseq.training.loop; this module parses, checks, launches and calls it."""

import argparse
import logging
import sys
from typing import List, Optional

from fairseq.frontend import options
from fairseq.data.encoders._write_errors import writing
from fairseq.frontend.validate import validate as validate_config
from fairseq.distributed.launch import call_main
from fairseq.logging import progress_bar
from fairseq.training import loop
from fairseq.training.loop import validate, validate_and_save  # noqa: F401 (names upstream's module has)
from fairseq.training.preemption import EXIT_REQUEUED, REQUEUE_FAILED, REQUEUED, exit_requeue_failed
from fairseq.registry import import_user_module
from fairseq_cli.console import run_console_script

__all__ = ["REQUEUED", "cli_main", "console_main", "main", "validate", "validate_and_save"]


def main(cfg, validated: bool = False) -> Optional[str]:
    """Train on this process (fairseq.training.loop.train, with the log file and --user-dir set up); returns
    REQUEUED when a preemption signal stopped training after saving checkpoint_last. `cfg` is a FairseqConfig
    or, as upstream accepts, the argparse.Namespace of parse_args_and_arch. `validated`: the launching process
    checked `cfg` (cli_main, fairseq-hydra-train); the ranks do not check it again."""
    if isinstance(cfg, argparse.Namespace):
        cfg = options.convert_namespace_to_config(cfg)
    with writing(cfg.common.log_file, "--log-file"):  # an unwritable file: one line, no traceback
        log_file_handler = progress_bar.setup_logging(cfg.common.log_file)
    if cfg.common.user_dir:  # spawned ranks start fresh interpreters: register the plug-ins there too
        import_user_module(cfg.common.user_dir)
    try:
        if not validated:  # an in-process caller: nothing has checked it yet (after --user-dir's plug-ins)
            validate_config(cfg)
            loop.check_input_files(cfg)
        return loop.train(cfg)
    finally:
        if log_file_handler is not None:  # in-process callers (tests) start the next run with a clean root logger
            logging.getLogger().removeHandler(log_file_handler)
            log_file_handler.close()


def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = options.convert_namespace_to_config(args)
    try:
        validate_config(cfg)  # before any process is spawned or data read
        loop.check_input_files(cfg)  # then the dictionary and --bpe files, still before spawning
    except ValueError as e:
        parser.error(str(e))
    result = call_main(cfg, main, validated=True)
    if result == REQUEUED:
        sys.exit(EXIT_REQUEUED)
    if result == REQUEUE_FAILED:  # checkpoint_last is saved, but SLURM will not restart the job
        exit_requeue_failed("fairseq-train")


def console_main() -> None:
    run_console_script("fairseq-train", cli_main)


if __name__ == "__main__":
    console_main()
