"""fairseq-hydra-train end to end on CPU: the 125m recipe shrunk by overrides trains for 2 updates on the
tiny preprocessed corpus; errors, the requeue status and path resolution through the real entry point."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fairseq.logging.progress_bar import read_json_log
from fairseq_cli import hydra_train

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "examples" / "large_lm" / "config"

SHRINK_125M = [
    "model.decoder_layers=2",
    "model.decoder_embed_dim=32",
    "model.decoder_ffn_embed_dim=64",
    "model.decoder_attention_heads=2",
    "task.tokens_per_sample=32",
    "dataset.batch_size=4",
    "dataset.num_workers=0",
    "optimization.update_freq=[1]",
    "optimization.max_update=2",
    "lr_scheduler.warmup_updates=1",
    "lr_scheduler.total_num_update=2",
    "common.cpu=true",
    "common.bf16=false",
    "common.log_interval=1",
    "distributed_training.ddp_backend=pytorch_ddp",
]


def hydra_args(*overrides, size="125m"):
    return ["--config-dir", str(CONFIG_DIR), "--config-name", size, *SHRINK_125M, *overrides]


@pytest.fixture
def restore_logging():
    """Hydra configures the root logger of the process it runs in; put it back for the next tests."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


def test_console_script_is_registered():
    text = (REPO / "pyproject.toml").read_text()
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]  # tomllib needs Python 3.11
    assert 'fairseq-hydra-train = "fairseq_cli.hydra_train:cli_main"' in scripts.splitlines()


def test_trains_two_updates_and_writes_run_directory(tiny_data, tmp_path, monkeypatch, capsys, restore_logging):
    monkeypatch.chdir(tmp_path)  # in this process, as launched from tmp_path
    for name in [k for k in os.environ if k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))]:
        monkeypatch.delenv(name)
    hydra_train.cli_main(hydra_args(f"task.data={tiny_data}", "checkpoint.save_dir=ck", "common.log_format=json"))
    stdout = capsys.readouterr().out
    checkpoint = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert checkpoint["optimizer_history"][-1]["num_updates"] == 2
    model_cfg = checkpoint["cfg"]["model"]
    assert (model_cfg["_name"], model_cfg["decoder_layers"], model_cfg["activation_fn"]) == (
        "transformer_lm_gpt3_small",
        2,
        "relu",
    )
    assert checkpoint["cfg"]["checkpoint"]["save_dir"] == str(tmp_path / "ck")  # relative to where it ran

    (run_dir,) = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]  # hydra's default run dir
    composed = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert composed["model"]["decoder_layers"] == 2 and composed["task"]["data"] == str(tiny_data)
    resolved = yaml.safe_load((run_dir / ".hydra" / "fairseq_config.yaml").read_text())
    assert resolved["lr_scheduler"]["end_learning_rate"] == pytest.approx(6e-5)
    assert resolved["model"]["share_decoder_input_output_embed"] is True
    train_inner = read_json_log(run_dir / "hydra_train.log")
    assert [row["num_updates"] for row in train_inner] == ["1", "2"]  # fairseq-train's line format
    assert "the global batch is 128 tokens" in stdout  # the recipe's batch is not what this run used


def test_unknown_key_is_a_one_line_error(tmp_path, monkeypatch, capsys, restore_logging):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        hydra_train.cli_main(hydra_args("task.data=/nowhere", "optimization.lrr=[1]"))
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "fairseq-hydra-train: error: unknown key 'optimization.lrr' (did you mean 'optimization.lr'?)" in err
    assert "Traceback" not in err


def test_requeued_training_exits_with_status_3(tmp_path, monkeypatch, restore_logging):
    from fairseq_cli import train

    seen = []
    monkeypatch.setattr(train, "main", lambda cfg, validated=False: seen.append(cfg) or train.REQUEUED)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        hydra_train.cli_main(hydra_args("task._name=dummy_lm", "hydra/job_logging=none"))
    assert exit_info.value.code == 3
    assert seen[0].task._name == "dummy_lm" and seen[0].model.decoder_layers == 2


def test_relative_paths_stay_relative_to_the_launch_directory_with_chdir(tmp_path, monkeypatch, restore_logging):
    from fairseq_cli import train

    seen = []
    monkeypatch.setattr(train, "main", lambda cfg, validated=False: seen.append((cfg, os.getcwd())))
    monkeypatch.chdir(tmp_path)
    hydra_train.cli_main(
        hydra_args(
            "task.data=data-bin",
            "checkpoint.save_dir=ck",
            "hydra.job.chdir=true",
            "hydra.run.dir=runs/one",
            "hydra/job_logging=none",
        )
    )
    cfg, cwd_during_training = seen[0]
    assert cwd_during_training == str(tmp_path / "runs" / "one")  # hydra did change directory
    assert cfg.checkpoint.save_dir == str(tmp_path / "ck")
    assert cfg.task.data == str(tmp_path / "data-bin")
    assert (tmp_path / "runs" / "one" / ".hydra" / "fairseq_config.yaml").is_file()


def test_only_the_first_process_writes_the_run_directory():
    args = ["--config-dir", "d", "--config-name", "125m", "model.decoder_layers=2", "hydra.run.dir=x"]
    first = hydra_train.hydra_argv(args, environ={"SLURM_PROCID": "0"})
    assert first == [
        "--config-dir",
        "d",
        "--config-name",
        "125m",
        "++model.decoder_layers=2",
        "hydra.run.dir=x",
        "hydra/job_logging=fairseq",
    ]
    later = hydra_train.hydra_argv(args, environ={"SLURM_PROCID": "5"})
    assert later[-2:] == ["hydra/job_logging=fairseq_console", "hydra.output_subdir=null"]
    assert hydra_train.hydra_argv(args + ["hydra/job_logging=none"], environ={"RANK": "1"})[-2:] == [
        "hydra/job_logging=none",
        "hydra.output_subdir=null",
    ]


def test_overrides_may_come_before_the_options():
    """Upstream's docs write `fairseq-hydra-train task.data=X --config-dir D --config-name N`."""
    from hydra._internal.utils import get_args_parser

    args = ["task.data=x", "model.decoder_layers=2", "--config-dir", "d", "--config-name", "125m"]
    for environ in ({"RANK": "0"}, {"RANK": "3"}):
        parsed = get_args_parser().parse_args(hydra_train.hydra_argv(args, environ=environ))  # hydra's parser
        assert parsed.config_dir == "d" and parsed.config_name == "125m"
        assert parsed.overrides[:3] == [
            "++task.data=x",
            "++model.decoder_layers=2",
            "hydra/job_logging=" + ("fairseq" if environ["RANK"] == "0" else "fairseq_console"),
        ]


UPSTREAM_STYLE_CONFIG = """# @package _group_
defaults:
  - model: tiny
common:
  log_format: json
  log_interval: 1
  cpu: true
checkpoint:
  save_dir: ck
  no_epoch_checkpoints: true
  keep_interval_updates: ${common.seed}
dataset:
  max_tokens: 128
  max_tokens_valid: ${dataset.max_tokens}
  num_workers: 0
optimization:
  max_update: 2
  lr: [0.0005]
task:
  _name: language_modeling
  data: ???
  tokens_per_sample: 32
criterion: cross_entropy
optimizer:
  _name: adam
  adam_betas: (0.9,0.98)
lr_scheduler:
  _name: inverse_sqrt
  warmup_updates: 1
bpe: null
tokenizer: null
"""

UPSTREAM_STYLE_MODEL = """# @package _group_
_name: transformer_lm
decoder_layers: 2
decoder_embed_dim: 32
decoder_ffn_embed_dim: 64
decoder_attention_heads: 2
"""


def test_upstream_style_yaml_with_group_package_headers(tiny_data, tmp_path, restore_logging, monkeypatch):
    """Upstream's YAML files begin with `# @package _group_` (hydra 1.0), which hydra 1.3 would nest under a
    `_group_` key; here they train as written, overrides first, interpolation and null bpe included."""
    config_dir = tmp_path / "config"
    (config_dir / "model").mkdir(parents=True)
    (config_dir / "lm.yaml").write_text(UPSTREAM_STYLE_CONFIG)
    (config_dir / "model" / "tiny.yaml").write_text(UPSTREAM_STYLE_MODEL)
    seen = []
    monkeypatch.chdir(tmp_path)
    from fairseq_cli import train

    original = train.main
    try:
        train.main = lambda cfg, validated=False: seen.append(cfg) or original(cfg, validated)
        hydra_train.cli_main(
            [
                f"task.data={tiny_data}",
                "model.decoder_layers=1",
                "hydra.run.dir=run",
                "hydra/job_logging=none",
                "--config-dir",
                str(config_dir),
                "--config-name",
                "lm",
            ]
        )
    finally:
        train.main = original
    (cfg,) = seen
    assert cfg.model._name == "transformer_lm" and cfg.model.decoder_embed_dim == 32
    assert cfg.model.decoder_layers == 1  # the override wins over the group file
    assert cfg.dataset.max_tokens_valid == 128  # ${dataset.max_tokens}
    assert cfg.checkpoint.keep_interval_updates == 1  # ${common.seed}: not in the file, so its default
    assert cfg.optimization.max_update == 2 and cfg.task.tokens_per_sample == 32
    assert (
        torch.load(tmp_path / "ck" / "checkpoint_last.pt", weights_only=True)["extra_state"]["trainer"]["num_updates"]
        == 2
    )


def test_unused_upstream_groups_must_be_null():
    from fairseq.frontend.hydra import fairseq_config_from_dict

    base = {"task": {"_name": "dummy_lm"}, "model": {"_name": "transformer_lm"}, "optimizer": "adam"}
    cfg = fairseq_config_from_dict(dict(base, bpe=None, tokenizer={"_name": None}, scoring=None))
    assert cfg.bpe is None and cfg.tokenizer is None
    with pytest.raises(ValueError, match="'scoring' is set to .*remove 'scoring' or set it to null"):
        fairseq_config_from_dict(dict(base, scoring={"_name": "bleu"}))


def test_bpe_and_tokenizer_groups_give_the_command_lines_config(tmp_path, monkeypatch):
    """`bpe:`/`tokenizer:` are the same components as fairseq-train's --bpe/--tokenizer: recorded in the config
    (and so the checkpoint), their file paths taken relative to the launch directory."""
    from fairseq import options
    from fairseq.frontend.hydra import fairseq_config_from_dict, resolve_paths
    from fairseq.dataclass.utils import config_to_dict

    monkeypatch.chdir(tmp_path)
    base = {"task": {"_name": "dummy_lm"}, "model": {"_name": "transformer_lm"}, "optimizer": "adam"}
    values = resolve_paths(
        dict(
            base,
            bpe={"_name": "gpt2", "gpt2_encoder_json": "gpt2/encoder.json", "gpt2_vocab_bpe": "gpt2/vocab.bpe"},
            tokenizer="space",
        ),
        str(tmp_path),
    )
    from_yaml = fairseq_config_from_dict(values)
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            "--task",
            "dummy_lm",
            "--arch",
            "transformer_lm",
            "--optimizer",
            "adam",
            "--bpe",
            "gpt2",
            "--gpt2-encoder-json",
            str(tmp_path / "gpt2/encoder.json"),
            "--gpt2-vocab-bpe",
            str(tmp_path / "gpt2/vocab.bpe"),
            "--tokenizer",
            "space",
        ],
    )
    from_flags = options.convert_namespace_to_config(args)
    assert from_yaml.bpe._name == "gpt2" and from_yaml.bpe.gpt2_vocab_bpe == str(tmp_path / "gpt2" / "vocab.bpe")
    assert config_to_dict(from_yaml) == config_to_dict(from_flags)
    with pytest.raises(ValueError, match="bpe._name='gpt3' is not a registered"):
        fairseq_config_from_dict(dict(base, bpe={"_name": "gpt3"}))
    with pytest.raises(ValueError, match="unknown key 'bpe.gpt2_encoder'.*did you mean 'bpe.gpt2_encoder_json'"):
        fairseq_config_from_dict(dict(base, bpe={"_name": "gpt2", "gpt2_encoder": "x"}))


def test_upstream_documented_command_with_config_groups(tiny_data, tmp_path, restore_logging, monkeypatch):
    """Upstream's hydra docs' first command: no config file, groups chosen on the command line
    (`task=language_modeling`, `model=transformer_lm/transformer_lm_gpt`, `optimizer=adam`); as upstream's
    bundled config does, the run directory is the current one."""
    monkeypatch.chdir(tmp_path)
    hydra_train.cli_main(
        [
            "distributed_training.distributed_world_size=1",
            "dataset.batch_size=2",
            f"task.data={tiny_data}",
            "model=transformer_lm/transformer_lm_gpt",
            "task=language_modeling",
            "optimization.max_update=2",
            "optimizer=adam",
            "model.decoder_layers=1",
            "model.decoder_embed_dim=32",
            "model.decoder_ffn_embed_dim=64",
            "model.decoder_attention_heads=2",
            "task.tokens_per_sample=32",
            "common.cpu=true",
            "dataset.num_workers=0",
            "hydra/job_logging=none",
        ]
    )
    saved = yaml.safe_load((tmp_path / ".hydra" / "fairseq_config.yaml").read_text())
    assert saved["model"]["_name"] == "transformer_lm_gpt" and saved["model"]["decoder_layers"] == 1
    assert saved["model"]["activation_fn"] == "gelu"  # the gpt preset filled what was not set
    assert saved["optimizer"]["_name"] == "adam" and saved["criterion"]["_name"] == "cross_entropy"
    assert saved["lr_scheduler"]["_name"] == "fixed"
    state = torch.load(tmp_path / "checkpoints" / "checkpoint_last.pt", weights_only=True)
    assert state["extra_state"]["trainer"]["num_updates"] == 2
    # `model=ARCH` works too, and an unknown choice lists the architectures
    assert "model/transformer_lm_gpt2_small" in _stored_options()
    assert "model/transformer_lm/transformer_lm_gpt2_small" in _stored_options()


def _stored_options():
    from hydra.core.config_store import ConfigStore

    repo = ConfigStore.instance().repo
    found = []

    def walk(node, prefix):
        for key, value in node.items():
            path = f"{prefix}/{key}" if prefix else key
            if isinstance(value, dict):
                walk(value, path)
            else:
                found.append(path[: -len(".yaml")] if path.endswith(".yaml") else path)

    walk(repo, "")
    return found


def test_the_header_free_copy_holds_only_the_yaml_files(tmp_path):
    from fairseq.frontend.hydra import without_group_package_headers

    (tmp_path / "model").mkdir()
    (tmp_path / "lm.yaml").write_text("# @package _group_\ncommon:\n  seed: 2\n")
    (tmp_path / "model" / "tiny.yaml").write_text("# @package _group_\n_name: transformer_lm\n")
    (tmp_path / "data.bin").write_bytes(b"\0" * 1024)  # data or checkpoints beside the configs stay put
    with without_group_package_headers(str(tmp_path)) as copy:
        assert copy != str(tmp_path)
        files = sorted(str(p.relative_to(copy)) for p in Path(copy).rglob("*") if p.is_file())
        assert files == ["lm.yaml", "model/tiny.yaml"]
        assert (Path(copy) / "lm.yaml").read_text() == "\ncommon:\n  seed: 2\n"
        assert (Path(copy) / "model" / "tiny.yaml").read_text() == "\n_name: transformer_lm\n"
    assert not Path(copy).exists()  # removed afterwards
    (tmp_path / "lm.yaml").write_text("common:\n  seed: 2\n")
    (tmp_path / "model" / "tiny.yaml").write_text("_name: transformer_lm\n")
    with without_group_package_headers(str(tmp_path)) as same:
        assert same == str(tmp_path)  # nothing to strip: no copy


# ----------------------------------------------------------------------------- unreadable YAML


def run_hydra_cli(*args, cwd):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE")) and k != "HYDRA_FULL_ERROR"
    }
    return subprocess.run(
        [sys.executable, "-m", "fairseq_cli.hydra_train", "hydra/job_logging=none", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_duplicate_key_is_one_line_naming_file_key_and_line(tmp_path):
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "lm.yaml").write_text(
        "common:\n  cpu: true\noptimization:\n  max_update: 2\n  lr: [0.001]\n  max_update: 3\n"
        "task:\n  _name: dummy_lm\n"
    )
    result = run_hydra_cli("--config-dir", str(config_dir), "--config-name", "lm", cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"fairseq-hydra-train: error: {config_dir / 'lm.yaml'}, line 6: duplicate key 'optimization.max_update' "
        "(first set at line 4); each key may appear only once"
    ], result.stderr[-3000:]
    assert result.stdout == ""


def test_duplicate_key_in_an_upstream_style_group_file_names_the_users_file(
    tmp_path, monkeypatch, capsys, restore_logging
):
    """Files with `# @package _group_` headers are read from a header-free copy; the message names the
    user's file, and the line numbers are the user's."""
    config_dir = tmp_path / "config"
    (config_dir / "model").mkdir(parents=True)
    (config_dir / "lm.yaml").write_text(UPSTREAM_STYLE_CONFIG)
    (config_dir / "model" / "tiny.yaml").write_text(UPSTREAM_STYLE_MODEL + "decoder_layers: 4\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_info:  # in this process (the test above runs the command as one)
        hydra_train.cli_main(
            ["hydra/job_logging=none", "task.data=x", "--config-dir", str(config_dir), "--config-name", "lm"]
        )
    assert exit_info.value.code == 1
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert errors == [
        f"fairseq-hydra-train: error: {config_dir / 'model' / 'tiny.yaml'}, line 7: duplicate key 'decoder_layers' "
        "(first set at line 3); each key may appear only once"
    ], stderr[-3000:]
    assert "Traceback" not in stderr


def test_yaml_syntax_error_is_one_line(tmp_path, monkeypatch, capsys, restore_logging):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    (tmp_path / "bad.yaml").write_text("common:\n  cpu: [true\n")
    with pytest.raises(SystemExit) as exit_info:
        hydra_train.cli_main(["--config-dir", str(tmp_path), "--config-name", "bad", "hydra/job_logging=none"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert (
        err.startswith(f"fairseq-hydra-train: error: {tmp_path / 'bad.yaml'}, line 3, column 1: ")
        and err.count("\n") == 1
    ), err
    assert "HYDRA_FULL_ERROR" not in os.environ  # hydra's switch, set while composing, is put back


def test_other_hydra_errors_are_reported_as_hydra_reports_them(tmp_path, monkeypatch, capsys, restore_logging):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    (tmp_path / "lm.yaml").write_text("common:\n  cpu: true\n")
    with pytest.raises(SystemExit) as exit_info:
        hydra_train.cli_main(
            ["--config-dir", str(tmp_path), "--config-name", "lm", "hydra/job_logging=none", "model=nowhere"]
        )
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Could not override 'model'" in err and "Traceback" not in err
    assert "HYDRA_FULL_ERROR" not in os.environ


def hydra_in_process(capsys, *args):
    """fairseq-hydra-train's entry point in this process (the command line's own process is
    test_duplicate_key_is_one_line_naming_file_key_and_line's): (exit status, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        hydra_train.cli_main(["hydra/job_logging=none", *args])
    return exit_info.value.code, capsys.readouterr().err


def test_misspelt_config_name_or_missing_config_dir_is_one_line(tmp_path, monkeypatch, capsys, restore_logging):
    """hydra's 9-line 'Cannot find primary config' (and its 'Additional config directory ... not found') become
    one line: the closest config name and the configs the directory holds."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    for name in ("tiny", "small"):
        (config_dir / f"{name}.yaml").write_text("common:\n  cpu: true\n")
    status, err = hydra_in_process(capsys, "--config-dir", str(config_dir), "--config-name", "tni")
    assert status == 1 and "Traceback" not in err, err[-3000:]
    assert err.splitlines() == [
        f"fairseq-hydra-train: error: --config-name tni: no tni.yaml in {config_dir}; the configs there, closest "
        "first: tiny, small"
    ], err[-3000:]
    status, err = hydra_in_process(capsys, "--config-dir", str(config_dir), "--config-name", "tinny")
    assert err.splitlines() == [
        f"fairseq-hydra-train: error: --config-name tinny: no tinny.yaml in {config_dir} (did you mean 'tiny'?); "
        "the configs there, closest first: tiny, small"
    ], err[-3000:]
    status, err = hydra_in_process(capsys, "--config-dir", str(tmp_path / "nowhere"), "--config-name", "tiny")
    assert status == 1 and err.splitlines() == [
        f"fairseq-hydra-train: error: --config-dir {tmp_path / 'nowhere'}: no such directory; pass the directory "
        "that holds tiny.yaml"
    ], err[-3000:]
    assert not (tmp_path / "outputs").exists()
    assert "HYDRA_FULL_ERROR" not in os.environ


def test_unwritable_run_directory_is_one_line(tmp_path, monkeypatch, capsys, restore_logging):
    """hydra's outputs/ under the directory run from cannot be made (a file is in the way: the same for root,
    whom a read-only mode does not stop): one line naming the path, the errno and the fix."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "lm.yaml").write_text("common:\n  cpu: true\n")
    (tmp_path / "outputs").write_text("not a directory")
    status, err = hydra_in_process(capsys, "--config-dir", str(config_dir), "--config-name", "lm")
    lines = err.strip().splitlines()
    assert status == 1 and "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert (
        lines[0].startswith("fairseq-hydra-train: error: cannot write hydra's run directory outputs/")
        and "(ENOTDIR)" in lines[0]
        and lines[0].endswith("pass hydra.run.dir=DIR")
    ), lines[0]
    assert (tmp_path / "outputs").read_text() == "not a directory"


def test_hydra_full_error_still_gives_the_traceback(tmp_path, monkeypatch, restore_logging):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    (tmp_path / "dup.yaml").write_text("common:\n  seed: 1\n  seed: 2\n")
    with pytest.raises(yaml.YAMLError, match="found duplicate key seed"):
        hydra_train.cli_main(["--config-dir", str(tmp_path), "--config-name", "dup", "hydra/job_logging=none"])
    assert os.environ["HYDRA_FULL_ERROR"] == "1"


def test_yaml_model_group_input_and_output_dims_keep_upstreams_default():
    """A YAML `model:` group is upstream's dataclass: unset input/output dims are 512 whatever the embed dim."""
    from fairseq.frontend.hydra import fairseq_config_from_dict

    base = {"task": {"_name": "language_modeling", "data": "data-bin"}, "optimizer": {"_name": "adam"}}
    model = fairseq_config_from_dict(dict(base, model={"_name": "transformer_lm", "decoder_embed_dim": 64})).model
    assert (model.decoder_input_dim, model.decoder_output_dim) == (512, 512)
    model = fairseq_config_from_dict(
        dict(base, model={"_name": "transformer_lm", "decoder_embed_dim": 64, "decoder_input_dim": 128})
    ).model
    assert (model.decoder_input_dim, model.decoder_output_dim) == (128, 512)


def test_streaming_task_with_yaml_weights(tmp_path, monkeypatch, capsys, restore_logging):
    from tests.streaming_fixtures import write_jsonl_corpora

    data = write_jsonl_corpora(tmp_path / "jsonl", docs=40, valid_docs=4)
    monkeypatch.chdir(tmp_path)
    for name in [k for k in os.environ if k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))]:
        monkeypatch.delenv(name)
    hydra_train.cli_main(
        hydra_args(
            "task._name=streaming_language_modeling",
            f"task.data={data}",
            "task.data_weights='web=1,books=0'",
            "checkpoint.save_dir=ck",
            "hydra/job_logging=none",
        )
    )
    checkpoint = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    streaming = checkpoint["extra_state"]["train_iterator"]["streaming"]
    assert streaming["rates"] == {"books": 0.0, "web": 1.0}
    assert streaming["tokens"] == {"books": 0, "web": 2 * 4 * 32}  # 2 updates of 4 blocks of 32 tokens
