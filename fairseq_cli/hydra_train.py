"""fairseq-hydra-train: train from a YAML config composed by hydra (hydra-core 1.3).

    fairseq-hydra-train --config-dir examples/large_lm/config --config-name 125m \
        task.data=data-bin/gpt2 checkpoint.save_dir=checkpoints/125m optimization.lr=[0.001]

The config uses upstream fairseq's layout (see `fairseq.frontend.hydra`); every key is checked against
the config dataclasses, the architecture preset fills what the config leaves unset, and training runs
exactly as `fairseq-train` with the equivalent flags would (same launcher, same exit status after a
preemption: 3, or 4 when `scontrol requeue` failed). Any `group.key=value` override may set a key the
file does not spell out.

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
import yaml
from hydra._internal.utils import get_args_parser, run_and_report  # hydra's own parser: options read as hydra does
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import MissingConfigException, SearchPathException
from omegaconf import DictConfig, OmegaConf

from fairseq import registry
from fairseq.distributed import utils as dist_utils
from fairseq.distributed.launch import call_main
from fairseq.frontend import options
from fairseq.frontend.hydra import (
    as_hydra_overrides,
    fairseq_config_from_dict,
    recipe_update_freq,
    resolve_paths,
    split_recipe,
    to_plain_dict,
    without_group_package_headers,
)
from fairseq.dataclass.flag_values import task_block_options
from fairseq.dataclass.utils import config_to_dict
from fairseq.frontend.validate import validate
from fairseq.data.encoders._write_errors import OutputError, os_error_message
from fairseq.logging import progress_bar
from fairseq.logging.progress_bar import DATE_FORMAT, LOG_FORMAT
from fairseq.suggest import closest_first, did_you_mean
from fairseq.training.loop import check_input_files
from fairseq.training.preemption import EXIT_REQUEUED, REQUEUE_FAILED, REQUEUED, exit_requeue_failed
from fairseq_cli import train
from fairseq_cli.console import run_console_script

logger = logging.getLogger("fairseq_cli.hydra_train")

RESOLVED_CONFIG_NAME = "fairseq_config.yaml"
_LOGGING_WITH_FILE = "fairseq"  # hydra/job_logging choices registered below
_LOGGING_CONSOLE = "fairseq_console"


def _job_logging(with_file: bool) -> dict:
    handlers = {"console": {"class": "logging.StreamHandler", "formatter": "fairseq", "stream": "ext://sys.stdout"}}
    if with_file:
        handlers["file"] = {
            "class": "logging.FileHandler",
            "formatter": "fairseq",
            "filename": "${hydra.runtime.output_dir}/${hydra.job.name}.log",
        }
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
    defaults = ["_self_"] + [
        {attr: default}
        for attr, default in (
            ("task", None),
            ("model", None),
            ("criterion", "cross_entropy"),
            ("optimizer", None),
            ("lr_scheduler", "fixed"),
        )
    ]
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
    parsed = get_args_parser().parse_args(argv)
    # hydra reads a relative --config-path against this module's directory, so only an absolute one is a
    # directory this process can copy
    given = parsed.config_dir or (
        parsed.config_path if parsed.config_path and os.path.isabs(parsed.config_path) else None
    )
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
    batch_size, (tokens, _) = cfg.dataset.batch_size, task_block_options(cfg.task)
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


def train_with_recipe_check(cfg, recipe: Optional[Dict] = None, validated: bool = False):
    """Runs on every rank (module level so spawned processes can import it)."""
    if recipe and dist_utils.is_master():
        progress_bar.setup_logging()  # a spawned rank has no log handler yet (train.main sets the same one)
        # Data-parallel ranks: the ranks of a tensor-parallel group share their batches.
        data_parallel = dist_utils.get_world_size() // cfg.distributed_training.model_parallel_size
        warn_if_global_batch_differs(cfg, recipe, data_parallel)
    return train.main(cfg, validated=validated)


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


_FULL_ERROR = "HYDRA_FULL_ERROR"  # hydra's switch: raise the errors it meets instead of printing them itself
_USER_FULL_ERROR: Dict[str, Optional[str]] = {}  # the user's own setting while _main overrides it


@contextlib.contextmanager
def _hydra_raises_errors():
    """Have hydra raise what goes wrong while it composes the config, rather than print a traceback and exit 1,
    so that `_main` can turn a bad YAML file into one line. The task restores the user's setting first thing
    (see `_restore_full_error`), so the ranks it spawns inherit the user's environment."""
    _USER_FULL_ERROR["value"] = os.environ.get(_FULL_ERROR)
    os.environ[_FULL_ERROR] = "1"
    try:
        yield
    finally:
        _restore_full_error()
        _USER_FULL_ERROR.clear()


def _restore_full_error() -> None:
    if "value" not in _USER_FULL_ERROR:
        return
    if _USER_FULL_ERROR["value"] is None:
        os.environ.pop(_FULL_ERROR, None)
    else:
        os.environ[_FULL_ERROR] = _USER_FULL_ERROR["value"]


def _yaml_error_in(err: BaseException):
    """The YAML parsing error that `err` is or was caused by, if any."""
    return _error_in(err, yaml.MarkedYAMLError)


def _error_in(err: BaseException, kind):
    """The exception of type `kind` that `err` is or was caused by, if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kind):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _first_key_line(path: str, mapping_mark, key: str):
    """(dotted path of `key`, 1-based line of its first occurrence) in the mapping that starts at `mapping_mark`
    of the YAML file `path`; (key, None) when the file cannot be read again."""
    try:
        with open(path) as f:
            root = yaml.compose(f, Loader=yaml.SafeLoader)  # nodes only: duplicates are not checked here
    except (OSError, yaml.YAMLError):
        return key, None

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            if (node.start_mark.line, node.start_mark.column) == (mapping_mark.line, mapping_mark.column):
                for key_node, _ in node.value:
                    if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
                        return prefix + [key], key_node.start_mark.line + 1
            for key_node, value_node in node.value:
                found = walk(value_node, prefix + [str(getattr(key_node, "value", "?"))])
                if found:
                    return found
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                found = walk(item, prefix + [str(i)])
                if found:
                    return found
        return None

    found = walk(root, []) if root is not None else None
    return (".".join(found[0]), found[1]) if found else (key, None)


def _describe_yaml_error(err, readable_dir: Optional[str], given_dir: Optional[str]) -> str:
    """One line for a YAML file hydra could not read: the file (as the user named it), the line, the key."""
    mark = err.problem_mark
    path = mark.name if mark is not None else "?"
    shown = path
    if readable_dir and given_dir and readable_dir != given_dir and path.startswith(readable_dir + os.sep):
        shown = os.path.join(given_dir, os.path.relpath(path, readable_dir))  # a header-free copy keeps lines
    problem = err.problem or "invalid YAML"
    duplicate = "found duplicate key "
    if problem.startswith(duplicate) and err.context_mark is not None and mark is not None:
        key = problem[len(duplicate) :]
        dotted, first_line = _first_key_line(path, err.context_mark, key)
        first = f" (first set at line {first_line})" if first_line else ""
        return f"{shown}, line {mark.line + 1}: duplicate key '{dotted}'{first}; each key may appear only once"
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
    context = ""
    if err.context and err.context_mark is not None:
        context = f" ({err.context} at line {err.context_mark.line + 1})"
    elif err.context:
        context = f" ({err.context})"
    return f"{shown}, {where}: {problem}{context}: not a valid YAML file"


def _one_line_hydra_error(err: BaseException, argv: List[str], given_dir: Optional[str]) -> Optional[Exception]:
    """One line for what hydra itself raised, where there is a better one than hydra's report: an unreadable
    YAML file, a --config-name or --config-dir that does not exist, a run directory that cannot be written."""
    yaml_error = _yaml_error_in(err)
    if yaml_error is not None:
        return ValueError(_describe_yaml_error(yaml_error, _config_dir_of(argv), given_dir))
    os_error = _error_in(err, OSError)
    config_dirs = [d for d in (given_dir, _config_dir_of(argv)) if d]
    if (
        os_error is not None
        and os_error.filename is not None
        and not any(  # not a config file hydra read
            os.path.abspath(str(os_error.filename)).startswith(d + os.sep) for d in config_dirs
        )
    ):
        # hydra's outputs/ (or hydra.run.dir) in a read-only directory, under a file, ...
        return OutputError(
            os_error_message(
                os_error.filename,
                os_error,
                "cannot write hydra's run directory",
                "directory to run from, or pass hydra.run.dir=DIR",
            )
        )
    missing = _error_in(err, (MissingConfigException, SearchPathException))
    if missing is not None and str(missing).startswith(
        ("Cannot find primary config", "Primary config directory", "Additional config directory")
    ):
        return ValueError(_missing_config_message(argv, given_dir))
    return None


def _missing_config_message(argv: List[str], given_dir: Optional[str]) -> str:
    name = get_args_parser().parse_args(argv).config_name
    if given_dir is None:
        return (
            f"--config-name {name}: no such config; name the directory that holds {name}.yaml with "
            "--config-dir DIR (e.g. --config-dir examples/large_lm/config --config-name 125m)"
        )
    if not os.path.isdir(given_dir):
        return f"--config-dir {given_dir}: no such directory; pass the directory that holds {name}.yaml"
    names = sorted(f[: -len(".yaml")] for f in os.listdir(given_dir) if f.endswith(".yaml"))
    if not names:
        return f"--config-dir {given_dir} holds no .yaml file; pass the directory that holds {name}.yaml"
    return (
        f"--config-name {name}: no {name}.yaml in {given_dir}{did_you_mean(name, names)}; the configs "
        f"there, closest first: {', '.join(closest_first(name, names))}"
    )


def _config_dir_of(argv: List[str]) -> Optional[str]:
    parsed = get_args_parser().parse_args(argv)
    given = parsed.config_dir or parsed.config_path
    return os.path.abspath(given) if given else None


_OUTCOME: Dict[str, object] = {}  # what the hydra task returned or raised, read after hydra returns


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def _hydra_task(composed: DictConfig) -> None:
    # Hydra would catch an exception here, print it and exit 1; keep it for cli_main instead, so user
    # errors read as one line (as with fairseq-train) and the requeue status comes through.
    _restore_full_error()  # the config is composed: from here on (and in spawned ranks) the user's setting
    try:
        hydra_cfg = HydraConfig.get()
        values = to_plain_dict(composed)
        if not values:
            raise ValueError(
                "the config is empty: name one with --config-dir DIR --config-name NAME "
                "(e.g. --config-dir examples/large_lm/config --config-name 125m)"
            )
        values = resolve_paths(values, hydra_cfg.runtime.cwd)
        values, recipe = split_recipe(values)
        cfg = fairseq_config_from_dict(values)
        if cfg.common.log_file is None:  # ranks spawned from here log to hydra's file too
            cfg.common.log_file = _hydra_log_file()
        _save_resolved_config(cfg, hydra_cfg)
        validate(cfg)  # once, before any rank is spawned; the ranks trust it
        check_input_files(cfg)
        _OUTCOME["result"] = call_main(cfg, train_with_recipe_check, recipe=recipe, validated=True)
    except (Exception, SystemExit) as err:
        _OUTCOME["error"] = err


def _main(argv: Optional[List[str]]) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    _register_logging_configs()
    _register_upstream_groups()
    if get_args_parser().parse_args(argv).config_name is None:
        argv = argv + ["--config-name", DEFAULT_CONFIG_NAME]
    saved_argv = sys.argv
    _OUTCOME.clear()
    given_dir = _config_dir_of(argv)
    user_wants_traceback = os.environ.get(_FULL_ERROR) == "1"
    with _readable_config_dir(argv) as argv:
        sys.argv = [saved_argv[0] if saved_argv else "fairseq-hydra-train"] + hydra_argv(argv)
        try:
            with _hydra_raises_errors():
                _hydra_task()  # hydra reads sys.argv
        except Exception as err:  # raised by hydra itself (the task keeps its own errors in _OUTCOME)
            if user_wants_traceback:
                raise
            one_line = _one_line_hydra_error(err, argv, given_dir)
            if one_line is not None:
                raise one_line from None

            def reraise(err=err):
                raise err

            run_and_report(reraise)  # anything else is reported as hydra reports it (and exits 1)
            raise
        finally:
            sys.argv = saved_argv
    if "error" in _OUTCOME:
        raise _OUTCOME["error"]
    if _OUTCOME.get("result") == REQUEUED:
        sys.exit(EXIT_REQUEUED)
    if _OUTCOME.get("result") == REQUEUE_FAILED:
        exit_requeue_failed("fairseq-hydra-train")


def cli_main(argv: Optional[List[str]] = None) -> None:
    """Console entry point `fairseq-hydra-train` (arguments from sys.argv unless `argv` is given)."""
    run_console_script("fairseq-hydra-train", _main, argv)


if __name__ == "__main__":
    cli_main()
