"""The GPUs the planner knows: memory, the training throughput one reaches, and the bandwidth of the links between
GPUs (inside a node and across nodes). Every figure the time estimates assume is here, with where it comes from;
`--achieved-tflops`, `--intra-node-gbps` and `--inter-node-gbps` override them for another machine.
"""

from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class Hardware:
    memory_gib: float  # the device's total as PyTorch reports it (what the training log's *_gb fields count)
    # Model FLOPs per second per GPU that bf16 training reaches (6N + 12·L·d·T per token, the definition of
    # fairseq/logging/throughput.py, plus the recomputed forward with checkpointing), communication excluded.
    achieved_tflops: float
    intra_node_gbps: float  # per-GPU bus bandwidth of NCCL's ring collectives inside a node (1e9 bytes/s)
    inter_node_gbps: float  # the same across nodes
    float8: bool  # float8 matmuls (compute capability >= 8.9)


# A100 (NVLink 3, one 200 Gb/s HDR NIC per GPU): NCCL reaches about 230 GB/s bus bandwidth on 8 x A100 for large
# all-reduces, 150 leaves room for the smaller per-layer messages; the NIC's 25 GB/s line rate gives about 22
# achieved. 147 TFLOP/s is what OPT-175B reported per A100 (Zhang et al., 2022), communication included.
_A100 = dict(achieved_tflops=147.0, intra_node_gbps=150.0, inter_node_gbps=22.0, float8=False)
# H100 / H200 (HGX: NVLink 4 at 450 GB/s per direction per GPU, one 400 Gb/s NDR NIC per GPU). Not measured here
# (no multi-GPU machine was lent): NCCL's all-gather and reduce-scatter reach about 350 GB/s bus bandwidth inside
# an 8-GPU node for large messages (300 assumed for per-layer sizes), and about 40 of the NIC's 50 GB/s across
# nodes. 541 TFLOP/s: the plain bf16 FSDP2 loop at 12 x 6144, batch 5 x 2048, on one H200 ran at 54.7% of 989
# TFLOP/s (docs/benchmarks_h200.md, run (I), 2026-12-03); the H100 has the same tensor cores (its smaller memory
# bandwidth is not modeled).
_HOPPER = dict(achieved_tflops=541.0, intra_node_gbps=300.0, inter_node_gbps=40.0, float8=True)

GPUS: Dict[str, Hardware] = {
    "a100-40gb": Hardware(memory_gib=39.4, **_A100),
    "a100-80gb": Hardware(memory_gib=79.3, **_A100),  # 79.3: the seed log's A100 figure
    "h100": Hardware(memory_gib=79.1, **_HOPPER),  # typical torch.cuda total_memory
    "h200": Hardware(memory_gib=139.8, **_HOPPER),  # sold as 141 GB
}
# Without --gpu: an 80 GiB card with the A100's throughput and links (what the planner assumed before it knew
# GPUs); --fp8 is not refused on it (the card is not known).
DEFAULT = Hardware(memory_gib=80.0, **dict(_A100, float8=True))
