import io
import logging
import sys
import time

import pytest
import torch

from fairseq.logging import progress_bar as pb
from fairseq.logging.meters import AverageMeter

FIXED_TIME = 1714564800.0  # 2024-05-01 12:00:00 UTC
STATS = {"loss": 9.123, "ppl": 557.74, "wps": 12345.6, "ups": 1.35, "num_updates": 2, "lr": 0.0005}


class FixedTime(logging.Filter):
    def filter(self, record):
        record.created = FIXED_TIME
        return True


@pytest.fixture
def log_lines(caplog):
    """Lines as the root logger's handlers would write them with upstream's format, at a fixed time (UTC)."""
    caplog.set_level(logging.INFO)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    formatter = pb.make_formatter()
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    handler.addFilter(FixedTime())
    root = logging.getLogger()
    root.addHandler(handler)
    yield lambda: stream.getvalue().splitlines()
    root.removeHandler(handler)


@pytest.fixture
def root_logger_restored():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(pb, "_warned", set())


class ResumedIterator:
    """An epoch iterator resumed at offset `n` (what the data iterator exposes after a restart)."""

    def __init__(self, size, n):
        self.size, self.n = size, n

    def __len__(self):
        return self.size

    def __iter__(self):
        return iter(range(self.n, self.size))


def run_and_log(bar, stats=STATS, tag="train_inner"):
    for i, _ in enumerate(bar, start=getattr(bar, "n", 0)):
        bar.log(stats, tag=tag, step=i + 1)


def test_json_interval_line_matches_upstream(log_lines):
    bar = pb.progress_bar(list(range(8)), log_format="json", log_interval=2, epoch=3)
    run_and_log(bar)
    lines = log_lines()
    assert len(lines) == 4
    assert lines[0] == (
        '2024-05-01 12:00:00 | INFO | train_inner | {"epoch": 3, "update": 2.25, "loss": "9.123", '
        '"ppl": "557.74", "wps": "12345.6", "ups": "1.35", "num_updates": "2", "lr": "0.0005"}'
    )
    assert lines[3].startswith('2024-05-01 12:00:00 | INFO | train_inner | {"epoch": 3, "update": 3.0, ')


def test_json_update_rounds_to_three_decimals_and_follows_a_resumed_iterator(log_lines):
    bar = pb.progress_bar(ResumedIterator(size=3, n=1), log_format="json", log_interval=1, epoch=1)
    run_and_log(bar, {"loss": 1.5})
    assert log_lines() == [
        '2024-05-01 12:00:00 | INFO | train_inner | {"epoch": 1, "update": 0.667, "loss": "1.5"}',
        '2024-05-01 12:00:00 | INFO | train_inner | {"epoch": 1, "update": 1.0, "loss": "1.5"}',
    ]


def test_json_print_prefixes_keys_with_the_tag(log_lines):
    bar = pb.progress_bar([], log_format="json", epoch=2, prefix="valid on 'valid' subset")
    bar.print({"loss": 8.5, "ppl": 362.04, "wps": 31234.5, "num_updates": 400, "best_loss": 8.5}, tag="valid", step=400)
    bar.print({"loss": 9.0}, tag=None)
    assert log_lines() == [
        '2024-05-01 12:00:00 | INFO | valid | {"epoch": 2, "valid_loss": "8.5", "valid_ppl": "362.04", '
        '"valid_wps": "31234.5", "valid_num_updates": "400", "valid_best_loss": "8.5"}',
        '2024-05-01 12:00:00 | INFO | fairseq.logging.progress_bar | {"epoch": 2, "loss": "9"}',
    ]


def test_log_writes_only_on_multiples_of_the_interval(log_lines):
    bar = pb.progress_bar(list(range(10)), log_format="json", log_interval=5, epoch=1)
    for i, _ in enumerate(bar):
        bar.log({"loss": 1.0}, tag="train_inner", step=i + 1)
    assert [line.split('"update": ')[1][:4] for line in log_lines()] == ["0.5,", "1.0,"]


def test_simple_format_lines(log_lines):
    bar = pb.progress_bar(list(range(1000)), log_format="simple", log_interval=100, epoch=1)
    for i, _ in enumerate(bar):
        if i + 1 == 100:
            bar.log(STATS, tag="train_inner", step=100)
            break
    valid = pb.progress_bar([], log_format="simple", epoch=1, prefix="valid on 'valid' subset")
    valid.print({"loss": 9.5, "ppl": 724.08, "num_updates": 100}, tag="valid", step=100)
    assert log_lines() == [
        "2024-05-01 12:00:00 | INFO | train_inner | epoch 001:    100 / 1000 loss=9.123, ppl=557.74, "
        "wps=12345.6, ups=1.35, num_updates=2, lr=0.0005",
        "2024-05-01 12:00:00 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 9.5 | ppl 724.08 | "
        "num_updates 100",
    ]


class _Endless:
    """An iterator as long as the streaming task's endless epoch."""

    def __len__(self):
        return pb.UNBOUNDED

    def __iter__(self):
        return iter(range(5))


def test_an_endless_epoch_is_shown_without_its_length(log_lines):
    for log_format in ("simple", "json"):
        bar = pb.progress_bar(_Endless(), log_format=log_format, log_interval=2, epoch=1)
        for i, _ in enumerate(bar):
            if i + 1 == 2:
                bar.log({"loss": 1.5}, tag="train_inner", step=2)
    assert [line.split(" | ", 3)[3] for line in log_lines()] == [
        "epoch 001:      2 loss=1.5",
        '{"epoch": 1, "loss": "1.5"}',
    ]


def test_none_format_iterates_and_prints_nothing(log_lines, capsys):
    bar = pb.progress_bar(list(range(4)), log_format="none", log_interval=1, epoch=1)
    assert list(bar) == [0, 1, 2, 3]
    bar.log(STATS, tag="train_inner", step=4)
    bar.print(STATS, tag="train", step=4)
    assert log_lines() == []
    assert capsys.readouterr() == ("", "")


class FakeTerminal(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_tqdm_falls_back_to_simple_without_a_terminal(monkeypatch, log_lines):
    monkeypatch.setattr(sys, "stderr", FakeTerminal(tty=False))
    bar = pb.progress_bar(list(range(2)), log_format=None, default_log_format="tqdm", log_interval=1, epoch=1)
    assert type(bar) is pb.SimpleProgressBar
    run_and_log(bar, {"loss": 2.0})
    assert log_lines()[0] == "2024-05-01 12:00:00 | INFO | train_inner | epoch 001:      1 / 2 loss=2"
    assert sys.stderr.getvalue() == ""


def test_tqdm_on_a_terminal_draws_a_bar_and_prints_epoch_lines(monkeypatch, log_lines):
    terminal = FakeTerminal(tty=True)
    monkeypatch.setattr(sys, "stderr", terminal)
    with pb.progress_bar(list(range(3)), log_format="tqdm", epoch=7) as bar:
        assert type(bar) is pb.TqdmProgressBar
        assert list(bar) == [0, 1, 2]
        bar.log({"loss": 3.25}, tag="train_inner", step=3)
        bar.print({"loss": 3.25}, tag="train", step=3)
    assert "epoch 007:   0%|          | 0/3" in terminal.getvalue()
    assert log_lines() == ["2024-05-01 12:00:00 | INFO | train | epoch 007 | loss 3.25"]


def test_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        pb.progress_bar([], log_format="xml")


def test_format_stat_follows_upstream():
    assert pb.format_stat(1234567.8) == "1.23457e+06"
    assert pb.format_stat(1e-07) == "1e-07"
    assert pb.format_stat(100) == "100"
    assert pb.format_stat(3.0) == "3"
    meter = AverageMeter()
    meter.update(2.0, 1)
    meter.update(3.0, 2)
    assert pb.format_stat(meter) == "2.667"
    assert pb.format_stat(torch.tensor([1.5, 2.0])) == [1.5, 2.0]


def test_setup_logging_log_file_gets_the_same_lines_once(tmp_path, root_logger_restored):
    log_file = tmp_path / "train.log"
    file_handler = pb.setup_logging(log_file=str(log_file))
    file_handler.addFilter(FixedTime())
    assert root_logger_restored.level == logging.INFO
    # every progress bar of the run is given the same --log-file: the handler must not be added twice
    for _ in range(2):
        bar = pb.progress_bar(list(range(2)), log_format="json", log_interval=2, epoch=1, log_file=str(log_file))
        run_and_log(bar, {"loss": 4.0, "num_updates": 2})
    logging.getLogger("fairseq_cli.train").info("done training")
    file_handler.flush()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(FIXED_TIME))
    line = f'{stamp} | INFO | train_inner | {{"epoch": 1, "update": 1.0, "loss": "4", "num_updates": "2"}}'
    assert log_file.read_text().splitlines() == [line, line, f"{stamp} | INFO | fairseq_cli.train | done training"]


def test_read_json_log_gives_back_the_stats_of_one_tag_in_order(tmp_path, root_logger_restored):
    """What every training test reads its log through: the lines written with --log-format json."""
    log_file = tmp_path / "train.log"
    file_handler = pb.setup_logging(log_file=str(log_file))
    bar = pb.progress_bar(list(range(2)), log_format="json", log_interval=1, epoch=1, log_file=str(log_file))
    for i, _ in enumerate(bar):
        bar.log({"loss": 4.0 - i, "num_updates": i + 1}, tag="train_inner", step=i + 1)
    bar.print({"loss": 3.5, "num_updates": 2}, tag="train", step=2)
    logging.getLogger("fairseq_cli.train").info("end of epoch 1 (average epoch stats below)")
    valid = pb.progress_bar([], log_format="json", epoch=1, prefix="valid on 'valid' subset", log_file=str(log_file))
    valid.print({"loss": 3.75, "best_loss": 3.75}, tag="valid", step=2)
    file_handler.flush()
    assert pb.read_json_log(str(log_file)) == [
        {"epoch": 1, "update": 0.5, "loss": "4", "num_updates": "1"},
        {"epoch": 1, "update": 1.0, "loss": "3", "num_updates": "2"},
    ]
    assert pb.read_json_log(log_file, "train") == [{"epoch": 1, "train_loss": "3.5", "train_num_updates": "2"}]
    assert pb.read_json_log(log_file, "valid") == [{"epoch": 1, "valid_loss": "3.75", "valid_best_loss": "3.75"}]
    assert pb.read_json_log(log_file, "test") == []


def test_tensorboard_missing_warns_once_and_keeps_logging(monkeypatch, log_lines, fresh_warnings, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    for _ in range(2):
        bar = pb.progress_bar(
            list(range(1)), log_format="json", log_interval=1, epoch=1, tensorboard_logdir="unused-dir"
        )
        run_and_log(bar, {"loss": 1.0})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["tensorboard not found: pip install tensorboard (continuing without --tensorboard-logdir)"]
    assert len([line for line in log_lines() if " | train_inner | " in line]) == 2


def test_wandb_missing_warns_once_and_keeps_logging(monkeypatch, log_lines, fresh_warnings, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)
    for _ in range(2):
        bar = pb.progress_bar(list(range(1)), log_format="simple", log_interval=1, epoch=1, wandb_project="proj")
        run_and_log(bar, {"loss": 1.0})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["wandb not found: pip install wandb (continuing without --wandb-project)"]
    assert len([line for line in log_lines() if " | train_inner | " in line]) == 2


def test_tensorboard_writes_scalars_per_tag(tmp_path, log_lines):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    bar = pb.progress_bar(list(range(4)), log_format="json", log_interval=2, epoch=1, tensorboard_logdir=str(tmp_path))
    assert type(bar) is pb.TensorboardProgressBarWrapper
    for i, _ in enumerate(bar):
        bar.log({"loss": 9.0 - i, "ppl": 512.0, "num_updates": i + 1}, tag="train_inner", step=i + 1)
    pb._close_tensorboard_writers()
    events = EventAccumulator(str(tmp_path / "train_inner"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "ppl"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0)]
    # the wrapped json bar still writes its interval lines
    assert len([line for line in log_lines() if " | train_inner | " in line]) == 2


def test_wandb_offline_run_gets_tagged_scalars(tmp_path, monkeypatch, log_lines):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    bar = pb.progress_bar(
        list(range(4)), log_format="json", log_interval=2, epoch=1, wandb_project="lm", wandb_run_name="run-a"
    )
    try:
        assert type(bar) is pb.WandBProgressBarWrapper
        run = wandb.run
        assert (run.project, run.name, run.offline) == ("lm", "run-a", True)
        for i, _ in enumerate(bar):
            if (i + 1) % 2 == 0:
                bar.log({"loss": 9.0 - i, "lr": 0.25, "num_updates": i + 1}, tag="train_inner", step=i + 1)
        # a second bar of the same process (next epoch, validation) logs into the same run
        valid = pb.progress_bar([], log_format="json", epoch=1, wandb_project="lm", wandb_run_name="run-a")
        valid.print({"loss": 7.5, "num_updates": 4}, tag="valid")
        assert wandb.run is run
        # wandb commits a step once a later step arrives: step 2 is complete, step 4 still open
        summary = dict(run.summary)
        assert summary["_step"] == 2
        assert (summary["train_inner/loss"], summary["train_inner/lr"]) == (8.0, 0.25)
        assert not any("num_updates" in key for key in summary)
    finally:
        wandb.finish()
    assert len([line for line in log_lines() if " | train_inner | " in line]) == 2
