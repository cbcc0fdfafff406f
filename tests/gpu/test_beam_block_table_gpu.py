"""Beam search's reorder through a block table (fairseq.generation.step_model.StepModel.reorder_blocks) on CUDA,
replayed from CUDA graphs with the decode attention kernel reading the table: outputs of 200 tokens (blocks of
64 slots fill and are shared) give the tokens and scores of the copy reorder it replaced, and the tokens of the
SDPA path (the kernel off: the caches gathered through the table). On the CPU: tests/unit/test_beam_block_table.py."""

import os
import sys

import pytest
import torch

from fairseq.generation import device_beam_search
from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.kernels.decode_attention import CACHE_BLOCK, set_decode_attention_kernel
from test_generation_gpu import build, dictionary

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))
from test_beam_block_table import CopyReorder, assert_equal_hypotheses  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@torch.no_grad()
@pytest.mark.parametrize("beam", [2, 4])
def test_beam_search_through_the_block_table_under_cuda_graphs_gives_the_copy_reorders_hypotheses(beam):
    d = dictionary()
    model = build(d, "cuda", torch.float32)  # fp32: no bf16 near-ties between the paths
    prompts = torch.randint(d.nspecial, len(d), (5, 20), device="cuda")
    src = torch.cat([torch.full((5, 1), d.eos(), device="cuda"), prompts], dim=1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((5,), 21, device="cuda")}}
    options = dict(beam_size=beam, max_len_b=200, min_len=170)
    results = {}
    for name, kernel in (("table", True), ("copy", True), ("sdpa", False)):
        previous = set_decode_attention_kernel(kernel)
        try:
            generator = SequenceGenerator([model], d, **options)
            if name == "copy":
                generator.step_model.__class__ = CopyReorder
            assert device_beam_search.applies(generator, beam)
            for _ in range(2):  # the first call captures the graphs, the second replays them
                results[name] = generator.generate([model], sample, prefix_tokens=prompts)
            assert generator.step_model.graphed.graphs and generator.step_model.block_table is None
        finally:
            set_decode_attention_kernel(previous)
    assert_equal_hypotheses(results["table"], results["copy"])
    tokens = {name: [[h["tokens"].tolist() for h in s] for s in hypos] for name, hypos in results.items()}
    assert tokens["table"] == tokens["sdpa"]
    assert min(len(h["tokens"]) for s in results["table"] for h in s) > 2 * CACHE_BLOCK
