"""fairseq-train --profile-updates / --profile-dir (fairseq.logging.profiler) on the CPU, through the real CLI, and
the profiler's own arithmetic."""

import json
import os
import sys

import pytest

from fairseq.logging.profiler import _union_length, kernel_category, parse_update_range
from tests.train_fixtures import train_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dummy_train_argv(save_dir, *extra, max_update=4):
    return [
        "--task",
        "dummy_lm",
        "--dict-size",
        "60",
        "--tokens-per-sample",
        "16",
        "--batch-size",
        "2",
        "--arch",
        "transformer_lm",
        "--decoder-layers",
        "1",
        "--decoder-embed-dim",
        "16",
        "--decoder-ffn-embed-dim",
        "32",
        "--decoder-attention-heads",
        "2",
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--max-update",
        str(max_update),
        "--disable-validation",
        "--cpu",
        "--num-workers",
        "0",
        "--seed",
        "1",
        "--save-dir",
        str(save_dir),
        "--no-save",
        "--log-interval",
        "1",
        *extra,
    ]


def run_train(argv):
    from fairseq_cli import train

    train.cli_main(argv)


def test_update_range_parsing():
    assert parse_update_range("10:12") == (10, 12)
    assert parse_update_range("7") == (7, 7)
    for bad in ("0:3", "5:4", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError, match="--profile-updates"):
            parse_update_range(bad)


def test_busy_time_counts_overlapping_kernels_once():
    # [0,10) and [5,12) overlap by 5; [20,25) stands alone: 12 + 5
    assert _union_length([(5, 12), (0, 10), (20, 25)]) == 17
    assert _union_length([]) == 0
    assert _union_length([(0, 4), (4, 6)]) == 6  # touching intervals: one busy stretch


def test_kernel_categories():
    assert kernel_category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT") == "matmul"
    assert kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert kernel_category("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert (
        kernel_category("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>")
        == "optimizer"
    )
    assert kernel_category("Memcpy DtoD (Device -> Device)") == "copy"
    assert kernel_category("triton_poi_fused_gelu_view_2") == "triton (compiled)"
    assert (
        kernel_category("void at::native::vectorized_elementwise_kernel<8, GeluCUDAKernelImpl>")
        == "elementwise/reduction"
    )


def test_profile_updates_writes_trace_and_summary(tmp_path):
    out = tmp_path / "prof"
    run_train(dummy_train_argv(tmp_path / "ckpt", "--profile-updates", "2:3", "--profile-dir", str(out)))
    with open(out / "summary_rank0.json") as f:
        summary = json.load(f)
    assert summary["updates"] == 2
    assert summary["wall_ms"] > 0
    assert summary["gpu_idle_ms"] is None  # CPU run: no device timeline
    names = [op["name"] for op in summary["top_host_ops"]]
    assert "aten::mm" in names or "aten::addmm" in names  # the model's matmuls were recorded
    with open(out / "trace_rank0.json") as f:
        trace = json.load(f)
    spans = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("update ")}
    assert spans == {"update 2", "update 3"}  # exactly the requested updates, 1-based
    text = (out / "summary_rank0.txt").read_text()
    assert "per update, mean of 2" in text


def test_training_that_ends_inside_the_range_writes_what_it_recorded(tmp_path):
    run_train(dummy_train_argv(tmp_path / "ckpt", "--profile-updates", "3:10", max_update=4))
    # --profile-dir defaults to SAVE_DIR/profile
    with open(tmp_path / "ckpt" / "profile" / "summary_rank0.json") as f:
        assert json.load(f)["updates"] == 2  # updates 3 and 4


def test_bad_profile_range_is_a_one_line_cli_error(tmp_path):
    status, _, stderr = train_in_process(dummy_train_argv(tmp_path, "--profile-updates", "4:2"))
    assert status == 2
    assert "--profile-updates '4:2'" in stderr
    assert "Traceback" not in stderr


def test_benchmark_refuses_profile_with_a_short_warm_up_and_unknown_combos():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import benchmark_fsdp
    finally:
        sys.path.pop(0)
    with pytest.raises(SystemExit) as e:
        benchmark_fsdp.main(["--cpu", "--profile", "--log-interval", "2"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        benchmark_fsdp.main(["--cpu", "--combos", "none,fastest"])
    assert e.value.code == 2
