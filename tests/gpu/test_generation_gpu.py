"""Incremental decoding and the generator on CUDA: cached logits equal a full forward (fp32), and greedy, beam
and sampling generation in bf16 with the KV cache allocated once, its strided views read by SDPA's kernels."""

import math

import pytest
import torch

from fairseq import search
from fairseq.data.dictionary import Dictionary
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig
from fairseq.modules import MultiheadAttention
from fairseq.sequence_generator import SequenceGenerator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def dictionary(words=200):
    d = Dictionary()
    for i in range(words):
        d.add_symbol(f"w{i}")
    return d


def build(d, device, dtype, learned=True):
    torch.manual_seed(0)
    cfg = TransformerLanguageModelConfig(
        decoder_embed_dim=128, decoder_input_dim=128, decoder_output_dim=128, decoder_ffn_embed_dim=512,
        decoder_layers=3, decoder_attention_heads=4, max_target_positions=256, dropout=0.0,
        decoder_learned_pos=learned, decoder_normalize_before=learned, activation_fn="gelu")
    return TransformerLanguageModel.build(cfg, len(d), d.pad()).eval().to(device=device, dtype=dtype)


def check_cached_logits(device, dtype, atol):
    d = dictionary()
    for learned in (True, False):
        model = build(d, device, dtype, learned)
        x = torch.randint(4, len(d), (4, 40), device=device)
        with torch.no_grad():
            full = model(x).float()
            state = {}
            model.reserve_incremental_state(state, max_length=40, max_batch=4)
            chunks = [model(x[:, :17], incremental_state=state), model(x[:, :25], incremental_state=state)]
            chunks += [model(x[:, :t], incremental_state=state) for t in range(26, 41)]
        torch.testing.assert_close(torch.cat(chunks, dim=1).float(), full, atol=atol, rtol=0)


def check_generation(device, dtype, atol):
    d = dictionary()
    model = build(d, device, dtype)
    prompts = torch.randint(4, len(d), (6, 12), device=device)
    prompts[1, 5:] = d.pad()  # a shorter prompt: forced token by token after the shared five
    src = torch.cat([torch.full((6, 1), d.eos(), device=device), prompts], dim=1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1)}}
    for beam, strategy in ((1, None), (4, None), (3, search.Sampling(d, sampling_topp=0.9))):
        torch.manual_seed(1)
        generator = SequenceGenerator([model], d, beam_size=beam, max_len_b=40, search_strategy=strategy)
        hypos = generator.generate([model], sample, prefix_tokens=prompts)
        assert len(hypos) == 6 and all(len(sentence) == beam for sentence in hypos)
        for prompt, sentence in zip(prompts, hypos):
            prompt = prompt[prompt.ne(d.pad())]
            for hypo in sentence:
                toks = hypo["tokens"]
                assert torch.equal(toks[:len(prompt)], prompt) and int(toks[-1]) == d.eos()
                source = torch.cat([toks.new_full((1,), d.eos()), toks[:-1]])
                with torch.no_grad():
                    lp = torch.log_softmax(model(source[None])[0].float(), dim=-1)
                expected = lp.gather(1, toks[:, None]).squeeze(1)
                torch.testing.assert_close(hypo["positional_scores"], expected, atol=atol, rtol=0)
                assert math.isfinite(float(hypo["score"]))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_cached_logits_equal_a_full_forward_on_cuda(dtype, atol):
    check_cached_logits("cuda", dtype, atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
def test_generation_on_cuda_with_one_cache_allocation(dtype, atol, monkeypatch):
    allocations = []
    original = MultiheadAttention._ensure_capacity

    def spy(self, entry, rows, length, like):
        before = entry["key_buffer"]
        original(self, entry, rows, length, like)
        if entry["key_buffer"] is not before:
            allocations.append(entry["key_buffer"].device.type)

    monkeypatch.setattr(MultiheadAttention, "_ensure_capacity", spy)
    check_generation("cuda", dtype, atol)
    assert allocations == ["cuda"] * 3 * 3  # 3 layers x 3 generate calls
