"""--fp8 on CUDA (torchao): trains, checkpoints move between bf16 and float8 runs both ways (same keys), and
fully_sharded with float8 all-gather saves and resumes sharded checkpoints."""

import os
import subprocess
import sys

import pytest
import torch

from fairseq.logging.progress_bar import read_json_log

pytest.importorskip("torchao")
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
float8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU of compute capability >= 8.9",
)


def train(save_dir, *extra, nproc=1):
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
        "1020",
        "--tokens-per-sample",
        "128",
        "--batch-size",
        "8",
        "--arch",
        "transformer_lm_gpt3_small",
        "--decoder-layers",
        "2",
        "--decoder-embed-dim",
        "256",
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
        str(save_dir),
        "--bf16",
        "--log-file",
        str(save_dir / "train.log"),
        "--num-workers",
        "0",
        "--seed",
        "3",
        *extra,
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])),
        timeout=800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def losses(save_dir):
    return [float(r["loss"]) for r in read_json_log(save_dir / "train.log")]


@float8_gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_and_checkpoints_move_between_bf16_and_fp8(tmp_path, recipe):
    fp8_dir, bf16_dir = tmp_path / "fp8", tmp_path / "bf16"
    fp8_dir.mkdir(), bf16_dir.mkdir()
    out = train(fp8_dir, "--fp8", "--fp8-recipe", recipe, "--max-update", "6")
    assert "Linear layers converted" in out
    first = losses(fp8_dir)
    assert len(first) == 6 and all(loss == loss and loss < 1e3 for loss in first)
    bf16 = torch.load(fp8_dir / "checkpoint_last.pt", weights_only=True)["model"]
    # a bf16 run resumes from the float8 run's checkpoint, and a float8 run from the bf16 one's
    train(bf16_dir, "--restore-file", str(fp8_dir / "checkpoint_last.pt"), "--max-update", "9")
    assert sorted(torch.load(bf16_dir / "checkpoint_last.pt", weights_only=True)["model"]) == sorted(bf16)
    train(
        fp8_dir,
        "--fp8",
        "--fp8-recipe",
        recipe,
        "--restore-file",
        str(bf16_dir / "checkpoint_last.pt"),
        "--max-update",
        "12",
    )
    assert [int(r["num_updates"]) for r in read_json_log(fp8_dir / "train.log")][-1] == 12


@float8_gpu
def test_fp8_fully_sharded_float8_all_gather_sharded_checkpoint_resumes(tmp_path):
    flags = [
        "--fp8",
        "--fp8-fsdp-all-gather",
        "--ddp-backend",
        "fully_sharded",
        "--use-sharded-state",
        "--fsdp-forward-prefetch",
        "--fsdp-sync-free",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir(), resumed.mkdir()
    train(straight, *flags, "--max-update", "8")
    train(resumed, *flags, "--max-update", "4")
    train(resumed, *flags, "--max-update", "8")
    # float8 casts are deterministic given the same weights and scales: the resumed run continues exactly
    assert losses(resumed)[-4:] == losses(straight)[-4:]


@float8_gpu
def test_tensor_parallel_float8_compiled_on_a_one_rank_mesh_saves_and_resumes_exactly(tmp_path):
    """The 175B recipe's composition on one GPU: the tensor-parallel plan on a one-rank tp dimension
    (FAIRSEQ_TP_MESH_OF_ONE=1, the same code as TP N; NCCL takes float8, so torchao's float8 TP styles are used),
    tensorwise float8 with float8 FSDP all-gather, --compile and --checkpoint-activations: trains, saves sharded,
    and a run resumed at update 4 logs the uninterrupted run's losses exactly."""
    flags = [
        "--fp8",
        "--fp8-fsdp-all-gather",
        "--ddp-backend",
        "fully_sharded",
        "--use-sharded-state",
        "--compile",
        "--checkpoint-activations",
        "--criterion",
        "vocab_parallel_cross_entropy",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir(), resumed.mkdir()
    os.environ["FAIRSEQ_TP_MESH_OF_ONE"] = "1"
    try:
        out = train(straight, *flags, "--max-update", "8")
        train(resumed, *flags, "--max-update", "4")
        train(resumed, *flags, "--max-update", "8")
    finally:
        del os.environ["FAIRSEQ_TP_MESH_OF_ONE"]
    assert "tensor parallelism over 1 ranks" in out and "modules all-gather their input in float8" in out
    assert (resumed / "checkpoint_last").is_dir()
    assert losses(resumed)[-4:] == losses(straight)[-4:]
