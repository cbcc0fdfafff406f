"""The benchmark and plotting scripts run end to end (on CPU with gloo and tiny dimensions)."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_benchmark_fsdp_prints_a_table_for_fairseq_and_the_plain_loop(tmp_path):
    out = tmp_path / "bench"
    # Run from a directory holding someone's checkpoints/: the benchmark's runs must not resume from them.
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "checkpoint_last.pt").write_bytes(b"another run's checkpoint")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "benchmark_fsdp.py"),
            "--cpu",
            "--nproc",
            "2",
            "--layers",
            "2",
            "--embed-dim",
            "32",
            "--heads",
            "2",
            "--seq",
            "32",
            "--batch",
            "2",
            "--vocab",
            "200",
            "--log-interval",
            "2",
            "--intervals",
            "1",
            "--num-workers",
            "0",
            "--combos",
            "both",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=dict(os.environ, PYTHONPATH=ROOT),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| plain FSDP2 loop | " in proc.stdout
    assert "| fairseq-train forward-prefetch sync-free | " in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in results] == ["plain FSDP2 loop", "fairseq-train forward-prefetch sync-free"]
    assert all(r["tokens_per_s_per_gpu"] > 0 for r in results)
    # each run's own output is kept beside the table (where TORCH_LOGS=recompiles,graph_breaks lands)
    assert (out / "plain_FSDP2_loop.output").exists()
    assert (out / "fairseq_train_forward_prefetch_sync_free.output").exists()


def script_module(name):
    """scripts/NAME.py imported as a module (its directory on sys.path while it imports, as when run as a
    script), for its main in this process: the tests below are about what the scripts print, not their process."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_benchmark_kernels_says_it_needs_cuda():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "benchmark_kernels.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert proc.returncode == 1
    assert "no CUDA device is visible" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_find_host_syncs_says_it_needs_cuda_and_checks_its_range(capsys):
    find_host_syncs = script_module("find_host_syncs")
    assert find_host_syncs.main(["--updates", "3:5", "--", "--task", "dummy_lm"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        find_host_syncs.main(["--updates", "5:3"])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--updates '5:3': expected START:END" in stderr, stderr


def test_find_host_syncs_report_says_when_no_watched_update_ran():
    recorder = script_module("find_host_syncs").SyncRecorder()
    assert "none of them ran" in recorder.report("3:5")  # not "no synchronizing CUDA operation"
    recorder.watched_steps = 3
    assert recorder.report("3:5") == "updates 3:5: no synchronizing CUDA operation\n"
    recorder.stacks["fairseq/training/train_step.py:70 in run_update: overflow = ..."] += 3
    assert recorder.report("3:5").splitlines()[:3] == [
        "updates 3:5: 3 synchronizing CUDA operation(s) at 1 place(s)",
        "",
        "3 x, innermost call last:",
    ]


def test_plot_log_draws_a_png_from_a_json_log(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "train.log"
    lines = []
    for n in range(1, 4):
        stats = {
            "epoch": 1,
            "update": n / 10,
            "loss": str(10 - n),
            "wps": "1000",
            "num_updates": str(n),
            "max_cuda_gb_allocated": "10.0",
            "max_cuda_gb_reserved": "12.0",
            "cuda_gb_free": "128.0",
        }
        lines.append(f"2026-11-30 00:00:0{n} | INFO | train_inner | {json.dumps(stats)}\n")
    log.write_text("".join(lines))
    png = tmp_path / "out.png"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "plot_log.py"), str(log), str(png)], check=True, timeout=120
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    with pytest.raises(SystemExit) as exit_info:  # in this process: a message, status 1 on stderr
        script_module("plot_log").main([str(empty), str(png)])
    assert "no train_inner lines" in str(exit_info.value.code)


@pytest.mark.timeout(300)
def test_benchmark_host_overhead_prints_both_rows():
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "benchmark_host_overhead.py"),
            "--layers",
            "2",
            "--updates",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in proc.stdout.splitlines()
        if line.startswith("| plain loop") or line.startswith("| fairseq-train")
    }
    assert float(rows["plain loop"]) > 0
    # 8 updates, a log line every 2: the first is warm-up, three are reported
    assert len(rows["fairseq-train (per log interval)"].split(" / ")) == 3


# a 2-layer model of width 64, one timing each, on the CPU
TINY_GENERATE = [
    "--arch",
    "transformer_lm_gpt3_small",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "64",
    "--decoder-ffn-embed-dim",
    "128",
    "--decoder-attention-heads",
    "2",
    "--repeats",
    "1",
    "--uncached-samples",
    "2",
    "--device",
    "cpu",
]


def benchmark_generate_output(capsys, *argv) -> str:
    """What scripts/benchmark_generate.py prints for TINY_GENERATE + argv, run in this process."""
    benchmark_generate = script_module("benchmark_generate")
    capsys.readouterr()
    benchmark_generate.main([*TINY_GENERATE, *argv])
    return capsys.readouterr().out


def test_benchmark_generate_prints_its_tables_on_the_cpu(tmp_path, capsys):
    """scripts/benchmark_generate.py with tiny sizes, in this process: the fork's greedy, beam and sampling rows
    with their bandwidth columns, transformers' default and static-cache paths, the int8 row refused on the CPU."""
    pytest.importorskip("transformers")
    out = benchmark_generate_output(
        capsys,
        "--vocab-size",
        "500",
        "--batch-sizes",
        "1,3",
        "--prompt-len",
        "8",
        "--new-tokens",
        "6",
        "--copy-mib",
        "16",
        "--json",
        str(tmp_path / "out.json"),
    )
    lines = out.splitlines()
    fork = [line.split("|")[1:-1] for line in lines if line.startswith("| 1 |") or line.startswith("| 3 |")]
    rows = [(cells[0].strip(), cells[1].strip()) for cells in fork if len(cells) == 9]
    assert rows == [(batch, row) for batch in "13" for row in ("greedy", "greedy-compiled", "beam4", "sample")]
    assert "int8: not run (--quantize int8-weight-only is a CUDA decoding feature" in out
    assert "| batch | fork greedy tokens/s | fork greedy-compiled | transformers default | transformers static" in out
    versus = [cells for cells in fork if len(cells) == 7]
    assert [cells[0].strip() for cells in versus] == ["1", "3"]
    assert [cells[6].strip().count("/") for cells in versus] == [2, 2]  # identical rows: default, static
    assert "first call, the warm-up (compiles, graph captures, autotuning): greedy 1: " in out
    assert "transformers static cache: uncompiled" in out and "eager decode steps" in out
    prefills = [cells for cells in fork if len(cells) == 5]  # every fork row's prefill, timed apart
    assert [(cells[0].strip(), cells[1].strip()) for cells in prefills] == rows
    assert all(float(cells[2].replace(",", "")) > 0 for cells in prefills)
    results = json.loads((tmp_path / "out.json").read_text())
    assert results["skipped"].keys() == {"int8", "greedy-sdpa"} and results["copy_bytes_per_s"] > 0
    assert "greedy-sdpa: not run (the split-KV decode attention kernel runs on CUDA with Triton only" in out
    by_row = {(r["row"], r["batch"]): r for r in results["rows"]}
    assert set(by_row) == {
        (row, batch)
        for row in ("greedy", "greedy-compiled", "beam4", "sample", "default", "static")
        for batch in (1, 3)
    }
    greedy, beam = by_row["greedy", 3], by_row["beam4", 3]
    assert 0 < greedy["prefill_s"] < greedy["seconds"] and greedy["prefill_first_s"] > 0
    # the bytes a step reads: the same weights; 4 hypotheses' caches at the mean live length 8 + 6 / 2 + 1 = 12
    assert greedy["weight_bytes"] == beam["weight_bytes"] > 0
    assert greedy["kv_bytes"] == 3 * 12 * 2 * 2 * 64 * 2 and beam["kv_bytes"] == 4 * greedy["kv_bytes"]
    assert greedy["bandwidth_fraction"] == pytest.approx(greedy["gb_per_s"] * 1e9 / results["copy_bytes_per_s"])
    # one Linear's int8 paths per weight shape (q/k/v/out 64 x 64, fc1 128 x 64, fc2 64 x 128; the output projection
    # is tied to the embeddings, so not quantized) and row count
    matmuls = results["int8_matmuls"]
    assert [(tuple(r["shape"]), r["rows"]) for r in matmuls] == [
        ((64, 64), 1),
        ((64, 64), 3),
        ((64, 128), 1),
        ((64, 128), 3),
        ((128, 64), 1),
        ((128, 64), 3),
    ]
    # on the CPU: no Triton kernel (fairseq int8 is torch's CPU op), no compiled path, no launch shape timed
    assert all(
        set(r["seconds"]) == {"bf16", "fairseq int8", "_weight_int8pack_mm"} and r["tuned"] is None for r in matmuls
    )
    assert (
        "| Linear weight (out x in) | rows | bf16 us | fairseq int8 us | triton 32x128 us | triton heuristic us | "
        "inductor us | _weight_int8pack_mm us | best int8 / bf16 time | fairseq int8's launch shape (timed) |" in out
    )
    assert results["int8_launch_shapes"] == []


def test_benchmark_generate_profiles_decode_steps_on_the_cpu(capsys):
    """--profile: the profiled greedy steps' table (kernels per step: on the CPU the top-level aten ops) and the top
    kernels by time; the decode attention call table, without the kernel on the CPU."""
    lines = benchmark_generate_output(
        capsys,
        "--vocab-size",
        "200",
        "--batch-sizes",
        "1,2",
        "--prompt-len",
        "6",
        "--new-tokens",
        "5",
        "--copy-mib",
        "4",
        "--no-transformers",
        "--no-int8-matmuls",
        "--rows",
        "greedy",
        "--profile",
    ).splitlines()

    def table(header):
        """The cells of the table under `header` (after its separator line), up to the first line that is not one."""
        rows = []
        for line in lines[lines.index(header) + 2 :]:
            if not line.startswith("|"):
                break
            rows.append([cell.strip() for cell in line.split("|")[1:-1]])
        return rows

    steps = table("| row | batch | kernels per step | kernel us per step |")
    assert [row[:2] for row in steps] == [["greedy", "1"], ["greedy", "2"]]
    # a 2-layer decoder's step calls aten ops by the dozen, the same ones at every batch size
    assert float(steps[0][2]) > 20 and steps[0][2] == steps[1][2]
    top = table("| row | batch | top kernels by time | calls per step | us per step | % of kernel time |")
    assert [row[:2] for row in top] == [["greedy", "1"]] * 10 + [["greedy", "2"]] * 10
    assert all(row[2].startswith("aten::") for row in top)
    calls = table(
        "| decode attention, one layer call | batch | heads x head dim | live keys (window) | sdpa us | "
        "split-KV kernel us | kernel GB/s of live KV | kernel through a block table us |"
    )
    assert [row[1:4] for row in calls] == [["1", "2 x 32", "9 (64)"], ["2", "2 x 32", "9 (64)"]]
    assert [row[5:] for row in calls] == [["-", "-", "-"]] * 2  # no kernel on the CPU


def test_benchmark_serve_prints_a_row_per_concurrency(capsys):
    """scripts/benchmark_serve.py with a tiny random model: one row per client count, every request's tokens."""
    pytest.importorskip("uvicorn")
    rows = script_module("benchmark_serve").main(
        [
            "--cpu",
            "--concurrency",
            "1,3",
            "--requests",
            "6",
            "--new-tokens",
            "4",
            "--prompt-len",
            "8",
            "--decoder-layers",
            "1",
            "--decoder-embed-dim",
            "32",
            "--positions",
            "64",
            "--vocab-size",
            "50",
        ]
    )
    out = capsys.readouterr().out
    assert [row["clients"] for row in rows] == [1, 3] and rows[0]["tokens"] == rows[1]["tokens"] > 0
    assert sum(line.startswith("| ") for line in out.splitlines()) == 3 and "TTFT p99 s" in out
