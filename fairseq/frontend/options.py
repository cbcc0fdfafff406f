"""Command-line parsers, generated from the config dataclasses.

`parse_args_and_arch` parses in two passes, as upstream does: the first pass reads which task, architecture,
criterion, optimizer and scheduler were chosen (and `--user-dir`), the second adds those components' own
flags and parses everything, rejecting unknown flags.
"""

import argparse
import dataclasses
import sys
import textwrap
from typing import List, Optional

from fairseq import registry
from fairseq.dataclass import configs, legacy
from fairseq.dataclass.argument_parser import FairseqArgumentParser
from fairseq.dataclass.serving import ServeConfig
from fairseq.dataclass.build import check_precision, convert_namespace_to_config, is_interpolated, model_config
from fairseq.dataclass.generation import GenerationConfig, InteractiveConfig
from fairseq.dataclass.utils import add_dataclass_to_parser, config_from_namespace
from fairseq.registry import import_user_module

# Group name in FairseqConfig -> dataclass, in the order they appear in --help.
TRAIN_GROUPS = {
    "common": configs.CommonConfig,
    "dataset": configs.DatasetConfig,
    "distributed_training": configs.DistributedTrainingConfig,
    "optimization": configs.OptimizationConfig,
    "checkpoint": configs.CheckpointConfig,
    "ema": configs.EMAConfig,
}
# Component selector: (config attribute, flag dest, registry, default)
COMPONENTS = (
    ("task", "task", registry.TASK_REGISTRY, "language_modeling"),
    ("criterion", "criterion", registry.CRITERION_REGISTRY, "cross_entropy"),
    ("optimizer", "optimizer", registry.OPTIMIZER_REGISTRY, None),
    ("lr_scheduler", "lr_scheduler", registry.LR_SCHEDULER_REGISTRY, "fixed"),
    # Text encoders, as upstream's parsers have them: the chosen scheme's dataclass adds its flags
    # (--gpt2-encoder-json, --sentencepiece-model, ...) and the config gets cfg.bpe / cfg.tokenizer.
    ("bpe", "bpe", registry.BPE_REGISTRY, None),
    ("tokenizer", "tokenizer", registry.TOKENIZER_REGISTRY, None),
)
ENCODER_COMPONENTS = ("bpe", "tokenizer")


class _HelpFormatter(argparse.HelpFormatter):
    def _split_lines(self, text, width):  # flags stay whole ("--batch-size-valid", not "--batch-size- valid")
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


ALL = "all"  # HELP_SHOWN: every flag of the group
_EVAL_COMMON = frozenset({"log_file", "seed", "cpu", "fp16", "bf16", "user_dir", "trust_legacy_checkpoint"})
_EVAL_DATASET = frozenset(
    {
        "max_tokens",
        "batch_size",
        "num_workers",
        "skip_invalid_size_inputs_valid_test",
        "gen_subset",
        "num_shards",
        "shard_id",
    }
)
# What --help lists for the tools that read a trained model: per group, the fields the tool reads
# ("components": the selectors it uses); groups not named are left out. The flags left out still parse, as
# upstream's command lines pass training flags to these tools.
HELP_SHOWN = {
    "generate": {
        "common": _EVAL_COMMON,
        "dataset": _EVAL_DATASET | {"required_batch_size_multiple", "data_buffer_size"},
        "common_eval": {"path", "quiet", "model_overrides", "results_path", "post_process"},
        "generation": ALL,
        "components": {"task", "bpe", "tokenizer"},
    },
    "interactive": {
        "common": _EVAL_COMMON,
        "dataset": {"max_tokens", "batch_size", "skip_invalid_size_inputs_valid_test"},
        "common_eval": {"path", "model_overrides", "post_process"},
        "generation": ALL,
        "interactive": ALL,
        "components": {"task", "bpe", "tokenizer"},
    },
    "serve": {
        "common": _EVAL_COMMON,
        "common_eval": {"path", "model_overrides"},
        "generation": {"quantize", "no_cuda_graphs"},
        "distributed_training": {"model_parallel_size"},
        "serve": ALL,
        "components": {"task", "bpe", "tokenizer"},
    },
    "eval_lm": {
        "common": _EVAL_COMMON,
        "dataset": _EVAL_DATASET,
        "common_eval": {"path", "model_overrides", "results_path", "post_process"},
        "eval_lm": ALL,
        "components": {"task", "bpe", "tokenizer"},
    },
    "validate": {
        "common": _EVAL_COMMON | {"log_format", "log_interval", "no_progress_bar"},
        "dataset": {
            "max_tokens",
            "batch_size",
            "num_workers",
            "skip_invalid_size_inputs_valid_test",
            "required_batch_size_multiple",
            "data_buffer_size",
            "valid_subset",
            "combine_valid_subsets",
            "max_valid_steps",
        },
        "distributed_training": {"device_id"},
        "checkpoint": {"checkpoint_suffix"},
        "common_eval": {"path", "model_overrides"},
        "components": {"task", "criterion"},
    },
}


def _hide_in_help(actions, shown) -> None:
    for action in actions:
        if shown != ALL and action.dest not in shown:
            action.help = argparse.SUPPRESS


def _base_parser(
    description: str, groups: dict, default_task: str, components=("task",), help_shown: Optional[dict] = None
):
    """The parser of `groups` and the `components` selectors; with `help_shown` (a HELP_SHOWN entry) --help
    lists only the flags it names."""
    # A pre-pass reads --user-dir before anything else, so plug-ins can register choices.
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--user-dir", default=None)
    user_args, _ = pre.parse_known_args()
    if user_args.user_dir:
        import_user_module(user_args.user_dir)

    parser = FairseqArgumentParser(description=description, allow_abbrev=False, formatter_class=_HelpFormatter)
    parser.set_defaults(_groups=tuple(groups))
    parser.help_shown = help_shown  # also for the components' groups, added once they are chosen
    for name, dc in groups.items():
        group = parser.add_argument_group(name.replace("_", " "))
        add_dataclass_to_parser(group, dc)
        if help_shown is not None:
            _hide_in_help(group._group_actions, help_shown.get(name, ()))
    for attr, dest, reg, default in COMPONENTS:
        if attr not in components:
            continue
        d = default_task if attr == "task" else default
        action = parser.add_argument(
            f"--{dest.replace('_', '-')}",
            dest=dest,
            default=d,
            metavar=dest.upper(),
            help=f"{reg.kind} to use: {', '.join(reg.choices())}" + (f" (default: {d})" if d else ""),
        )
        if help_shown is not None:
            _hide_in_help([action], help_shown["components"])
    return parser


def get_preprocessing_parser(default_task: str = "translation"):
    groups = {"common": configs.CommonConfig, "preprocess": configs.PreprocessConfig}
    # Every component selector, as upstream's parser has them (only --bpe / --tokenizer are used here).
    return _base_parser(
        "fairseq-preprocess: build a dictionary and binarize text",
        groups,
        default_task,
        components=tuple(c[0] for c in COMPONENTS),
    )


def get_training_parser(default_task: str = "language_modeling"):
    parser = _base_parser(
        "fairseq-train: train a model", TRAIN_GROUPS, default_task, components=tuple(c[0] for c in COMPONENTS)
    )
    parser.add_argument(
        "--arch", "-a", metavar="ARCH", default=None, help=f"model architecture: {', '.join(registry.architectures())}"
    )
    return parser


def get_eval_lm_parser(default_task: str = "language_modeling"):
    groups = dict(TRAIN_GROUPS)
    groups["common_eval"] = configs.CommonEvalConfig
    groups["eval_lm"] = configs.EvalLMConfig
    # Every component flag (--criterion, --optimizer, --lr-scheduler, --bpe, --tokenizer), as upstream's parser.
    return _base_parser(
        "fairseq-eval-lm: evaluate a language model",
        groups,
        default_task,
        components=tuple(c[0] for c in COMPONENTS),
        help_shown=HELP_SHOWN["eval_lm"],
    )


def parse_args_and_arch(
    parser: argparse.ArgumentParser,
    input_args: Optional[List[str]] = None,
    parse_known: bool = False,
    suppress_defaults: bool = False,
    modify_parser=None,
):
    """Parse flags, adding the chosen components' flags and applying the architecture preset.

    Upstream's options: `suppress_defaults` returns only the flags given on the command line (for
    overrides); `modify_parser(parser)` may add flags before the parse."""
    input_args = sys.argv[1:] if input_args is None else input_args
    if suppress_defaults:
        return _given_flags_only(parser, input_args, parse_known, modify_parser)
    if "--user-dir" in input_args:  # a plug-in named on an explicit argument list
        import_user_module(input_args[input_args.index("--user-dir") + 1])
    if modify_parser is not None:
        modify_parser(parser)
    # Without --help: the first pass only reads the choices, so that --help lists the chosen components' flags.
    first, _ = parser.parse_known_args([a for a in input_args if a not in ("-h", "--help")])

    try:
        has_arch = _add_component_flags(parser, first)
    except ValueError as e:  # unknown task/arch/criterion/...: usage error naming the flag and choices
        parser.error(str(e))

    if parse_known:
        args, extra = parser.parse_known_args(input_args)
    else:
        args, extra = parser.parse_args(input_args), None

    if has_arch and legacy.is_legacy_arch(args.arch):  # upstream's legacy models: the preset fills the namespace
        registry.ARCH_CONFIG_REGISTRY[args.arch](args)
    elif has_arch:  # as upstream, the namespace gets the model's values after the preset
        model_cfg = model_config(args.arch, vars(args))
        for f in dataclasses.fields(model_cfg):
            if not is_interpolated(f):
                setattr(args, f.name, getattr(model_cfg, f.name))
    try:
        check_precision(args)
    except ValueError as e:
        parser.error(str(e))
    return (args, extra) if parse_known else args


def _given_flags_only(parser, input_args, parse_known: bool, modify_parser) -> argparse.Namespace:
    """The namespace of the flags present in `input_args`, nothing else (upstream's suppress_defaults)."""
    full = parse_args_and_arch(parser, input_args, parse_known=parse_known, modify_parser=modify_parser)
    full = full[0] if parse_known else full
    defaults = [(action, action.default) for action in parser._actions]  # shared with `given`: put back after
    given = FairseqArgumentParser(add_help=False, parents=[parser], allow_abbrev=False)
    given.set_defaults(**{key: None for key in vars(full)})
    try:
        args, _ = given.parse_known_args(input_args)
    finally:
        for action, default in defaults:
            action.default = default
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if v is not None})


def parse_args_with_encoders(parser: argparse.ArgumentParser, input_args: Optional[List[str]] = None):
    """Parse flags, adding only the chosen --bpe/--tokenizer scheme's own flags (fairseq-preprocess, whose
    task flags are not used)."""
    input_args = sys.argv[1:] if input_args is None else input_args
    first, _ = parser.parse_known_args(input_args)
    try:
        _add_component_flags(parser, first, only=ENCODER_COMPONENTS, arch=False)
    except ValueError as e:
        parser.error(str(e))
    return parser.parse_args(input_args)


def _add_component_flags(parser, first, only=None, arch=True):
    """Add the chosen components' and the model's flags; True when an --arch was chosen."""
    for attr, dest, reg, _ in COMPONENTS:
        if only is not None and attr not in only:
            continue
        name = getattr(first, dest, None)
        if name is None:
            continue
        dc = reg.dataclass(name)  # raises a clear error for an unknown name
        group = parser.add_argument_group(f"{reg.kind} ({name})")
        if dc is not None:
            add_dataclass_to_parser(group, dc)
        elif hasattr(reg.get(name), "add_args"):  # upstream's legacy components (LegacyFairseqTask, ...)
            reg.get(name).add_args(group)
        help_shown = getattr(parser, "help_shown", None)
        if help_shown is not None and attr not in help_shown["components"]:  # e.g. eval-lm's default scheduler
            _hide_in_help(group._group_actions, ())
    if not arch or getattr(first, "arch", None) is None:
        return False
    model_cls = registry.arch_model(first.arch)  # raises for an unknown --arch
    # Unset model flags stay absent, so the architecture preset can fill exactly those.
    if legacy.is_legacy_arch(first.arch):  # upstream's add_args plug-ins
        legacy.add_model_args(parser, model_cls)
    else:
        add_dataclass_to_parser(
            parser.add_argument_group("model-specific configuration"),
            registry.dataclass_of(model_cls),
            suppress_defaults=True,
        )
    return True


# ----------------------------------------------------------------------------- validation


def get_validation_parser(default_task: Optional[str] = "language_modeling"):
    """fairseq-validate's parser (upstream's groups): the loss of a trained model (--path) on --valid-subset
    splits; --model-overrides and the task flags given change the checkpoint's saved config."""
    groups = {
        "common": configs.CommonConfig,
        "dataset": configs.DatasetConfig,
        "distributed_training": configs.DistributedTrainingConfig,
        "checkpoint": configs.CheckpointConfig,
        "common_eval": configs.CommonEvalConfig,
    }
    return _base_parser(
        "fairseq-validate: validate a trained model",
        groups,
        default_task or "language_modeling",
        components=tuple(c[0] for c in COMPONENTS),
        help_shown=HELP_SHOWN["validate"],
    )


# ----------------------------------------------------------------------------- generation


def _generation_groups(interactive: bool) -> dict:
    groups = {
        "common": configs.CommonConfig,
        "dataset": configs.DatasetConfig,
        "distributed_training": configs.DistributedTrainingConfig,
        "checkpoint": configs.CheckpointConfig,
        "common_eval": configs.CommonEvalConfig,
        "generation": GenerationConfig,
    }
    if interactive:
        groups["interactive"] = InteractiveConfig
    return groups


def get_generation_parser(interactive: bool = False, default_task: str = "language_modeling"):
    """fairseq-generate's parser (fairseq-interactive's with `interactive`): upstream's groups; the model and
    its flags come from the checkpoint (--path), changed only through --model-overrides."""
    name = "fairseq-interactive: generate from prompts" if interactive else "fairseq-generate: generate for a split"
    return _base_parser(
        name,
        _generation_groups(interactive),
        default_task,
        components=("task",) + ENCODER_COMPONENTS,
        help_shown=HELP_SHOWN["interactive" if interactive else "generate"],
    )


def get_interactive_generation_parser(default_task: str = "language_modeling"):
    return get_generation_parser(interactive=True, default_task=default_task)


get_interactive_parser = get_interactive_generation_parser


def get_serve_parser(default_task: str = "language_modeling"):
    """fairseq-serve's parser: the generation tools' groups without the dataset's batching (each request brings
    its own options; --max-tokens is the serve group's per-request limit), plus the serve group."""
    groups = {name: dc for name, dc in _generation_groups(False).items() if name != "dataset"}
    groups["serve"] = ServeConfig
    return _base_parser(
        "fairseq-serve: an OpenAI-compatible completions server",
        groups,
        default_task,
        components=("task",) + ENCODER_COMPONENTS,
        help_shown=HELP_SHOWN["serve"],
    )


def convert_namespace_to_generation_config(args: argparse.Namespace) -> configs.FairseqConfig:
    """convert_namespace_to_config plus the `generation` and `interactive` groups (upstream's cfg.generation,
    cfg.interactive)."""
    cfg = convert_namespace_to_config(args)
    cfg.generation = config_from_namespace(GenerationConfig, args)
    cfg.interactive = config_from_namespace(InteractiveConfig, args)
    return cfg
