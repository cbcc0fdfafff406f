"""Upstream's LM API where the fork used to differ, called as upstream's tests and scripts call it (in process,
real files): fairseq.checkpoint_utils.PathManager patched under the functions that use it, save_checkpoint with
checkpoint options of its own, and fairseq-preprocess with upstream's preprocessing options. (The module names
plug-ins build on: test_upstream_modules.py; NormFormer: test_normformer.py; the Namespace entry points:
tests/integration/test_upstream_lm_flow.py.)"""

import dataclasses
import logging
import os
from unittest.mock import MagicMock, patch

import pytest
import torch
from omegaconf import OmegaConf

from fairseq import checkpoint_utils, file_io, options, tasks
from fairseq.criterions import build_criterion
from fairseq.logging import metrics
from fairseq.trainer import Trainer
from fairseq_cli import preprocess
from tests.train_fixtures import train_until

# ----------------------------------------------------------------------------- PathManager


def test_checkpoint_utils_pathmanager_is_upstreams():
    assert checkpoint_utils.PathManager is file_io.PathManager
    assert checkpoint_utils.torch is torch  # upstream's tests patch checkpoint_utils.torch.load


def test_async_save_writes_through_pathmanager_opena():
    with (
        patch(f"{checkpoint_utils.__name__}.PathManager.opena") as opena,
        patch(f"{checkpoint_utils.__name__}._torch_persistent_save") as save,
    ):
        checkpoint_utils.torch_persistent_save({}, "async_checkpoint.pt", async_write=True)
    opena.assert_called_with("async_checkpoint.pt", "wb")
    save.assert_called_once_with({}, opena.return_value.__enter__.return_value)


def test_async_save_without_iopath_writes_the_file(tmp_path):
    path = str(tmp_path / "a.pt")
    checkpoint_utils.torch_persistent_save({"x": torch.arange(3)}, path, async_write=True)
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.arange(3))


def test_load_ema_reads_through_pathmanager_open_and_torch_load():
    ema = {"a": torch.tensor([1]), "b": torch.tensor([0.1]).half()}
    with (
        patch(f"{checkpoint_utils.__name__}.PathManager.open") as opened,
        patch(f"{checkpoint_utils.__name__}.torch.load") as load,
    ):
        load.return_value = {"extra_state": {"ema": ema}}
        state = checkpoint_utils.load_ema_from_checkpoint("ema_checkpoint.pt")
    opened.assert_called_with("ema_checkpoint.pt", "rb")
    load.assert_called_once()
    assert load.call_args.args[0] is opened.return_value.__enter__.return_value
    assert torch.equal(state["model"]["a"], ema["a"]) and state["model"]["b"].dtype == torch.float32


def test_load_ema_of_real_files(tmp_path):
    path = str(tmp_path / "ema.pt")
    checkpoint_utils.torch_persistent_save({"model": {}, "extra_state": {"ema": {"w": torch.ones(2)}}}, path)
    assert torch.equal(checkpoint_utils.load_ema_from_checkpoint(path)["model"]["w"], torch.ones(2))
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(Exception, match="is not a checkpoint"):  # the safe loader names what is wrong
        checkpoint_utils.load_ema_from_checkpoint(str(tmp_path / "bad.pt"))
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        checkpoint_utils.load_ema_from_checkpoint(str(tmp_path / "missing.pt"))


def test_load_checkpoint_to_cpu_fetches_through_get_local_path(tmp_path):
    path = str(tmp_path / "c.pt")
    checkpoint_utils.torch_persistent_save({"model": {"w": torch.ones(1)}, "cfg": {}}, path)
    with patch(f"{checkpoint_utils.__name__}.PathManager.get_local_path", return_value=path) as local:
        state = checkpoint_utils.load_checkpoint_to_cpu("remote://bucket/c.pt")
    local.assert_called_once_with("remote://bucket/c.pt")
    assert torch.equal(state["model"]["w"], torch.ones(1))


# ----------------------------------------------------------------------------- save_checkpoint(cfg, trainer, ...)


@pytest.fixture
def trainer_of(tiny_data, tmp_path, train_args):
    """upstream's train.py before its loop: task, validation data, model, criterion, Trainer."""
    metrics.reset()
    cfg = options.convert_namespace_to_config(
        options.parse_args_and_arch(
            options.get_training_parser(), train_args(tiny_data, tmp_path / "own", max_update=8)
        )
    )
    torch.manual_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("valid", combine=False, epoch=1)
    model = task.build_model(cfg.model)
    return cfg, Trainer(cfg, task, model, build_criterion(cfg.criterion, task, cfg.optimization))


def test_save_checkpoint_saves_where_and_as_the_given_options_say(trainer_of, tmp_path):
    cfg, trainer = trainer_of
    _, epoch_itr = checkpoint_utils.load_checkpoint(cfg.checkpoint, trainer)
    train_until(cfg, trainer, epoch_itr, 2)
    other = tmp_path / "other"
    options_given = OmegaConf.create(
        {"save_dir": str(other), "save_interval_updates": 2, "keep_interval_updates": 1, "no_last_checkpoints": True}
    )  # a partial config: the rest is the trainer's
    paths = checkpoint_utils.save_checkpoint(options_given, trainer, epoch_itr, 3.5)
    assert paths == [str(other / "checkpoint_1_2.pt"), str(other / "checkpoint_best.pt")]
    assert not (tmp_path / "own").exists() or not list((tmp_path / "own").glob("checkpoint*.pt"))
    saved = torch.load(other / "checkpoint_1_2.pt", weights_only=True)
    assert saved["cfg"]["checkpoint"]["save_dir"] == cfg.checkpoint.save_dir  # the trainer's config, as upstream
    assert saved["extra_state"]["best"] == 3.5 and trainer.checkpoint_manager.best == 3.5
    train_until(cfg, trainer, epoch_itr, 4)
    paths = checkpoint_utils.save_checkpoint(options_given, trainer, epoch_itr, 4.0)  # not better: no best
    assert paths == [str(other / "checkpoint_1_4.pt")]
    assert sorted(os.listdir(other)) == ["checkpoint_1_4.pt", "checkpoint_best.pt"]  # --keep-interval-updates 1
    # the trainer's own options: its save dir, checkpoint_last, the best value carried across
    paths = checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, 5.0)
    assert paths == [os.path.join(cfg.checkpoint.save_dir, "checkpoint_last.pt")]
    assert (
        checkpoint_utils.save_checkpoint(dataclasses.replace(cfg.checkpoint, no_save=True), trainer, epoch_itr, 1.0)
        == []
    )


def test_save_checkpoint_with_a_mock_trainer_and_a_partial_config():
    """The call upstream's checkpoint tests make with a MagicMock trainer and an OmegaConf subset of options."""
    cfg = OmegaConf.create(
        {
            "checkpoint": {
                "save_dir": None,
                "no_save": False,
                "save_interval_updates": 0,
                "no_last_checkpoints": False,
                "keep_interval_updates": 0,
                "keep_last_epochs": 0,
                "keep_best_checkpoints": 0,
            }
        }
    )
    trainer, epoch_itr = MagicMock(), MagicMock()
    checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)
    trainer.checkpoint_manager.with_checkpoint_config.return_value.save.assert_called_once()


# ----------------------------------------------------------------------------- fairseq-preprocess


@pytest.fixture
def pair_text(tmp_path):
    """train/valid/test in two 'languages' (upstream's tests/utils.py layout: PREFIX.in, PREFIX.out)."""
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.in").write_text("a b c\nd e a\n")
        (tmp_path / f"{split}.out").write_text("x y a\nz x\n")
    return tmp_path


def preprocessed(argv):
    args = options.get_preprocessing_parser().parse_args(argv)  # upstream's call: the parser's own parse_args
    preprocess.main(args)
    return args


def dictionary_words(path):
    return sorted(line.split()[0] for line in open(path) if not line.split()[0].startswith("madeupword"))


def test_upstreams_target_side_options_are_accepted_with_only_source(pair_text, caplog):
    dest = pair_text / "bin"
    with caplog.at_level(logging.INFO):
        preprocessed(
            [
                "--only-source",
                "--trainpref",
                str(pair_text / "train.out"),
                "--validpref",
                str(pair_text / "valid.out"),
                "--destdir",
                str(dest),
                "--thresholdtgt",
                "2",
                "--nwordstgt",
                "3",
                "--thresholdsrc",
                "0",
                "--tgtdict",
                str(pair_text / "nowhere.txt"),
                "--criterion",
                "cross_entropy",
                "--optimizer",
                "adam",
                "--lr-scheduler",
                "fixed",
            ]
        )
    assert dictionary_words(dest / "dict.txt") == ["a", "x", "y", "z"]
    assert os.path.exists(dest / "train.bin") and os.path.exists(dest / "valid.idx")
    notices = [r.getMessage() for r in caplog.records if "accepted for upstream compatibility" in r.getMessage()]
    assert notices == [
        "--thresholdtgt 2 is accepted for upstream compatibility: language-modeling data (--only-source) has no "
        "target dictionary; upstream ignores it there too",
        "--nwordstgt 3 is accepted for upstream compatibility: language-modeling data (--only-source) has no "
        "target dictionary; upstream ignores it there too",
        f"--tgtdict {pair_text / 'nowhere.txt'} is accepted for upstream compatibility: with --only-source there is "
        "no target dictionary: it is read only with --joined-dictionary (as the dictionary, when --srcdict is not "
        "given), as upstream",
    ]


def test_joined_dictionary_covers_both_languages_or_is_the_given_one(pair_text):
    preprocessed(
        [
            "--only-source",
            "-s",
            "in",
            "-t",
            "out",
            "--trainpref",
            str(pair_text / "train"),
            "--destdir",
            str(pair_text / "joined"),
            "--joined-dictionary",
        ]
    )
    assert dictionary_words(pair_text / "joined" / "dict.in.txt") == ["a", "b", "c", "d", "e", "x", "y", "z"]
    assert os.path.exists(pair_text / "joined" / "train.in-out.in.bin")  # the source side only
    preprocessed(
        [
            "--only-source",
            "-s",
            "in",
            "--trainpref",
            str(pair_text / "train"),
            "--destdir",
            str(pair_text / "given"),
            "--joined-dictionary",
            "--tgtdict",
            str(pair_text / "joined" / "dict.in.txt"),
        ]
    )
    assert dictionary_words(pair_text / "given" / "dict.in.txt") == dictionary_words(
        pair_text / "joined" / "dict.in.txt"
    )
    with pytest.raises(preprocess.PreprocessError, match="--joined-dictionary takes one dictionary"):
        preprocessed(
            [
                "--only-source",
                "--trainpref",
                str(pair_text / "train.in"),
                "--joined-dictionary",
                "--srcdict",
                "a.txt",
                "--tgtdict",
                "b.txt",
            ]
        )


@pytest.mark.parametrize("flag", ["--align-suffix", "--alignfile"])
def test_alignment_options_are_refused_in_one_line(pair_text, flag):
    with pytest.raises(
        preprocess.PreprocessError,
        match=f"^{flag} align: not supported by this fairseq: word alignments pair source and target tokens",
    ):
        preprocessed(
            [
                "--only-source",
                "--trainpref",
                str(pair_text / "train.in"),
                "--destdir",
                str(pair_text / "bin"),
                flag,
                "align",
            ]
        )
