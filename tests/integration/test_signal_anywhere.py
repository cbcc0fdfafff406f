"""SIGTERM/SIGUSR1 are honoured anywhere in the training loop, not only after an update: during a long
validation pass and between epochs. The run saves checkpoint_last, exits with the requeue status (3), and
the restarted command continues exactly as an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_train_cli import load
from tests.train_fixtures import train_in_process, write_plugin

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# With SIGNAL_TEST_DIR set: every validation batch is slow and leaves a mark (one file per process), and
# loading epoch 2's training data sends this process a SIGTERM (as if SLURM's signal came then).
# Without it, both behave as cross_entropy and language_modeling.
PLUGIN = """
import os
import signal
import time

from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.registry import register_criterion, register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

MARKS = os.environ.get("SIGNAL_TEST_DIR")


@register_criterion("slow_valid_ce", dataclass=CrossEntropyCriterionConfig)
class SlowValidCE(CrossEntropyCriterion):
    def forward(self, model, sample, reduce=True):
        if MARKS and not model.training:
            with open(os.path.join(MARKS, f"valid_batches.{os.getpid()}"), "a") as f:
                f.write("x")
            time.sleep(0.25)
        return super().forward(model, sample, reduce)


@register_task("lm_signal_at_epoch_2", dataclass=LanguageModelingConfig)
class SignalAtEpoch2(LanguageModelingTask):
    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        dataset = super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        if MARKS and split == "train" and epoch == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return dataset
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """One directory for the module: the runs in this process (the restarts and the uninterrupted runs, where
    the plug-in acts as cross_entropy and language_modeling) import the one plug-in."""
    return write_plugin(tmp_path_factory.mktemp("plugins") / "signal_plugin", PLUGIN)


def start(argv, marks=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not a SLURM job: no requeue
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    if marks is not None:
        env["SIGNAL_TEST_DIR"] = str(marks)
    return subprocess.Popen(
        [sys.executable, "-m", "fairseq_cli.train", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def train_here(argv):
    """fairseq-train in this process (no signal comes: nothing needs a process of its own); (status, log)."""
    status, out, err = train_in_process(argv)
    return status, out + err


def finish(proc, timeout=300):
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"fairseq-train did not stop within {timeout} s:\n{proc.communicate()[0][-3000:]}")
    return proc.returncode, out


def valid_batch_counts(marks):
    return sorted(len((marks / name).read_text()) for name in os.listdir(marks) if name.startswith("valid_batches."))


def signal_once_validating(proc, marks, sig=signal.SIGTERM, timeout=240):
    deadline = time.time() + timeout
    while not valid_batch_counts(marks):
        if proc.poll() is not None or time.time() > deadline:
            pytest.fail(f"validation never started:\n{finish(proc)[1][-3000:]}")
        time.sleep(0.02)
    proc.send_signal(sig)
    return time.time()


def assert_same_weights(a, b):
    a, b = load(a)["model"], load(b)["model"]
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_sigterm_during_validation_stops_at_once_and_resumes_exactly(tiny_data, tmp_path, plugin, train_args):
    # Validation at update 3: 20 batches of one block, 0.25 s each with the marks on (5 s in all).
    def argv(save_dir):
        return train_args(
            tiny_data,
            save_dir,
            "--user-dir",
            str(plugin),
            "--criterion",
            "slow_valid_ce",
            "--validate-interval-updates",
            "3",
            "--max-tokens-valid",
            "32",
            max_update=6,
        )

    marks = tmp_path / "marks"
    marks.mkdir()
    run = tmp_path / "interrupted"
    proc = start(argv(run), marks)
    signalled = signal_once_validating(proc, marks)
    rc, out = finish(proc)
    assert rc == 3, out[-3000:]  # EXIT_REQUEUED
    assert time.time() - signalled < 60
    [done] = valid_batch_counts(marks)
    assert done <= 3, f"validation went on for {done} of 20 batches after the signal"  # before the fix: 20
    assert "stopping validation on 'valid' after" in out
    state = load(run / "checkpoint_last.pt")["extra_state"]
    assert state["trainer"]["num_updates"] == 3
    assert state["train_iterator"]["epoch"] == 1 and state["train_iterator"]["iterations_in_epoch"] == 3

    rc, out = train_here(argv(run))  # the requeued job: the same command
    assert rc == 0, out[-3000:]
    assert "(3 updates)" in out  # resumed from the saved update
    assert load(run / "checkpoint_last.pt")["extra_state"]["trainer"]["num_updates"] == 6

    straight = tmp_path / "straight"
    rc, out = train_here(argv(straight))
    assert rc == 0, out[-3000:]
    assert_same_weights(run / "checkpoint_last.pt", straight / "checkpoint_last.pt")


def test_sigterm_between_epochs_stops_before_the_next_update(tiny_data, tmp_path, plugin, train_args):
    def argv(save_dir):
        args = train_args(tiny_data, save_dir, "--user-dir", str(plugin), "--max-epoch", "2", max_update=0)
        args[args.index("language_modeling")] = "lm_signal_at_epoch_2"
        args[args.index("--max-tokens") + 1] = "1024"  # 7 updates per epoch
        return args

    marks = tmp_path / "marks"
    marks.mkdir()
    run = tmp_path / "interrupted"
    rc, out = finish(start(argv(run), marks))
    assert rc == 3, out[-3000:]
    state = load(run / "checkpoint_last.pt")["extra_state"]
    assert state["trainer"]["num_updates"] == 7  # before the fix: 8 (one update of epoch 2 ran first)
    assert state["train_iterator"]["epoch"] == 2 and state["train_iterator"]["iterations_in_epoch"] == 0

    rc, out = train_here(argv(run))
    assert rc == 0, out[-3000:]
    assert "(7 updates)" in out
    assert load(run / "checkpoint_last.pt")["extra_state"]["trainer"]["num_updates"] == 14

    straight = tmp_path / "straight"
    rc, out = train_here(argv(straight))
    assert rc == 0, out[-3000:]
    assert_same_weights(run / "checkpoint_last.pt", straight / "checkpoint_last.pt")


def test_two_ranks_stop_at_the_same_validation_batch(tiny_data, tmp_path, plugin, train_args):
    """The signal reaches the launcher, which forwards it to both ranks; they agree through the watcher's
    all-reduce at validation-batch boundaries and stop after the same batch."""
    marks = tmp_path / "marks"
    marks.mkdir()
    run = tmp_path / "ck"
    argv = train_args(
        tiny_data,
        run,
        "--user-dir",
        str(plugin),
        "--criterion",
        "slow_valid_ce",
        "--validate-interval-updates",
        "2",
        "--max-tokens-valid",
        "32",
        "--distributed-world-size",
        "2",
        "--heartbeat-timeout",
        "120",
        max_update=6,
    )
    proc = start(argv, marks)
    signal_once_validating(proc, marks, sig=signal.SIGUSR1)
    rc, out = finish(proc)
    assert rc == 3, out[-3000:]
    counts = valid_batch_counts(marks)
    assert len(counts) == 2 and counts[0] == counts[1], counts  # 10 validation batches per rank
    assert counts[0] <= 4, counts
    state = load(run / "checkpoint_last.pt")["extra_state"]
    assert state["trainer"]["num_updates"] == 2
