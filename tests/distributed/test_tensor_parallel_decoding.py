"""The model's tensor-parallel plan applied for decoding (fairseq.distributed.tensor_parallel_decoding) on 2 CPU
processes (gloo, fp32): each rank caches its own heads (1 of the tiny model's 2), and the decode engine's rows
(greedy and seeded sampling, prompts of different lengths, a row joining a running batch) draw the same tokens as
one process, their log-probabilities and a full forward's logits within 1e-5."""

import gc

import pytest
import torch

from tests.train_fixtures import spawn_scenarios

pytestmark = pytest.mark.timeout(120)

REQUESTS = [  # (prompt, temperature, top_p, seed)
    ("w1 w2 w3", 0.0, 1.0, 1),
    ("w4 w5", 0.8, 1.0, 2),
    ("w9 w0 w0 w3 w7", 1.0, 0.9, 3),
]


def decode(model, dictionary):
    """({request index: (tokens, log-probabilities)} of REQUESTS through a DecodeEngine (the last one joins after
    the first chunk), the heads the first layer caches, a full forward's logits of the first prompt)."""
    from fairseq.generation.engine import DecodeEngine, DecodeRequest
    from fairseq.modules.causal_attention import CausalSelfAttention

    engine = DecodeEngine(model, dictionary, max_rows=4, cuda_graphs=False)
    ids = [torch.tensor([dictionary.index(w) for w in prompt.split()]) for prompt, *_ in REQUESTS]
    requests = [
        DecodeRequest(i, ids[i], max_new_tokens=20, temperature=temperature, top_p=top_p, seed=seed, logprobs=True)
        for i, (_, temperature, top_p, seed) in enumerate(REQUESTS)
    ]
    for request in requests[:-1]:
        engine.add(request)
    out, late = {}, requests[-1]
    while engine.has_work:
        for event in engine.step(4):
            tokens, logprobs = out.setdefault(event.id, ([], []))
            tokens += event.tokens
            logprobs += event.logprobs
        if late is not None:
            engine.add(late)
            late = None
    attention = next(m for m in model.modules() if isinstance(m, CausalSelfAttention))
    heads = attention._cache_entry(engine.states[0])["key_buffer"].size(1)
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor([dictionary.eos()]), ids[0]])[None])[0]
    return out, heads, logits


def scenarios(rank, checkpoint):
    from torch.distributed.device_mesh import init_device_mesh

    from fairseq.checkpoint.inference import load_model
    from fairseq.distributed.tensor_parallel_decoding import split_for_decoding

    def split_and_decode():
        loaded = load_model(str(checkpoint))
        model = split_for_decoding(loaded.model.eval(), init_device_mesh("cpu", (2,)))
        return decode(model, loaded.task.target_dictionary)

    def freed():
        # the engine's reference cycles hold the split modules, which hold the process group: freed while the
        # group exists (as the launcher does before it destroys it), else gloo's threads abort the exit
        result = split_and_decode()
        gc.collect()
        return result

    return {"tp2": freed}


def test_tensor_parallel_decoding_draws_what_one_process_draws(tiny_lm_checkpoint, tmp_path):
    from fairseq.checkpoint.inference import load_model

    runs = spawn_scenarios(scenarios, tmp_path, 2, tiny_lm_checkpoint, timeout_s=60)
    for run in runs:
        if isinstance(run["tp2"], Exception):
            raise run["tp2"]
    loaded = load_model(str(tiny_lm_checkpoint))
    want, want_heads, want_logits = decode(loaded.model.eval(), loaded.task.target_dictionary)
    assert want_heads == 2
    for out, heads, logits in (run["tp2"] for run in runs):
        assert heads == 1
        assert sorted(out) == [0, 1, 2]
        for i in out:
            assert out[i][0] == want[i][0], REQUESTS[i]
            assert out[i][1] == pytest.approx(want[i][1], abs=1e-5)
        torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
