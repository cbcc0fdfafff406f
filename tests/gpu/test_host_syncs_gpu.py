"""fairseq-train's updates never make the host wait for the GPU (scripts/find_host_syncs.py, torch's sync debug
mode) under bf16 with FSDP2 and with one process's default engine; fp16's one overflow check per update is found,
with its stack, which shows that the script does see a synchronizing call."""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def find_syncs(tmp_path, *extra):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "scripts", "find_host_syncs.py"),
        "--updates",
        "3:6",
        "--",
        "--task",
        "dummy_lm",
        "--dict-size",
        "1000",
        "--tokens-per-sample",
        "128",
        "--batch-size",
        "4",
        "--arch",
        "transformer_lm_gpt",
        "--decoder-layers",
        "2",
        "--decoder-embed-dim",
        "128",
        "--decoder-ffn-embed-dim",
        "512",
        "--decoder-attention-heads",
        "4",
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--clip-norm",
        "1.0",
        "--max-update",
        "8",
        "--log-format",
        "json",
        "--log-interval",
        "100",  # no log boundary inside the watched updates: it reads statistics on purpose
        "--disable-validation",
        "--no-save",
        "--save-dir",
        str(tmp_path),
        "--num-workers",
        "1",
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=500)


@pytest.mark.parametrize("engine", [["--ddp-backend", "fully_sharded"], []], ids=["fully_sharded", "one_process"])
def test_bf16_updates_make_no_host_sync(tmp_path, engine):
    proc = find_syncs(tmp_path, "--bf16", *engine)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "updates 3:6: no synchronizing CUDA operation" in proc.stdout


def test_fp16_overflow_check_is_found_once_per_update(tmp_path):
    proc = find_syncs(tmp_path, "--fp16")
    assert proc.returncode == 3, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = proc.stdout[proc.stdout.index("updates 3:6:") :]
    places = report.split("\n\n")[1:]
    check = [p for p in places if "overflow = not bool(torch.isfinite(grad_norm))" in p]
    assert len(check) == 1 and "fairseq/training/train_step.py" in check[0], report
    # once in each of updates 3 to 6, and once more for each of them an overflow skipped (it does not count)
    assert int(check[0].split(" x,")[0]) >= 4, report
