"""fairseq-train on CUDA: fp16 overflow skipping, bf16/fp16 fully_sharded with both FSDP flags (save, resume)."""

import os
import subprocess
import sys

import pytest
import torch

from fairseq.logging.progress_bar import read_json_log

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(tmp_path, *extra, nproc=1):
    cmd = [sys.executable, "-m", "fairseq_cli.train"]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            "-m",
            "fairseq_cli.train",
        ]
    cmd += [
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
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--disable-validation",
        "--save-dir",
        str(tmp_path),
        "--log-file",
        str(tmp_path / "train.log"),
        "--num-workers",
        "0",
        *extra,
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])),
        timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_fp16_overflow_is_skipped_and_scale_halves(tmp_path, faulty_criterion):
    plugin = faulty_criterion("inf_plugin", "inf_on_third_call", call=3, factor="inf")  # the loss only, not the log
    proc = train(
        tmp_path,
        "--fp16",
        "--fp16-init-scale",
        "128",
        "--user-dir",
        str(plugin),
        "--criterion",
        "inf_on_third_call",
        "--max-update",
        "4",
    )
    assert "gradient overflow detected, ignoring gradient, setting loss scale to: 64" in proc.stdout + proc.stderr
    log = read_json_log(tmp_path / "train.log")
    assert [r["num_updates"] for r in log] == ["1", "2", "3", "4"]  # 5 steps ran, the overflowing one skipped
    assert [float(r["loss_scale"]) for r in log][-1] == 64.0
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert state["extra_state"]["trainer"]["loss_scaler"]["loss_scale"] == 64.0


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_fully_sharded_both_flags_saves_and_resumes(tmp_path, precision):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    flags = [
        precision,
        "--ddp-backend",
        "fully_sharded",
        "--fsdp-forward-prefetch",
        "--fsdp-sync-free",
        "--use-sharded-state",
        "--checkpoint-activations",
    ]
    train(tmp_path / "straight", *flags, "--max-update", "8", nproc=2)
    train(tmp_path / "resumed", *flags, "--max-update", "4", nproc=2)
    assert (tmp_path / "resumed" / "checkpoint_last").is_dir()
    train(tmp_path / "resumed", *flags, "--max-update", "8", nproc=2)
    straight = {r["num_updates"]: r["loss"] for r in read_json_log(tmp_path / "straight" / "train.log")}
    resumed = {r["num_updates"]: r["loss"] for r in read_json_log(tmp_path / "resumed" / "train.log")}
    assert straight == resumed  # same kernels, same order: bitwise-equal losses on the same GPUs
    log = read_json_log(tmp_path / "straight" / "train.log")
    assert all("max_cuda_gb_reserved" in r and "cuda_gb_free" in r and "gb_free" in r for r in log)
    assert all(float(r["max_cuda_gb_allocated"]) <= float(r["max_cuda_gb_reserved"]) for r in log)


def test_cpu_offload_clips_like_the_gpu(tmp_path):
    """--cpu-offload with clipping: the norm is computed on the GPU and the clip factor reaches the CPU's fused
    AdamW as its grad_scale (a blocking copy: the CPU kernel reads it at once). Forward and backward are the same
    GPU kernels either way; only the optimizer's fp32 arithmetic runs elsewhere (CPU against CUDA fused AdamW, an
    fp32 rounding apart per step), so the logged losses and norms (3 decimals) agree to 2e-3. Adam's eps of 1e-3
    makes the update follow the clipped gradients' size (with torch's 1e-8 Adam would ignore the factor): on the
    CPU these flags without clipping log loss 9.869 at update 2 against 10.494 with it."""
    flags = [
        "--bf16",
        "--ddp-backend",
        "fully_sharded",
        "--clip-norm",
        "0.05",
        "--lr",
        "1e-2",
        "--adam-eps",
        "1e-3",
        "--max-update",
        "6",
        "--seed",
        "3",
        "--no-save",
    ]
    train(tmp_path / "gpu", *flags)
    train(tmp_path / "offload", *flags, "--cpu-offload")
    gpu, offload = (read_json_log(tmp_path / run / "train.log") for run in ("gpu", "offload"))
    assert [r["num_updates"] for r in offload] == [str(i) for i in range(1, 7)]
    assert all(float(r["clip"]) == 100.0 for r in gpu)  # the factor is below 1 in every update
    for a, b in zip(gpu, offload):
        for key in ("loss", "gnorm"):
            assert float(b[key]) == pytest.approx(float(a[key]), abs=2e-3), (key, a, b)
