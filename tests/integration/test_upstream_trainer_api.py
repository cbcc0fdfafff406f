"""Upstream's programmatic training loop (checkpoint_utils.load_checkpoint / save_checkpoint over the Trainer's
upstream methods) on a real tiny training, and its checkpoints against fairseq-train's (CPU, exact)."""

import dataclasses
import pathlib

import pytest
import torch

from fairseq import checkpoint_utils, options, tasks
from fairseq.criterions import build_criterion
from fairseq.data.iterators import GroupedIterator
from fairseq.logging import metrics
from fairseq.logging.progress_bar import read_json_log
from fairseq.trainer import Trainer  # upstream's name: the core Trainer with upstream's methods
from fairseq_cli import train
from tests.train_fixtures import assert_same_model_and_optimizer, train_until


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def config(argv):
    parser = options.get_training_parser()
    return options.convert_namespace_to_config(options.parse_args_and_arch(parser, argv))


def build_trainer(cfg):
    """What upstream's train.py does before its loop: task, validation data, model, criterion, Trainer (the
    seed first, as fairseq-train sets it, so that the initial weights are the same)."""
    metrics.reset()
    torch.manual_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    for subset in cfg.dataset.valid_subset.split(","):
        task.load_dataset(subset, combine=False, epoch=1)
    model = task.build_model(cfg.model)
    return Trainer(cfg, task, model, build_criterion(cfg.criterion, task, cfg.optimization))


def assert_same_training_state(a, b):
    assert_same_model_and_optimizer(a, b)
    assert a["extra_state"]["trainer"]["num_updates"] == b["extra_state"]["trainer"]["num_updates"]
    assert a["extra_state"]["trainer"]["lr_scheduler"] == b["extra_state"]["trainer"]["lr_scheduler"]
    assert a["extra_state"]["train_iterator"] == b["extra_state"]["train_iterator"]


def model_weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_upstream_loop_resumes_in_a_fresh_trainer_and_under_fairseq_train(tiny_data, tmp_path, train_args):
    straight = tmp_path / "straight"
    train.cli_main(train_args(tiny_data, straight, max_update=8))

    loop = tmp_path / "loop"
    cfg = config(train_args(tiny_data, loop, max_update=8))
    trainer = build_trainer(cfg)
    extra_state, epoch_itr = checkpoint_utils.load_checkpoint(cfg.checkpoint, trainer)
    assert extra_state is None and (epoch_itr.epoch, epoch_itr.iterations_in_epoch) == (1, 0)  # first launch
    itr = train_until(cfg, trainer, epoch_itr, 4)
    assert itr.has_next()  # stopped mid-epoch
    paths = checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)
    assert paths == [str(loop / "checkpoint_last.pt")]
    next_batch = next(itr)

    # A fresh Trainer continues at the same update, weights, learning rate and data position.
    again = build_trainer(cfg)
    extra_state, resumed_itr = checkpoint_utils.load_checkpoint(cfg.checkpoint, again)
    assert extra_state["train_iterator"] == {"version": 2, "epoch": 1, "iterations_in_epoch": 4, "shuffle": True}
    assert again.get_num_updates() == 4 and again.get_lr() == trainer.get_lr()
    assert (resumed_itr.epoch, resumed_itr.iterations_in_epoch) == (1, 4)
    weights, resumed_weights = model_weights(trainer), model_weights(again)
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)
    resumed_batch = next(GroupedIterator(resumed_itr.next_epoch_itr(shuffle=True), 1))
    assert torch.equal(resumed_batch[0]["id"], next_batch[0]["id"])

    # fairseq-train resumes the loop's checkpoint bitwise: the same state as the straight run at update 8.
    train.cli_main(train_args(tiny_data, loop, max_update=8))
    straight_state, loop_state = load(straight / "checkpoint_last.pt"), load(loop / "checkpoint_last.pt")
    assert_same_training_state(straight_state, loop_state)
    # it continued the loop's training (a run from scratch would end in the same state): updates 5 to 8 only,
    # with the straight run's losses
    losses = [(r["num_updates"], r["loss"]) for r in read_json_log(loop / "train.log")]
    assert losses == [(r["num_updates"], r["loss"]) for r in read_json_log(straight / "train.log")][4:]
    assert [u for u, _ in losses] == ["5", "6", "7", "8"]

    # ... and the upstream loop resumes fairseq-train's checkpoint at its update and data position.
    cfg_straight = config(train_args(tiny_data, straight, max_update=8))
    trainer = build_trainer(cfg_straight)
    extra_state, epoch_itr = checkpoint_utils.load_checkpoint(cfg_straight.checkpoint, trainer)
    assert trainer.get_num_updates() == 8
    assert epoch_itr.state_dict() == straight_state["extra_state"]["train_iterator"]
    assert extra_state["best"] == straight_state["extra_state"]["best"] == trainer.checkpoint_manager.best


def test_finetune_from_model_on_first_launch_resets_all_but_the_weights(
    tiny_lm_checkpoint, tiny_data, tmp_path, train_args
):
    cfg = config(train_args(tiny_data, tmp_path, "--finetune-from-model", str(tiny_lm_checkpoint), max_update=8))
    trainer = build_trainer(cfg)
    extra_state, epoch_itr = checkpoint_utils.load_checkpoint(cfg.checkpoint, trainer)
    pretrained = load(tiny_lm_checkpoint)
    assert extra_state["trainer"]["num_updates"] == 8  # the file's state, as upstream returns it
    assert trainer.get_num_updates() == 0 and trainer.checkpoint_manager.best is None
    assert (epoch_itr.epoch, epoch_itr.iterations_in_epoch) == (1, 0)
    weights = model_weights(trainer)
    assert all(torch.equal(weights[k], pretrained["model"][k]) for k in pretrained["model"])
    assert not trainer.optimizer.state  # a new optimizer


@pytest.fixture
def tiny_trainer(tiny_data, tmp_path, train_args):
    cfg = config(train_args(tiny_data, tmp_path, max_update=8))
    return cfg, build_trainer(cfg)


@pytest.mark.parametrize("flag", ["reset_optimizer", "reset_lr_scheduler", "reset_meters", "reset_dataloader"])
def test_finetune_from_model_with_a_reset_flag_is_refused(tiny_trainer, tmp_path, flag):
    cfg, trainer = tiny_trainer
    options = dataclasses.replace(cfg.checkpoint, finetune_from_model=str(tmp_path / "pretrained.pt"), **{flag: True})
    with pytest.raises(
        ValueError,
        match="--finetune-from-model can not be set together with either "
        "--reset-optimizer or reset_lr_scheduler or reset_meters or "
        "reset_dataloader: fine-tuning resets them all",
    ):
        checkpoint_utils.load_checkpoint(options, trainer)


def test_missing_restore_file_and_finetune_model_are_errors(tiny_trainer, tmp_path):
    cfg, trainer = tiny_trainer
    missing = dataclasses.replace(cfg.checkpoint, restore_file=str(tmp_path / "nope.pt"))
    with pytest.raises(FileNotFoundError, match=r"--restore-file .*nope.pt: no such checkpoint"):
        checkpoint_utils.load_checkpoint(missing, trainer)
    both = dataclasses.replace(missing, finetune_from_model=str(tmp_path / "pretrained.pt"))
    with pytest.raises(
        ValueError,
        match=r"--finetune-from-model and --restore-file \(non-default value\) can not "
        r"be specified together .*: drop one",
    ):
        checkpoint_utils.load_checkpoint(both, trainer)
    no_model = dataclasses.replace(cfg.checkpoint, finetune_from_model=str(tmp_path / "pretrained.pt"))
    with pytest.raises(FileNotFoundError, match=r"--finetune-from-model .*pretrained.pt: no such checkpoint"):
        checkpoint_utils.load_checkpoint(no_model, trainer)
    # a directory that exists but is no checkpoint (the pretraining run's save dir, say): an error, not a
    # silent start from scratch
    (tmp_path / "pretrain").mkdir()
    not_a_checkpoint = dataclasses.replace(cfg.checkpoint, finetune_from_model=str(tmp_path / "pretrain"))
    with pytest.raises(FileNotFoundError, match=r"--finetune-from-model .*pretrain: no such checkpoint"):
        checkpoint_utils.load_checkpoint(not_a_checkpoint, trainer)
    assert trainer.get_num_updates() == 0  # nothing was loaded


def test_a_sharded_checkpoint_last_is_resumed_not_fine_tuned_again(tiny_lm_checkpoint, tiny_trainer, tmp_path, caplog):
    """Second launch with --finetune-from-model: checkpoint_last is a sharded directory (--use-sharded-state),
    so this is not a first launch and the pretrained weights must not be loaded again over it."""
    cfg, trainer = tiny_trainer
    (tmp_path / "checkpoint_last").mkdir()
    (tmp_path / "checkpoint_last" / "metadata.pt").write_bytes(b"")  # it exists: that is what is decided here
    options = dataclasses.replace(cfg.checkpoint, save_dir=str(tmp_path), finetune_from_model=str(tiny_lm_checkpoint))
    with caplog.at_level("INFO"), pytest.raises(Exception):  # resuming it fails: its metadata is empty here
        checkpoint_utils.load_checkpoint(options, trainer)
    assert f"loading checkpoint {tmp_path / 'checkpoint_last'}" in caplog.text
    assert "pretrained" not in caplog.text and trainer.get_num_updates() == 0


def test_save_checkpoint_follows_the_checkpoint_options_it_is_given(tiny_trainer):
    """As upstream, the cfg passed decides (here --no-save: nothing written); tests/unit/test_upstream_lm_api.py
    has other save dirs, names and retention."""
    cfg, trainer = tiny_trainer
    _, epoch_itr = checkpoint_utils.load_checkpoint(cfg.checkpoint, trainer)
    assert (
        checkpoint_utils.save_checkpoint(dataclasses.replace(cfg.checkpoint, no_save=True), trainer, epoch_itr, None)
        == []
    )
    assert not list(pathlib.Path(cfg.checkpoint.save_dir).glob("checkpoint*.pt"))
