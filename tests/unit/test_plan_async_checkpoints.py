"""The memory planner's host memory for --write-checkpoints-asynchronously (fairseq.checkpoint.writer's
async_save_host_bytes per rank, times the ranks of a node that stage a part) and its warning against
--node-memory-gib."""

from fairseq.planning import plan_memory

BASE = [
    "--arch",
    "transformer_lm_gpt3_175",
    "--gpus",
    "1024",
    "--gpu",
    "h200",
    "--bf16",
    "--checkpoint-activations",
    "--batch-size",
    "1",
    "--tokens-per-sample",
    "2048",
    "--model-parallel-size",
    "8",
    "--write-checkpoints-asynchronously",
]


def lines(*flags):
    return [
        line
        for line in plan_memory.report(plan_memory.parse(BASE + list(flags)))
        if "asynchronous checkpoints" in line or line.startswith("WARNING")
    ]


def test_sharded_snapshots_per_node_are_the_state_over_the_ranks_times_eight():
    request = plan_memory.parse(BASE + ["--use-sharded-state"])
    params = request.shape.total_params
    per_rank = -(-params * 12 // 1024)  # fp32 weights + 2 Adam states, split over FSDP 128 x TP 8
    got = lines("--use-sharded-state", "--node-memory-gib", "2048")
    assert got == [
        f"asynchronous checkpoints (sharded: every rank its shards): {8 * per_rank / 2**30:.2f} GiB of "
        f"host memory per node ({per_rank / 2**30:.2f} GiB per rank; docs/checkpoints.md)"
    ]


def test_a_single_file_snapshot_on_rank_0_that_exceeds_the_node_is_a_warning():
    params = plan_memory.parse(BASE).shape.total_params
    whole = params * 12 / 2**30  # gathered one tensor at a time: the state once, not twice
    got = lines("--node-memory-gib", "1024")
    assert got[0] == (
        f"asynchronous checkpoints (single file: rank 0 the whole state): {whole:.2f} GiB of host "
        f"memory per node ({whole:.2f} GiB per rank; docs/checkpoints.md)"
    )
    assert got[1] == (
        "WARNING: that exceeds the node's 1024 GiB of RAM: use --use-sharded-state, more GPUs, or synchronous saves"
    )
    assert lines("--node-memory-gib", "2048") == got[:1]  # 2.1 TB fits 2048 GiB


def test_no_line_without_the_flag():
    assert not [line for line in plan_memory.report(plan_memory.parse(BASE[:-1])) if "asynchronous checkpoints" in line]
