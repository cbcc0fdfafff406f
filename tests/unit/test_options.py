"""Configuration dataclasses, generated parsers, the registry and --user-dir plug-ins."""

import dataclasses
import subprocess
import sys

import pytest

from fairseq import options, registry
from fairseq.dataclass import configs


def test_import_fairseq_is_cheap_and_does_not_import_torch():
    code = "import sys, fairseq, fairseq.registry, fairseq.dataclass.configs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_nested_and_list_defaults_are_not_shared_between_instances():
    a, b = configs.FairseqConfig(), configs.FairseqConfig()
    assert a.common is not b.common
    a.optimization.update_freq.append(4)
    assert b.optimization.update_freq == [1]
    for group in (
        configs.CommonConfig,
        configs.DatasetConfig,
        configs.OptimizationConfig,
        configs.CheckpointConfig,
        configs.DistributedTrainingConfig,
    ):
        for f in dataclasses.fields(group):
            assert not isinstance(f.default, (list, dict, set)), (group.__name__, f.name)


def parse(argv):
    return options.parse_args_and_arch(options.get_training_parser(), argv)


def test_flags_come_from_field_names_and_lists_parse_like_upstream():
    args = parse(
        [
            "data",
            "--arch",
            "transformer_lm",
            "--optimizer",
            "adam",
            "--lr",
            "0.0005",
            "--update-freq",
            "16",
            "--max-tokens",
            "2048",
            "--max-sentences",
            "3",
        ]
    )
    cfg = options.convert_namespace_to_config(args)
    assert cfg.optimization.lr == [0.0005]
    assert cfg.optimization.update_freq == [16]
    assert cfg.dataset.max_tokens == 2048 and cfg.dataset.batch_size == 3  # --max-sentences is an alias
    assert cfg.task._name == "language_modeling" and cfg.task.data == "data"
    assert cfg.model._name == "transformer_lm" and cfg.optimizer._name == "adam"
    assert cfg.lr_scheduler._name == "fixed"


def test_preset_fills_only_what_the_command_line_leaves_unset():
    args = parse(["data", "--arch", "transformer_lm_gpt3_small", "--decoder-layers", "2"])
    assert args.decoder_layers == 2
    assert args.decoder_embed_dim == 768 and args.decoder_attention_heads == 12


def test_unknown_flag_and_unknown_choice_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["data", "--arch", "transformer_lm", "--no-such-flag"])
    assert e.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["data", "--criterion", "nope"])
    assert (
        "unknown criterion 'nope' for --criterion; choose one of: adaptive_loss, cross_entropy,"
        in capsys.readouterr().err
    )


def test_fp16_and_bf16_together_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse(["data", "--fp16", "--bf16"])
    assert "--fp16 and --bf16 cannot be combined" in capsys.readouterr().err


def test_registry_rejects_duplicates_and_lists_choices():
    assert "language_modeling" in registry.TASK_REGISTRY.choices()
    with pytest.raises(ValueError, match="duplicate task 'language_modeling'"):
        registry.register_task("language_modeling")(type("Again", (), {}))
    with pytest.raises(ValueError, match="unknown architecture 'gpt9'"):
        registry.arch_model("gpt9")


PLUGIN = """
from dataclasses import dataclass
from fairseq.dataclass.configs import opt
from fairseq.registry import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion

@dataclass
class ScaledConfig:
    loss_weight: float = opt(1.0, "multiply the loss by this")

@register_criterion("scaled_cross_entropy_for_test", dataclass=ScaledConfig)
class Scaled(CrossEntropyCriterion):
    pass
"""


def test_user_dir_plugin_registers_a_component_with_its_own_flags(user_dir):
    plugin = user_dir("my_plugin_for_options_test", PLUGIN)
    args = parse(
        ["data", "--user-dir", str(plugin), "--criterion", "scaled_cross_entropy_for_test", "--loss-weight", "0.5"]
    )
    cfg = options.convert_namespace_to_config(args)
    assert cfg.criterion._name == "scaled_cross_entropy_for_test" and cfg.criterion.loss_weight == 0.5


def test_user_dir_that_does_not_exist_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="--user-dir"):
        parse(["data", "--user-dir", "/nonexistent/plugins"])


def test_flags_of_saved_upstream_command_lines_are_accepted():
    # upstream 0.12 recipes and logged command lines carry these; here they change nothing (help says why)
    args = parse(["data", "--arch", "transformer_lm", "--all-gather-list-size", "32768", "--fast-stat-sync"])
    cfg = options.convert_namespace_to_config(args)
    assert cfg.common.all_gather_list_size == 32768 and cfg.distributed_training.fast_stat_sync is True


def test_interpolated_defaults_of_plugin_configs_take_the_named_option():
    from dataclasses import dataclass as dc

    from fairseq.dataclass.build import resolve_interpolated_defaults

    @dc
    class PluginConfig:
        block: str = "${task.tokens_per_sample}"
        other: str = "${common.no_such_option}"

    args = parse(["data", "--arch", "transformer_lm", "--tokens-per-sample", "64"])
    cfg = options.convert_namespace_to_config(args)
    cfg.criterion = PluginConfig(other="set")
    resolve_interpolated_defaults(cfg)
    assert cfg.criterion.block == 64 and cfg.criterion.other == "set"
    cfg.criterion = PluginConfig()
    with pytest.raises(
        ValueError, match=r"criterion.other defaults to \$\{common.no_such_option\}.*set criterion.other"
    ):
        resolve_interpolated_defaults(cfg)
