"""The tensor-parallel code path on CUDA (issue 16).

- One GPU: the TP plan applied on a one-rank CUDA mesh (DTensor parameters, the sequence region,
  loss_parallel), under FSDP2 on the mesh's data-parallel dim, computes what plain FSDP2 computes, and the
  tokens/s of both are printed (`pytest -s`). `fairseq-train --model-parallel-size 1` does not exercise this
  path: a TP size of 1 applies no plan (the mesh then has no tp dimension), so it is the plain FSDP path.
- Two GPUs (skipped with fewer): fairseq-train with --model-parallel-size 2 against plain FSDP2 on the same
  global batch: the same losses (logged to 3 decimals), and both runs' wps printed.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from fairseq.logging.progress_bar import read_json_log

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model():
    from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config

    torch.manual_seed(0)
    cfg = preset_config("transformer_lm_gpt3_medium", decoder_layers=4, tokens_per_sample=1024)
    return TransformerLanguageModel.build(cfg, 50272, 1).cuda()


def _train(model, tokens, steps):
    from fairseq.criterions.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(tokens[:, :-1])[0]
        target = tokens[:, 1:].reshape(-1)
        loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), target, 1) / target.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    return torch.stack(losses).cpu(), steps * tokens[:, 1:].numel() / (time.perf_counter() - start)


def test_tp_plan_on_one_gpu_matches_plain_fsdp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fairseq.distributed.fsdp import transformer_layers
    from fairseq.distributed.tensor_parallel import apply_tensor_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp_shard", "tp"))
        tokens = torch.randint(2, 50272, (4, 1025), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        results = {}
        for name in ("plain", "tp1"):
            model = _model()
            if name == "tp1":
                apply_tensor_parallel(model, mesh["tp"], loss_parallel=True)
            for layer in transformer_layers(model):
                fully_shard(layer, mesh=mesh["dp_shard"])
            fully_shard(model, mesh=mesh["dp_shard"])
            _train(model, tokens, 2)  # warm-up
            results[name] = _train(model, tokens, 10)
        print(
            f"\ntokens/s on one GPU, fp32: plain FSDP2 {results['plain'][1]:,.0f}, "
            f"TP plan on a 1-rank mesh {results['tp1'][1]:,.0f} ({results['tp1'][1] / results['plain'][1]:.2f}x)"
        )
        torch.testing.assert_close(results["tp1"][0], results["plain"][0], rtol=1e-4, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_two_gpus_matches_fsdp2(tmp_path):
    common = [
        "--task",
        "dummy_lm",
        "--arch",
        "transformer_lm_gpt3_medium",
        "--decoder-layers",
        "8",
        "--tokens-per-sample",
        "1024",
        "--optimizer",
        "adam",
        "--lr",
        "1e-4",
        "--max-update",
        "20",
        "--bf16",
        "--ddp-backend",
        "fully_sharded",
        "--log-format",
        "json",
        "--log-interval",
        "5",
        "--criterion",
        "vocab_parallel_cross_entropy",
        "--disable-validation",
        "--no-save",
        "--seed",
        "1",
    ]
    wps = {}
    logs = {}
    for name, layout in (
        ("fsdp2", ["--batch-size", "4"]),
        ("tp2", ["--batch-size", "8", "--model-parallel-size", "2"]),
    ):
        log = tmp_path / f"{name}.log"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "fairseq_cli.train",
                *common,
                *layout,
                "--log-file",
                str(log),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = read_json_log(log)
        logs[name] = [float(r["loss"]) for r in rows]
        wps[name] = float(rows[-1]["wps"])
    print(
        f"\nwps on 2 GPUs, bf16, interval ending at update 20: FSDP2 {wps['fsdp2']:,.0f}, TP 2 {wps['tp2']:,.0f} "
        f"({wps['tp2'] / wps['fsdp2']:.2f}x)"
    )
    for a, b in zip(logs["tp2"], logs["fsdp2"]):
        assert abs(a - b) <= 0.02 * abs(b)  # bf16 over 20 updates; both round to 3 decimals
