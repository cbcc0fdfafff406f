"""The large-LM recipes (examples/large_lm/config) compose with hydra into the FairseqConfig fairseq-train
would build, and build their models on the meta device; the YAML -> config conversion checks every key."""

import importlib.util
import math
import re
import shlex
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from fairseq import options
from fairseq.frontend.hydra import (
    as_hydra_overrides,
    fairseq_config_from_dict,
    recipe_update_freq,
    resolve_paths,
    split_recipe,
    to_plain_dict,
)
from fairseq.dataclass.utils import config_to_dict
from fairseq.models.transformer_lm import TransformerLanguageModel

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "examples" / "large_lm" / "config"
README = REPO / "examples" / "large_lm" / "README.md"
VOCAB = 50272  # GPT-2 BPE padded to a multiple of 8, as OPT

# LARGE_LM_SIZES.md: size -> (layers, d_model, heads, batch tokens, peak lr, nominal parameters)
M = 2**20
TABLE = {
    "125m": (12, 768, 12, M // 2, 6.0e-4, 125e6),
    "350m": (24, 1024, 16, M // 2, 3.0e-4, 350e6),
    "760m": (24, 1536, 16, M // 2, 2.5e-4, 760e6),
    "1.3b": (24, 2048, 32, M, 2.0e-4, 1.3e9),
    "2.7b": (32, 2560, 32, M, 1.6e-4, 2.7e9),
    "6.7b": (32, 4096, 32, 2 * M, 1.2e-4, 6.7e9),
    "13b": (40, 5120, 40, 4 * M, 1.0e-4, 13e9),
    "30b": (48, 7168, 56, 4 * M, 1.0e-4, 30e9),
    "66b": (64, 9216, 72, 2 * M, 8e-5, 66e9),
    "175b": (96, 12288, 96, 2 * M, 1.2e-4, 175e9),  # lr: the OPT paper's (README says why)
}
BIG = {"13b", "30b", "66b", "175b"}  # FSDP flags and sharded checkpoints
# The tensor-parallel variants (OPT's layout, float8, compile): each inherits its size's recipe (hydra defaults) and
# changes exactly these keys.
TP_VARIANTS = {"66b_tp8": ("66b", {"dataset.batch_size": 16}), "175b_tp8": ("175b", {"dataset.batch_size": 8})}
TP_CHANGES = {
    "criterion._name": "vocab_parallel_cross_entropy",
    "distributed_training.model_parallel_size": 8,
    "distributed_training.compile": True,
    "common.fp8": True,
    "common.fp8_recipe": "tensorwise",
    "common.fp8_fsdp_all_gather": True,
}


# The streaming variants: their size's recipe with the data read as JSONL corpora (docs/streaming_data.md).
STREAMING_VARIANTS = {"66b_streaming": "66b", "175b_streaming": "175b"}
STREAMING_FILES = ["task.data=/data", "bpe.gpt2_encoder_json=/gpt2/encoder.json", "bpe.gpt2_vocab_bpe=/gpt2/vocab.bpe"]


def load_script(name):
    """A module of scripts/ (not a package), imported by path."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compose_values(size, overrides=()):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_plain_dict(compose(config_name=size, overrides=as_hydra_overrides(list(overrides))))


def compose_config(size, overrides=("task.data=/data",)):
    values, recipe = split_recipe(compose_values(size, overrides))
    return fairseq_config_from_dict(values), recipe


def build_on_meta(cfg):
    with torch.device("meta"):
        return TransformerLanguageModel.build(cfg.model, VOCAB, 1)


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def test_every_size_has_a_config():
    assert sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) == sorted([*TABLE, *TP_VARIANTS, *STREAMING_VARIANTS])


def flat(values, prefix=""):
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("variant", list(TP_VARIANTS))
def test_tensor_parallel_variant_is_its_size_with_the_layout_changed(variant):
    size, batch = TP_VARIANTS[variant]
    base, base_recipe = split_recipe(compose_values(size, ["task.data=/data"]))
    tp, tp_recipe = split_recipe(compose_values(variant, ["task.data=/data"]))
    changed = {key: value for key, value in flat(tp).items() if flat(base).get(key, "unset") != value}
    assert changed == {**TP_CHANGES, **batch, "checkpoint.save_dir": f"checkpoints/{variant}"}
    assert set(flat(base)) <= set(flat(tp))
    assert tp_recipe == base_recipe  # the same global batch on the same GPU count ...
    cfg, recipe = compose_config(variant)
    data_parallel = recipe["gpus"] // cfg.distributed_training.model_parallel_size
    per_update = cfg.dataset.batch_size * cfg.optimization.update_freq[0] * data_parallel * cfg.task.tokens_per_sample
    assert per_update == recipe["global_batch_tokens"] == 2 * M  # ... over the data-parallel ranks
    from fairseq.distributed.float8 import check_float8_flags
    from fairseq.distributed.tensor_parallel_checks import check_tensor_parallel_shape

    common = cfg.common
    check_float8_flags(
        common.fp8,
        common.fp16,
        common.bf16,
        common.fp8_recipe,
        common.fp8_fsdp_all_gather,
        cfg.distributed_training.ddp_backend,
    )
    check_tensor_parallel_shape(8, cfg.model.decoder_attention_heads, cfg.model.decoder_ffn_embed_dim, VOCAB)


@pytest.mark.parametrize("variant", list(STREAMING_VARIANTS))
def test_streaming_variant_is_its_size_with_the_data_changed(variant):
    size = STREAMING_VARIANTS[variant]
    base, base_recipe = split_recipe(compose_values(size, ["task.data=/data"]))
    streaming, recipe = split_recipe(compose_values(variant, STREAMING_FILES))
    changed = {key for key, value in flat(streaming).items() if flat(base).get(key, "unset") != value}
    assert changed == {
        "task._name",
        "task.data_weights",
        "task.multicorpus_sampling_alpha",
        "bpe._name",
        "bpe.gpt2_encoder_json",
        "bpe.gpt2_vocab_bpe",
        "dataset.num_workers",
        "dataset.valid_subset",
        "checkpoint.save_dir",
    }
    assert recipe == base_recipe
    cfg = fairseq_config_from_dict(streaming)
    assert cfg.task.tokens_per_sample == 2048 and cfg.task.bpe == "gpt2"
    assert cfg.task.gpt2_encoder_json == "/gpt2/encoder.json"


@pytest.mark.parametrize("size", list(TABLE))
def test_config_follows_the_recipe_and_builds_on_meta(size):
    layers, dim, heads, batch_tokens, lr, nominal = TABLE[size]
    cfg, recipe = compose_config(size)
    model = build_on_meta(cfg)

    assert len(model.decoder.layers) == layers
    assert (cfg.model.decoder_embed_dim, cfg.model.decoder_attention_heads) == (dim, heads)
    assert cfg.model.decoder_ffn_embed_dim == 4 * dim
    assert cfg.model._name.startswith("transformer_lm_gpt3_")
    assert cfg.model.activation_fn == "relu"  # OPT, although the gpt3 presets default to gelu
    assert cfg.model.dropout == 0.1 and cfg.model.attention_dropout == 0.0
    assert cfg.model.decoder_normalize_before and cfg.model.decoder_learned_pos
    assert cfg.model.share_decoder_input_output_embed and cfg.model.checkpoint_activations
    assert cfg.model.max_target_positions == cfg.task.tokens_per_sample == 2048
    assert abs(num_params(model) - nominal) / nominal < 0.10

    assert cfg.optimizer._name == "adam" and cfg.optimizer.adam_betas == "(0.9, 0.95)"
    assert (cfg.optimizer.adam_eps, cfg.optimizer.weight_decay, cfg.optimization.clip_norm) == (1e-8, 0.1, 1.0)
    assert cfg.optimization.lr == [pytest.approx(lr)]
    assert cfg.lr_scheduler._name == "polynomial_decay" and cfg.lr_scheduler.power == 1.0
    assert cfg.lr_scheduler.end_learning_rate == pytest.approx(0.1 * lr)
    assert cfg.lr_scheduler.total_num_update == cfg.optimization.max_update == math.ceil(300e9 / batch_tokens)
    expected_warmup = 2000 if size == "175b" else round(375e6 / batch_tokens)
    assert cfg.lr_scheduler.warmup_updates == expected_warmup

    # the global batch of the table on the GPU count the config states
    per_update = cfg.dataset.batch_size * cfg.optimization.update_freq[0] * recipe["gpus"] * cfg.task.tokens_per_sample
    assert per_update == recipe["global_batch_tokens"] == batch_tokens
    assert recipe["gpus"] % 8 == 0

    assert cfg.common.bf16 and not cfg.common.fp16
    dt = cfg.distributed_training
    assert dt.ddp_backend == "fully_sharded"
    assert dt.fsdp_forward_prefetch == dt.fsdp_sync_free == dt.use_sharded_state == (size in BIG)


def test_175b_parameter_count_is_exact():
    cfg, _ = compose_config("175b")
    assert num_params(build_on_meta(cfg)) == 174_604_468_224


def test_readme_parameter_counts_match_the_built_models():
    rows = re.findall(r"^\| (\S+) \| `\S+\.yaml` \|.*\| ([\d,]+) \|$", README.read_text(), flags=re.M)
    assert [size for size, _ in rows] == list(TABLE)
    for size, count in rows:
        assert num_params(build_on_meta(compose_config(size)[0])) == int(count.replace(",", "")), size


def test_overrides_apply_and_end_learning_rate_follows_lr():
    cfg, _ = compose_config(
        "125m",
        [
            "task.data=/data",
            "optimization.lr=[0.001]",
            "model.decoder_layers=2",
            "common.cpu=true",
            "dataset.batch_size=4",
        ],
    )
    assert cfg.optimization.lr == [0.001]
    assert cfg.lr_scheduler.end_learning_rate == pytest.approx(1e-4)
    assert len(build_on_meta(cfg).decoder.layers) == 2
    assert cfg.common.cpu is True and cfg.dataset.batch_size == 4


def test_dummy_lm_needs_no_data():
    cfg, _ = compose_config("6.7b", ["task._name=dummy_lm", "task.dict_size=50268"])
    assert cfg.task._name == "dummy_lm" and cfg.task.dict_size == 50268
    assert cfg.task.tokens_per_sample == cfg.model.tokens_per_sample == 2048


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["optimization.lrr=[1]"],
            r"unknown key 'optimization.lrr' \(did you mean 'optimization.lr'\?\).*OptimizationConfig",
        ),
        (["model.decoder_layer=2"], r"unknown key 'model.decoder_layer' \(did you mean 'model.decoder_layers'\?\)"),
        (["task.dict_size=8"], r"unknown key 'task.dict_size'.*language_modeling"),
        (["+optimisation.lr=[1]"], r"unknown top-level key 'optimisation' \(did you mean 'optimization'\?\)"),
        (["distributed_training.ddp_backend=zero3"], r"distributed_training.ddp_backend='zero3'.*fully_sharded"),
        (["model._name=gpt5"], r"model._name='gpt5' is not an architecture"),
        (["optimizer._name=sgd"], r"optimizer._name='sgd' is not a registered optimizer"),
        (["optimizer._name=adamm"], r"optimizer._name='adamm' is not a registered optimizer \(did you mean 'adam'\?\)"),
        (
            ["model._name=transformer_lm_gpt3_smal"],
            r"not an architecture \(did you mean 'transformer_lm_gpt3_small'\?\)",
        ),
        (["common.log_format=jsn"], r"common.log_format='jsn' is not a valid choice \(did you mean 'json'\?\)"),
        (["dataset.batch_size=many"], r"dataset.batch_size='many': expected an integer"),
        (["common.bf16=1"], r"common.bf16=1: expected true or false"),
        (["common.fp16=true"], r"--fp16 and --bf16 cannot be combined"),
        (["task.seed=7", "common.seed=8"], r"set the same option \(--seed\) to different values"),
    ],
)
def test_bad_configs_fail_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose_config("125m", ["task.data=/data"] + overrides)


def test_missing_data_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match=r"task.data is required \(it is \?\?\? in the config\): add task.data="):
        compose_config("125m", [])


def test_the_preset_fills_only_what_the_config_leaves_unset():
    # A config that names the preset only: the same as fairseq-train --arch ... with no model flags.
    values = {
        "task": {"data": "/data"},
        "model": {"_name": "transformer_lm_gpt3_small", "decoder_embed_dim": 256},
        "optimizer": {"_name": "adam"},
        "dataset": {"batch_size": 2},
    }
    cfg = fairseq_config_from_dict(values)
    assert cfg.model.decoder_layers == 12 and cfg.model.activation_fn == "gelu"  # from the preset
    assert cfg.model.decoder_ffn_embed_dim == 1024  # derived by the preset from the set embed dim
    assert cfg.task._name == "language_modeling" and cfg.lr_scheduler._name == "fixed"  # command-line defaults
    argv = [
        "/data",
        "--arch",
        "transformer_lm_gpt3_small",
        "--decoder-embed-dim",
        "256",
        "--optimizer",
        "adam",
        "--batch-size",
        "2",
    ]
    from_flags = options.convert_namespace_to_config(options.parse_args_and_arch(options.get_training_parser(), argv))
    assert config_to_dict(cfg) == config_to_dict(from_flags)


@pytest.mark.parametrize("size", [*TABLE, *TP_VARIANTS])
def test_rendered_fairseq_train_command_builds_the_same_config(size):
    command = load_script("render_train_command").train_command(size)
    argv = shlex.split(command.replace('"$DATA"', "/data").replace("\\\n", " "))
    assert argv[0] == "fairseq-train"
    from_flags = options.convert_namespace_to_config(
        options.parse_args_and_arch(options.get_training_parser(), argv[1:])
    )
    assert config_to_dict(from_flags) == config_to_dict(compose_config(size)[0])


def test_as_hydra_overrides_lets_dotted_keys_add():
    assert as_hydra_overrides(
        ["a.b=1", "+a.c=2", "++a.d=3", "~a.e", "hydra.run.dir=x", "hydra/job_logging=none", "task=x", "db@pkg=y"]
    ) == ["++a.b=1", "+a.c=2", "++a.d=3", "~a.e", "hydra.run.dir=x", "hydra/job_logging=none", "task=x", "db@pkg=y"]


def test_relative_paths_resolve_against_the_given_directory(tmp_path):
    values = {
        "checkpoint": {"save_dir": "ck", "restore_file": "checkpoint_last.pt"},
        "task": {"data": "a:/abs/b"},
        "common": {"log_file": "logs/train.log", "user_dir": None},
    }
    out = resolve_paths(values, str(tmp_path))
    assert out["checkpoint"]["save_dir"] == str(tmp_path / "ck")
    assert out["checkpoint"]["restore_file"] == "checkpoint_last.pt"  # a bare name is looked up in save_dir
    assert out["task"]["data"] == f"{tmp_path / 'a'}:/abs/b"
    assert out["common"]["log_file"] == str(tmp_path / "logs" / "train.log")
    assert values["checkpoint"]["save_dir"] == "ck"  # the input is left alone


def test_recipe_update_freq_keeps_the_global_batch():
    recipe = {"gpus": 1024, "global_batch_tokens": 2 * M}
    assert recipe_update_freq(recipe, 1, 2048, 1024) == 1
    assert recipe_update_freq(recipe, 1, 2048, 256) == 4
    with pytest.raises(ValueError, match=r"no update_freq gives the recipe's global batch of 2,097,152 tokens"):
        recipe_update_freq(recipe, 1, 2048, 24)
