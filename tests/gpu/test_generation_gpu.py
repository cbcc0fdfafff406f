"""Incremental decoding and the generator on CUDA: cached logits equal a full forward (fp32), greedy, beam
and sampling generation in bf16 with the KV cache allocated once, its strided views read by SDPA's kernels,
and the steps replayed from CUDA graphs giving the eager path's tokens."""

import math

import pytest
import torch

from fairseq.generation import search
from fairseq.data.dictionary import Dictionary
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig
from fairseq.modules import CausalSelfAttention
from fairseq.generation.sequence_generator import SequenceGenerator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def dictionary(words=200):
    d = Dictionary()
    for i in range(words):
        d.add_symbol(f"w{i}")
    return d


def build(d, device, dtype, learned=True):
    torch.manual_seed(0)
    cfg = TransformerLanguageModelConfig(
        decoder_embed_dim=128,
        decoder_input_dim=128,
        decoder_output_dim=128,
        decoder_ffn_embed_dim=512,
        decoder_layers=3,
        decoder_attention_heads=4,
        max_target_positions=256,
        dropout=0.0,
        decoder_learned_pos=learned,
        decoder_normalize_before=learned,
        activation_fn="gelu",
    )
    return TransformerLanguageModel.build(cfg, len(d), d.pad()).eval().to(device=device, dtype=dtype)


def check_cached_logits(device, dtype, atol):
    d = dictionary()
    for learned in (True, False):
        model = build(d, device, dtype, learned)
        x = torch.randint(4, len(d), (4, 40), device=device)
        with torch.no_grad():
            full = model(x)[0].float()
            state = {}
            model.reserve_incremental_state(state, max_length=40, max_batch=4)
            chunks = [model(x[:, :17], incremental_state=state)[0], model(x[:, :25], incremental_state=state)[0]]
            chunks += [model(x[:, :t], incremental_state=state)[0] for t in range(26, 41)]
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
                assert torch.equal(toks[: len(prompt)], prompt) and int(toks[-1]) == d.eos()
                source = torch.cat([toks.new_full((1,), d.eos()), toks[:-1]])
                with torch.no_grad():
                    lp = torch.log_softmax(model(source[None])[0][0].float(), dim=-1)
                expected = lp.gather(1, toks[:, None]).squeeze(1)
                torch.testing.assert_close(hypo["positional_scores"], expected, atol=atol, rtol=0)
                assert math.isfinite(float(hypo["score"]))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_cached_logits_equal_a_full_forward_on_cuda(dtype, atol):
    check_cached_logits("cuda", dtype, atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
def test_generation_on_cuda_with_one_cache_allocation(dtype, atol, monkeypatch):
    allocations = []
    original = CausalSelfAttention._ensure_capacity

    def spy(self, entry, rows, length, like):
        before = entry["key_buffer"]
        original(self, entry, rows, length, like)
        if entry["key_buffer"] is not before:
            allocations.append(entry["key_buffer"].device.type)

    monkeypatch.setattr(CausalSelfAttention, "_ensure_capacity", spy)
    check_generation("cuda", dtype, atol)
    assert allocations == ["cuda"] * 3 * 3  # 3 layers x 3 generate calls


def eos_prone(model, d, factor=2.0):
    """Scale </s>'s output row so that it wins now and then: sentences end at different steps."""
    with torch.no_grad():
        model.decoder.output_projection.weight[d.eos()] *= factor
    return model


def graphed_and_eager(device, models, d, batch, beam, sampling=None, calls=2, **options):
    """Generate twice (the second call replays the graphs of the first) with CUDA graphs and without; both
    generators' hypotheses of every call, and the generators."""
    prompts = torch.randint(4, len(d), (batch, 8), generator=torch.Generator().manual_seed(batch)).to(device)
    if batch > 1:
        prompts[1, 3:] = d.pad()  # a shorter prompt: forced token by token after the shared three
    src = torch.cat([torch.full((batch, 1), d.eos(), device=device), prompts], dim=1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1)}}
    generators = [
        SequenceGenerator(
            models,
            d,
            beam_size=beam,
            max_len_b=48,
            cuda_graphs=graphs,
            search_strategy=None if sampling is None else search.Sampling(d, **sampling),
            **options,
        )
        for graphs in (True, False)
    ]
    results = []
    for call in range(calls):
        for generator in generators:
            torch.manual_seed(call)
            results.append(generator.generate(models, sample, prefix_tokens=prompts))
    return results, generators


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize(
    "beam,sampling,options",
    [
        (1, None, {}),
        (1, None, dict(min_len=12)),
        (4, None, {}),
        (3, dict(sampling_topk=10), {}),
        (2, dict(sampling_topp=0.9), dict(temperature=0.8)),
    ],
)
def test_cuda_graphs_give_the_eager_paths_tokens(batch, beam, sampling, options):
    d = dictionary()
    model = eos_prone(build(d, "cuda", torch.float32), d)
    results, (graphed, eager) = graphed_and_eager("cuda", [model], d, batch, beam, sampling, **options)
    for got, expected in zip(results[::2], results[1::2]):
        assert [[h["tokens"].tolist() for h in s] for s in got] == [[h["tokens"].tolist() for h in s] for s in expected]
        for got_sentence, expected_sentence in zip(got, expected):
            for a, b in zip(got_sentence, expected_sentence):
                torch.testing.assert_close(a["positional_scores"], b["positional_scores"], atol=1e-4, rtol=0)
    assert eager.step_model.graphed is None and graphed.step_model.graphed is not None
    # One graph per row count met (sentences leaving the batch: 4, 2, 1 sentences), kept for the second call;
    # none when the only sentence ended at the first token after its prompt (fed in one forward).
    steps_after_the_prompt = max(len(h["tokens"]) for sentence in results[0] for h in sentence) - 9
    assert 1 <= len(graphed.step_model.graphed.graphs) <= 3 or (batch == 1 and steps_after_the_prompt <= 0)
    if batch == 4 and beam == 1 and not options:
        assert len({len(sentence[0]["tokens"]) for sentence in results[0]}) > 1  # they end at different steps


def test_cuda_graphs_of_an_ensemble():
    d = dictionary()
    models = [eos_prone(build(d, "cuda", torch.float32), d), build(d, "cuda", torch.float32, learned=False)]
    results, (graphed, _) = graphed_and_eager("cuda", models, d, batch=4, beam=2)
    for got, expected in zip(results[::2], results[1::2]):
        assert [[h["tokens"].tolist() for h in s] for s in got] == [[h["tokens"].tolist() for h in s] for s in expected]
    assert graphed.step_model.graphed.graphs


# ---- the device decode loop (fairseq.generation.device_decoding): beam 1, one captured graph per step -------


def host_syncs_of(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return sum(event.name == "aten::_local_scalar_dense" for event in profile.events())


@pytest.mark.parametrize("sampling", [None, dict(sampling_topk=10), dict(sampling_topp=0.9)])
def test_the_device_loop_replays_whole_steps_without_a_host_sync_per_token(sampling):
    from fairseq.generation import device_decoding

    d = dictionary()
    model = build(d, "cuda", torch.float32)
    with torch.no_grad():  # </s> never wins: every sentence runs to the length limit
        model.decoder.output_projection.weight[d.eos()] = 0.0
        model.decoder.output_projection.weight[d.eos(), 0] = -1e4
    results, (graphed, eager) = graphed_and_eager("cuda", [model], d, 4, 1, sampling, min_len=1)
    for got, expected in zip(results[::2], results[1::2]):
        assert [[h["tokens"].tolist() for h in s] for s in got] == [[h["tokens"].tolist() for h in s] for s in expected]
    assert all(key[0] == "loop" for key in graphed.step_model.graphed.graphs) and graphed.step_model.graphed.graphs
    prompts = torch.randint(4, len(d), (4, 8), device="cuda")
    src = torch.cat([torch.full((4, 1), d.eos(), device="cuda"), prompts], dim=1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1)}}
    syncs = host_syncs_of(lambda: graphed.generate(None, sample, prefix_tokens=prompts))
    steps = 48 - 8  # after the prompt, fed at once
    assert syncs <= -(-steps // device_decoding.CHUNK) + 6, syncs
    if sampling is not None:  # a sentence's draw does not depend on its batch
        sample["id"] = torch.arange(4, device="cuda")
        together = graphed.generate(None, sample, prefix_tokens=prompts)
        alone = graphed.generate(
            None,
            {
                "id": torch.tensor([2]),
                "net_input": {"src_tokens": src[2:3], "src_lengths": sample["net_input"]["src_lengths"][2:3]},
            },
            prefix_tokens=prompts[2:3],
        )
        assert together[2][0]["tokens"].tolist() == alone[0][0]["tokens"].tolist()


# ---- beam search on the device (fairseq.generation.device_beam_search): one captured graph per step -----------


@pytest.mark.parametrize("batch", [1, 4])
def test_device_beam_search_replays_whole_steps_without_a_host_sync_per_step(batch):
    from fairseq.generation import device_beam_search, device_decoding

    d = dictionary()
    model = eos_prone(build(d, "cuda", torch.float32), d)  # hypotheses end at different steps
    results, (graphed, eager) = graphed_and_eager("cuda", [model], d, batch, 4)
    assert device_beam_search.applies(graphed, 4)
    assert graphed.step_model.graphed is not None and eager.step_model.graphed is None
    for got, expected in zip(results[::2], results[1::2]):
        assert [[h["tokens"].tolist() for h in s] for s in got] == [[h["tokens"].tolist() for h in s] for s in expected]
        for got_sentence, expected_sentence in zip(got, expected):
            for a, b in zip(got_sentence, expected_sentence):
                torch.testing.assert_close(a["positional_scores"], b["positional_scores"], atol=1e-4, rtol=0)
    assert graphed.step_model.graphed.graphs and all(key[0] == "beam" for key in graphed.step_model.graphed.graphs)

    prompts = torch.randint(4, len(d), (batch, 8), device="cuda")
    src = torch.cat([torch.full((batch, 1), d.eos(), device="cuda"), prompts], dim=1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1)}}
    # --min-len at the length limit: every hypothesis runs to it
    generators = [
        SequenceGenerator([model], d, beam_size=4, max_len_b=length, min_len=length, cuda_graphs=True)
        for length in (48, 48 + device_decoding.CHUNK)
    ]
    for generator in generators:  # the first call captures the graphs
        generator.generate(None, sample, prefix_tokens=prompts)
    syncs = [host_syncs_of(lambda: g.generate(None, sample, prefix_tokens=prompts)) for g in generators]
    steps = 48 - 8  # after the prompt, fed at once
    assert syncs[0] <= -(-steps // device_decoding.CHUNK) + 6, syncs
    assert syncs[1] - syncs[0] == 1, syncs  # one more per CHUNK steps
