"""Preemption under (simulated) SLURM when `scontrol requeue` fails: checkpoint_last is saved, every rank
exits with EXIT_REQUEUE_FAILED (rank 0 decides and tells the others), and one error line says to resubmit."""

import pytest

from fairseq.training.preemption import EXIT_REQUEUE_FAILED
from test_preemption_distributed import preemption_args, signal_after_update, start_slurm_ranks  # noqa: F401 (a fixture)
from test_train_distributed import _free_port

pytestmark = pytest.mark.timeout(600)


def test_every_rank_exits_4_when_scontrol_requeue_fails(tiny_data, tmp_path, preemption_args):  # noqa: F811
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    scontrol = fake_bin / "scontrol"
    scontrol.write_text(
        '#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\necho "Requested operation is presently disabled" >&2\nexit 1\n'
    )
    scontrol.chmod(0o755)
    scontrol_log = tmp_path / "scontrol.log"
    save_dir = tmp_path / "ck"
    save_dir.mkdir()
    procs = start_slurm_ranks(preemption_args(tiny_data, save_dir, 400), _free_port(), fake_bin, scontrol_log)
    try:
        signal_after_update(procs, save_dir / "train.log", 2)
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [EXIT_REQUEUE_FAILED] * 2, outs
    assert scontrol_log.read_text() == "requeue 4242\n"  # rank 0 only, once
    assert (save_dir / "checkpoint_last.pt").exists()
    errors = [[line for line in out.splitlines() if "error:" in line] for out in outs]
    expected = (
        "fairseq-train: error: checkpoint_last was saved, but the SLURM job 4242 could not be requeued "
        "(scontrol requeue failed; see the log above): resubmit the job, it resumes from checkpoint_last"
    )
    assert errors == [[expected], []], outs  # the first process says it; the other only exits with the status
    assert "Requested operation is presently disabled" in outs[0]  # the log line says why
    assert "Traceback" not in outs[0] + outs[1]
