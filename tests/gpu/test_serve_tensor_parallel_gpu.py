"""Tensor-parallel decoding on 2 GPUs (NCCL; skipped with fewer), what `fairseq-serve --model-parallel-size 2`
runs on every rank: a random-weight 4-layer GPT-3 medium-shaped model (fp32, TF32 off) split by
fairseq.distributed.tensor_parallel_decoding draws the same tokens through the decode engine as the whole model
on one GPU (greedy and seeded sampling, rows of different lengths); the eager step's time of both is printed
(`pytest -s`). A second test tries the engine's CUDA graphs on the split model (capturing the NCCL collectives):
fairseq-serve runs the split model eagerly until it passes on the lent machines."""

import gc
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fairseq.runtime.env import get_free_port

pytestmark = pytest.mark.gpu
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

VOCAB, NEW_TOKENS, STEPS = 50272, 48, 16


class Words:
    """The dictionary interface the engine reads: size, pad, eos, unk."""

    def __len__(self):
        return VOCAB

    def pad(self):
        return 1

    def eos(self):
        return 2

    def unk(self):
        return 3


def build_model():
    from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config

    torch.manual_seed(0)
    cfg = preset_config("transformer_lm_gpt3_medium", decoder_layers=4, tokens_per_sample=512, dropout=0.0)
    return TransformerLanguageModel.build(cfg, VOCAB, 1).eval()


def decode(model, cuda_graphs: bool):
    """({request: tokens}, seconds per chunk step) of 4 rows: 2 greedy, 2 seeded samples, prompts of 5 to 40."""
    from fairseq.generation.engine import DecodeEngine, DecodeRequest

    engine = DecodeEngine(model, Words(), max_rows=4, max_positions=512, cuda_graphs=cuda_graphs)
    generator = torch.Generator().manual_seed(1)
    for i, length in enumerate((5, 17, 29, 40)):
        prompt = torch.randint(4, VOCAB, (length,), generator=generator)
        engine.add(DecodeRequest(i, prompt, max_new_tokens=NEW_TOKENS, temperature=0.0 if i < 2 else 0.9, seed=i))
    out, steps = {}, 0

    def chunk(size):
        for event in engine.step(size):
            out.setdefault(event.id, []).extend(event.tokens)

    chunk(1)  # prefill (and capture) outside the timing
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_work:
        chunk(STEPS)
        steps += STEPS
    torch.cuda.synchronize()
    return out, (time.perf_counter() - start) / steps


def _rank(rank, port, results, cuda_graphs):
    from torch.distributed.device_mesh import init_device_mesh

    from fairseq.distributed.tensor_parallel_decoding import split_for_decoding

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tokens, seconds = decode(split_for_decoding(build_model(), init_device_mesh("cuda", (2,))).cuda(), cuda_graphs)
        if rank == 0:
            torch.save((tokens, seconds), results)
    finally:
        gc.collect()  # the engine's cycles hold the split modules and their group: freed while it exists
        dist.destroy_process_group()


def split_run(tmp_path, cuda_graphs: bool):
    results = os.path.join(str(tmp_path), "rank0.pt")
    mp.spawn(_rank, nprocs=2, args=(get_free_port("127.0.0.1"), results, cuda_graphs), join=True)
    return torch.load(results)


@needs_two
def test_two_gpus_draw_what_one_gpu_draws(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    want, one_s = decode(build_model().cuda(), cuda_graphs=False)
    got, split_s = split_run(tmp_path, cuda_graphs=False)
    print(f"\neager decode step, 4 rows: 1 GPU {one_s * 1e3:.2f} ms, TP 2 {split_s * 1e3:.2f} ms")
    assert got == want


@needs_two
def test_cuda_graphs_capture_the_split_step(tmp_path):
    eager, _ = split_run(tmp_path, cuda_graphs=False)
    graphed, graphed_s = split_run(tmp_path, cuda_graphs=True)
    print(f"\nTP 2 decode step from CUDA graphs, 4 rows: {graphed_s * 1e3:.2f} ms")
    assert graphed == eager
