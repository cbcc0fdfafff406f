"""fairseq-hydra-train: train from a YAML config composed by hydra (hydra-core 1.3).

    fairseq-hydra-train --config-dir examples/large_lm/config --config-name 125m \
        task.data=data-bin/gpt2 checkpoint.save_dir=checkpoints/125m optimization.lr=[0.001]

The config uses upstream fairseq's layout (see `fairseq.dataclass.hydra`); every key is checked against
the config dataclasses, the architecture preset fills what the config leaves unset, and training runs
exactly as `fairseq-train` with the equivalent flags would (same launcher, same exit status 3 after a
preemption). Any `group.key=value` override may set a key the file does not spell out.

Hydra's run directory (`hydra.run.dir`, by default outputs/<date>/<time> under the directory you ran
from) receives `.hydra/config.yaml` (the composed config, as hydra saves it), `.hydra/fairseq_config.yaml`
(every option after presets and defaults: what training really used) and the log, in fairseq's line
format. The working directory is not changed (hydra's default since 1.2); relative paths in the config
are resolved against the directory you ran from, even with hydra.job.chdir=true.

Without --config-name, upstream's own primary config is used: its config groups choose components on the
command line (`task=language_modeling model=transformer_lm/transformer_lm_gpt optimizer=adam`) and, as
upstream's does, it runs in the current directory (`.hydra/`, `hydra_train.log`, `checkpoints/` there).

Under a launcher that starts one process per GPU (srun, torchrun) only the first process writes the
run directory; the others log to the console only.
"""

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from fairseq.dataclass.hydra import (
    as_hydra_overrides, fairseq_config_from_dict, recipe_update_freq, resolve_paths, split_recipe, to_plain_dict,
    without_group_package_headers,
)
from fairseq.dataclass.utils import config_to_dict
from fairseq.logging import progress_bar
from fairseq.logging.progress_bar import DATE_FORMAT, LOG_FORMAT
from fairseq.utils import run_console_script

logger = logging.getLogger("fairseq_cli.hydra_train")

RESOLVED_CONFIG_NAME = "fairseq_config.yaml"
_LOGGING_WITH_FILE = "fairseq"  # hydra/job_logging choices registered below
_LOGGING_CONSOLE = "fairseq_console"


def _job_logging(with_file: bool) -> dict:
    handlers = {"console": {"class": "logging.StreamHandler", "formatter": "fairseq", "stream": "ext://sys.stdout"}}
    if with_file:
        handlers["file"] = {"class": "logging.FileHandler", "formatter": "fairseq",
                            "filename": "${hydra.runtime.output_dir}/${hydra.job.name}.log"}
    return {
        "version": 1,
        "formatters": {"fairseq": {"format": LOG_FORMAT, "datefmt": DATE_FORMAT}},
        "handlers": handlers,
        "root": {"level": "INFO", "handlers": list(handlers)},
        "disable_existing_loggers": False,
    }


def _register_logging_configs() -> None:
    # fairseq-train's log lines (`date | INFO | train_inner | {...}`), so log parsers work on both tools.
    store = ConfigStore.instance()
    store.store(group="hydra/job_logging", name=_LOGGING_WITH_FILE, node=_job_logging(with_file=True))
    store.store(group="hydra/job_logging", name=_LOGGING_CONSOLE, node=_job_logging(with_file=False))


DEFAULT_CONFIG_NAME = "config"  # upstream's primary config, used when the command line names none


def _register_upstream_groups() -> None:
    """Upstream's config groups and primary config, so its documented command line works as it is:
    `fairseq-hydra-train task=language_modeling task.data=DIR model=transformer_lm/transformer_lm_gpt
    optimizer=adam ...`. Each choice of group `task`, `criterion`, `optimizer`, `lr_scheduler` is a registered
    name; `model=ARCH` and `model=MODEL/ARCH` choose an architecture. The primary config `config` selects
    upstream's defaults (cross_entropy, fixed) and, as upstream's does, runs in the current directory."""
    from fairseq import options, registry

    store = ConfigStore.instance()
    for attr, _, reg, _ in options.COMPONENTS:
        for name in reg.choices():
            store.store(group=attr, name=name, node={"_name": name})
    model_names = {registry.MODEL_REGISTRY.get(name): name for name in registry.MODEL_REGISTRY.choices()}
    for arch in registry.architectures():
        store.store(group="model", name=arch, node={"_name": arch})
        model_name = model_names.get(registry.arch_model(arch))
        if model_name is not None:
            store.store(group=f"model/{model_name}", name=arch, node={"_name": arch})
    defaults = ["_self_"] + [{attr: default} for attr, default in (
        ("task", None), ("model", None), ("criterion", "cross_entropy"), ("optimizer", None),
        ("lr_scheduler", "fixed"))]
    store.store(name=DEFAULT_CONFIG_NAME, node={"defaults": defaults, "hydra": {"run": {"dir": "."}}})


def is_first_process(environ: Mapping[str, str] = os.environ) -> bool:
    """False for the second and later processes a launcher started (torchrun's RANK, srun's SLURM_PROCID)."""
    for name in ("RANK", "SLURM_PROCID"):
        value = environ.get(name, "")
        if value.strip().isdigit():
            return int(value) == 0
    return True


def hydra_argv(argv: List[str], environ: Mapping[str, str] = os.environ) -> List[str]:
    """The argument list handed to hydra: overrides made able to add keys, fairseq's log format chosen
    (unless the user chose a hydra/job_logging), and, on all but the first process, no run directory."""
    from hydra._internal.utils import get_args_parser  # hydra's own parser, so options are read as hydra reads them

    overrides = get_args_parser().parse_args(argv).overrides
    rewritten, pending, after_last_override = [], list(overrides), len(argv)
    for item in argv:
        if pending and item == pending[0]:
            pending.pop(0)
            item = as_hydra_overrides([item])[0]
            after_last_override = len(rewritten) + 1
        rewritten.append(item)
    first = is_first_process(environ)
    added = []
    if not any(o.split("=", 1)[0] in ("hydra/job_logging", "+hydra/job_logging") for o in overrides):
        added.append(f"hydra/job_logging={_LOGGING_WITH_FILE if first else _LOGGING_CONSOLE}")
    if not first:
        added.append("hydra.output_subdir=null")
    # Beside the user's overrides: argparse takes one run of positional overrides, so appending them after
    # options that follow the overrides (`task.data=x --config-dir d`) would make a second run, an error.
    return rewritten[:after_last_override] + added + rewritten[after_last_override:]


@contextlib.contextmanager
def _readable_config_dir(argv: List[str]):
    """`argv` with --config-dir/--config-path pointing at a copy without upstream's `# @package _group_`
    headers, when the directory has any (see `without_group_package_headers`)."""
    from hydra._internal.utils import get_args_parser

    parsed = get_args_parser().parse_args(argv)
    # hydra reads a relative --config-path against this module's directory, so only an absolute one is a
    # directory this process can copy
    given = parsed.config_dir or (parsed.config_path if parsed.config_path and os.path.isabs(parsed.config_path)
                                  else None)
    if not given or not os.path.isdir(given):
        yield argv
        return
    with without_group_package_headers(given) as readable:
        if readable == given:
            yield argv
            return
        rewritten = []
        for i, item in enumerate(argv):
            flag, _, value = item.partition("=")
            if flag in _CONFIG_DIR_FLAGS and value == given:
                item = f"{flag}={readable}"
            elif item == given and i > 0 and argv[i - 1] in _CONFIG_DIR_FLAGS:
                item = readable
            rewritten.append(item)
        yield rewritten


_CONFIG_DIR_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp")


def warn_if_global_batch_differs(cfg, recipe: Dict, world_size: int) -> Optional[str]:
    """Warn when batch x update_freq x GPUs differs from the recipe's global batch (the learning-rate schedule
    assumes the recipe's); returns the warning."""
    batch_size, tokens = cfg.dataset.batch_size, getattr(cfg.task, "tokens_per_sample", None)
    if not recipe.get("global_batch_tokens") or batch_size is None or tokens is None:
        return None
    update_freq = cfg.optimization.update_freq[0]
    actual = batch_size * update_freq * world_size * tokens
    if actual == recipe["global_batch_tokens"]:
        return None
    try:
        fix = f"set optimization.update_freq=[{recipe_update_freq(recipe, batch_size, tokens, world_size)}]"
    except ValueError as err:
        fix = str(err)
    message = (
        f"the global batch is {actual:,} tokens (dataset.batch_size {batch_size} x optimization.update_freq "
        f"{update_freq} x {world_size} GPU(s) x task.tokens_per_sample {tokens}), but this recipe's learning-rate "
        f"schedule was set for {recipe['global_batch_tokens']:,} tokens on {recipe.get('gpus', '?')} GPUs: {fix}"
    )
    logger.warning(message)
    return message


def train_with_recipe_check(cfg, recipe: Optional[Dict] = None):
    """Runs on every rank (module level so spawned processes can import it)."""
    from fairseq.distributed import utils as dist_utils
    from fairseq_cli import train

    if recipe and dist_utils.is_master():
        progress_bar.setup_logging()  # a spawned rank has no log handler yet (train.main sets the same one)
        warn_if_global_batch_differs(cfg, recipe, dist_utils.get_world_size())
    return train.main(cfg)


def _save_resolved_config(cfg, hydra_cfg) -> None:
    if hydra_cfg.output_subdir is None:
        return
    directory = Path(hydra_cfg.runtime.output_dir) / hydra_cfg.output_subdir
    directory.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config_to_dict(cfg)), directory / RESOLVED_CONFIG_NAME)


def _hydra_log_file() -> Optional[str]:
    """The file hydra's job logging writes to, if any (with the default config, RUN_DIR/hydra_train.log)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None


_OUTCOME: Dict[str, object] = {}  # what the hydra task returned or raised, read after hydra returns


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def _hydra_task(composed: DictConfig) -> None:
    from fairseq.distributed.launch import call_main

    # Hydra would catch an exception here, print it and exit 1; keep it for cli_main instead, so user
    # errors read as one line (as with fairseq-train) and the requeue status comes through.
    try:
        hydra_cfg = HydraConfig.get()
        values = to_plain_dict(composed)
        if not values:
            raise ValueError("the config is empty: name one with --config-dir DIR --config-name NAME "
                             "(e.g. --config-dir examples/large_lm/config --config-name 125m)")
        values = resolve_paths(values, hydra_cfg.runtime.cwd)
        values, recipe = split_recipe(values)
        cfg = fairseq_config_from_dict(values)
        if cfg.common.log_file is None:  # ranks spawned from here log to hydra's file too
            cfg.common.log_file = _hydra_log_file()
        _save_resolved_config(cfg, hydra_cfg)
        _OUTCOME["result"] = call_main(cfg, train_with_recipe_check, recipe=recipe)
    except (Exception, SystemExit) as err:
        _OUTCOME["error"] = err


def _main(argv: Optional[List[str]]) -> None:
    from fairseq.preemption import EXIT_REQUEUED
    from fairseq_cli.train import REQUEUED

    argv = sys.argv[1:] if argv is None else list(argv)
    _register_logging_configs()
    _register_upstream_groups()
    from hydra._internal.utils import get_args_parser

    if get_args_parser().parse_args(argv).config_name is None:
        argv = argv + ["--config-name", DEFAULT_CONFIG_NAME]
    saved_argv = sys.argv
    _OUTCOME.clear()
    with _readable_config_dir(argv) as argv:
        sys.argv = [saved_argv[0] if saved_argv else "fairseq-hydra-train"] + hydra_argv(argv)
        try:
            _hydra_task()  # hydra reads sys.argv
        finally:
            sys.argv = saved_argv
    if "error" in _OUTCOME:
        raise _OUTCOME["error"]
    if _OUTCOME.get("result") == REQUEUED:
        sys.exit(EXIT_REQUEUED)


def cli_main(argv: Optional[List[str]] = None) -> None:
    """Console entry point `fairseq-hydra-train` (arguments from sys.argv unless `argv` is given)."""
    run_console_script("fairseq-hydra-train", _main, argv)


if __name__ == "__main__":
    cli_main()
