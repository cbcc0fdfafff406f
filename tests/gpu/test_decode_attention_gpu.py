"""The split-KV decode attention kernels (fairseq.kernels.decode_attention) compiled on CUDA at real sizes: bf16,
batch 1 and 32, 32 heads, a 2,048-slot cache, read row by row, through a row map and through a block table,
against the fp32 reference and against SDPA over each row's live keys; replayed from a CUDA graph while the
lengths change in place; greedy decoding with the kernel gives the tokens decoding without it gives (beam search
through block tables: tests/gpu/test_beam_block_table_gpu.py). The interpreter tests on the CPU: tests/unit/test_decode_attention.py. The
time per call: scripts/benchmark_generate.py's decode attention table."""

import pytest
import torch
import torch.nn.functional as F

from fairseq.data.dictionary import Dictionary
from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.kernels.decode_attention import (
    CACHE_BLOCK,
    decode_attention_available,
    decode_attention_kernel,
    decode_attention_reference,
    gather_blocks,
    set_decode_attention_kernel,
)
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CAPACITY, HEADS = 2048, 32
BF16_ULP = 2**-7  # one unit in the last place of a bf16 value, relative: the reference and the kernel each round once


def caches(rows, dim, dtype=torch.bfloat16):
    torch.manual_seed(0)
    shape = (rows, HEADS, CAPACITY, dim)
    return (
        torch.randn(rows, HEADS, 1, dim, device="cuda", dtype=dtype),
        torch.randn(shape, device="cuda", dtype=dtype),
        torch.randn(shape, device="cuda", dtype=dtype),
    )


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("dim", [64, 128])
def test_the_kernels_match_the_reference_and_sdpa_at_real_sizes(batch, dim):
    q, keys, values = caches(batch, dim)
    assert decode_attention_available(q)
    lengths = torch.randint(1, CAPACITY + 1, (batch,), device="cuda", dtype=torch.int32)
    lengths[0] = 1 if batch > 1 else 777
    lengths[-1] = CAPACITY if batch > 1 else lengths[-1]
    # one cache row per query row (a column expanded over the blocks: a column stride of 0)
    row_map = torch.randperm(batch, device="cuda").to(torch.int32).view(batch, 1).expand(batch, CAPACITY // CACHE_BLOCK)
    # a block table: each 64-slot block of a row from a random row (blocks shared by several rows)
    table = torch.randint(0, batch, (batch, CAPACITY // CACHE_BLOCK), device="cuda", dtype=torch.int32)
    for rows in (None, row_map, table):
        got = decode_attention_kernel(q, keys, values, lengths, rows)
        want = decode_attention_reference(q, keys, values, lengths, rows)
        torch.testing.assert_close(got.float(), want.float(), rtol=BF16_ULP, atol=1e-3)
        # SDPA in bf16 over each row's live keys (its own rounding of scores and probabilities: looser)
        row_keys, row_values = keys[:batch], values[:batch]
        if rows is not None:
            row_keys, row_values = gather_blocks(keys, rows, CAPACITY), gather_blocks(values, rows, CAPACITY)
        for b in range(batch):
            live = int(lengths[b])
            sdpa = F.scaled_dot_product_attention(
                q[b : b + 1], row_keys[b : b + 1, :, :live], row_values[b : b + 1, :, :live]
            )
            torch.testing.assert_close(got[b : b + 1].float(), sdpa.float(), rtol=2e-2, atol=2e-2)


def test_a_captured_graph_reads_the_lengths_it_is_given_at_replay():
    q, keys, values = caches(4, 64)
    lengths = torch.tensor([1, 100, 1000, 2048], device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(decode_attention_kernel(q, keys, values, lengths))  # warm-up: compilation outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(decode_attention_kernel(q, keys, values, lengths))
    for new in ([5, 6, 7, 8], [2048, 1, 64, 65], [129, 257, 513, 1025]):
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.testing.assert_close(
            out.float(), decode_attention_reference(q, keys, values, lengths).float(), rtol=BF16_ULP, atol=1e-3
        )


@torch.no_grad()
def test_greedy_decoding_with_the_kernel_gives_the_tokens_without_it():
    d = Dictionary()
    for i in range(200):
        d.add_symbol(f"w{i}")
    torch.manual_seed(0)
    cfg = TransformerLanguageModelConfig(
        decoder_embed_dim=128,
        decoder_input_dim=128,
        decoder_output_dim=128,
        decoder_ffn_embed_dim=512,
        decoder_layers=3,
        decoder_attention_heads=4,
        max_target_positions=512,
        dropout=0.0,
    )
    model = TransformerLanguageModel.build(cfg, len(d), d.pad()).eval().cuda()  # fp32: no bf16 near-ties
    prompts = torch.randint(d.nspecial, len(d), (5, 40), device="cuda")
    sample = {"net_input": {"src_tokens": prompts, "src_lengths": torch.full((5,), 40, device="cuda")}}
    tokens = []
    for kernel in (True, False):
        previous = set_decode_attention_kernel(kernel)
        try:
            generator = SequenceGenerator([model], d, beam_size=1, max_len_b=300, min_len=300)
            hypos = generator.generate([model], sample, prefix_tokens=prompts)
        finally:
            set_decode_attention_kernel(previous)
        tokens.append([h[0]["tokens"].tolist() for h in hypos])
    assert tokens[0] == tokens[1]
