"""Checkpoint state from Stateful parts: the manager composes upstream's layout from each part's state_dict(),
reads each value back from one place (upstream's duplicates only for files without it), and re-expresses the
data position for another world size."""

import logging

from torch.distributed.checkpoint.stateful import Stateful

from fairseq.checkpoint.manager import CheckpointManager
from fairseq.checkpoint.resume_state import iterator_state_for_world_size, saved_state
from fairseq.data.iterators import EpochBatchIterator
from fairseq.dataclass.configs import FairseqConfig
from fairseq.logging import metrics
from fairseq.training.trainer import Trainer


class TaskWithState:  # a plug-in task that keeps state of its own (the built-in tasks keep none)
    source_dictionary = None

    def state_dict(self):
        return {"curriculum_stage": 3}


class FakeTrainer:
    data_parallel_size = 2
    task = TaskWithState()
    component_names = {"criterion": "CrossEntropyCriterion", "optimizer": "AdamW"}

    def state_dict(self):
        return {"num_updates": 7, "lr_scheduler": {"best": 2.5, "lr": [0.1]}, "loss_scaler": {}, "train_time": 12.5}


class FakeIterator:
    def state_dict(self):
        return {"version": 2, "epoch": 3, "iterations_in_epoch": 4, "shuffle": True}


def test_the_parts_are_stateful():
    assert issubclass(Trainer, Stateful)
    assert issubclass(EpochBatchIterator, Stateful)
    assert isinstance(metrics, Stateful)


def test_checkpoint_is_composed_in_upstreams_layout_with_its_copies_of_the_trainer_state():
    state = CheckpointManager(FairseqConfig())._compose(FakeTrainer(), FakeIterator(), 3.0, {"train": []})
    assert list(state) == ["cfg", "criterion", "optimizer_history", "task_state", "extra_state", "vocabulary"]
    assert state["task_state"] == {"curriculum_stage": 3}  # the task's own state, given back on resume
    extra = state["extra_state"]
    assert list(extra) == [
        "train_iterator",
        "val_loss",
        "best",
        "metrics",
        "previous_training_time",
        "trainer",
        "data_parallel_size",
    ]
    assert extra["trainer"] == FakeTrainer().state_dict()
    assert extra["train_iterator"] == FakeIterator().state_dict()
    assert extra["previous_training_time"] == 12.5 and extra["data_parallel_size"] == 2
    assert extra["val_loss"] == 3.0 and extra["best"] is None and extra["metrics"] == {"train": []}
    assert state["optimizer_history"] == [
        {
            "criterion_name": "CrossEntropyCriterion",
            "optimizer_name": "AdamW",
            "lr_scheduler_state": {"best": 2.5, "lr": [0.1]},
            "num_updates": 7,
        }
    ]
    # upstream's copy is a copy: an edit of one (a tool resetting the schedule) leaves the other as it was
    assert state["optimizer_history"][0]["lr_scheduler_state"] is not extra["trainer"]["lr_scheduler"]
    assert (
        CheckpointManager(FairseqConfig())._compose(FakeTrainer(), FakeIterator(), None, None)["extra_state"]["metrics"]
        == {}
    )


def test_each_value_is_read_from_the_trainer_state_when_the_file_has_it():
    state = {
        "optimizer_history": [{"lr_scheduler_state": {"best": 9.0}, "num_updates": 99}],
        "extra_state": {
            "previous_training_time": 99.0,
            "train_iterator": {"epoch": 2},
            "metrics": {"a": []},
            "best": 1.5,
            "data_parallel_size": 4,
            "trainer": {"num_updates": 7, "lr_scheduler": {"best": 2.0}, "loss_scaler": {}, "train_time": 3.0},
        },
    }
    saved = saved_state(state)
    assert saved.trainer == {"num_updates": 7, "lr_scheduler": {"best": 2.0}, "loss_scaler": {}, "train_time": 3.0}
    assert (saved.train_iterator, saved.metrics, saved.best, saved.data_parallel_size) == (
        {"epoch": 2},
        {"a": []},
        1.5,
        4,
    )


def test_a_file_without_the_trainer_state_gives_upstreams_places():
    state = {
        "optimizer_history": [
            {"lr_scheduler_state": {"best": 1.0}, "num_updates": 2},
            {"lr_scheduler_state": {"best": 9.0}, "num_updates": 5},
        ],
        "extra_state": {"previous_training_time": 4.0},
    }
    assert saved_state(state).trainer == {"num_updates": 5, "lr_scheduler": {"best": 9.0}, "train_time": 4.0}
    # an upstream file upgraded for --trust-legacy-checkpoint keeps neither: nothing to restore
    empty = saved_state({"extra_state": {}})
    assert empty.trainer is None and empty.train_iterator is None and empty.metrics is None and empty.best is None


def test_data_position_is_re_expressed_for_another_world_size(caplog):
    position = {"version": 2, "epoch": 1, "iterations_in_epoch": 5, "shuffle": True}
    with caplog.at_level(logging.WARNING):
        assert iterator_state_for_world_size(position, 2, 2) == position
        assert iterator_state_for_world_size(position, None, 3) == position  # no world size saved: this one's
        assert not caplog.records
        assert iterator_state_for_world_size(position, 2, 1)["iterations_in_epoch"] == 10
        assert iterator_state_for_world_size(position, 2, 3)["iterations_in_epoch"] == 3
    assert position["iterations_in_epoch"] == 5  # the saved state is not changed
    first, second = caplog.records
    assert first.name == second.name == "fairseq_cli.train"  # the name fairseq-train's log always gave it
    assert first.getMessage().startswith("resuming a checkpoint saved by 2 ranks on 1: continuing after batch 10")
    assert second.getMessage().endswith("(1 batch(es) of this epoch are skipped)")


def test_streaming_data_position_is_the_same_for_every_world_size(caplog):
    position = {"version": 2, "epoch": 1, "iterations_in_epoch": 5, "shuffle": True, "streaming": {"sample": 40}}
    with caplog.at_level(logging.WARNING):
        assert iterator_state_for_world_size(position, 2, 3) == position  # a global sample index: nothing to scale
    [record] = caplog.records
    assert record.getMessage() == (
        "resuming a checkpoint saved by 2 ranks on 3: the streaming data continues its global sequence at sample 40"
    )
