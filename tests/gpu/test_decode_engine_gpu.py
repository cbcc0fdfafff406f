"""The decode engine (fairseq.generation.engine) on CUDA: its chunks replayed from CUDA graphs give the eager
steps' tokens, rows joining mid-decode get the tokens they get alone, in fp32 and bf16."""

import pytest
import torch

from fairseq.generation.engine import DecodeEngine, DecodeRequest

from test_generation_gpu import build, dictionary

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def requests(d, options):
    torch.manual_seed(3)
    lengths = (12, 1, 30, 0, 7)
    return [
        DecodeRequest(
            id=i,
            prompt=torch.randint(4, len(d), (n,)),
            max_new_tokens=20 + 9 * i,
            logprobs=True,
            top_logprobs=2,
            **options,
        )
        for i, n in enumerate(lengths)
    ]


def run(engine, joins):
    out, chunk = {}, 0
    while engine.has_work or chunk <= max(joins):
        for request in joins.get(chunk, ()):
            engine.add(request)
        for event in engine.step(16):
            tokens, lprobs = out.get(event.id, ([], []))
            out[event.id] = (tokens + event.tokens, lprobs + event.logprobs)
        chunk += 1
    return out


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("options", [dict(), dict(temperature=0.8, top_p=0.9, seed=4)])
def test_graphed_chunks_give_the_eager_tokens_and_rows_join_mid_decode(dtype, atol, options):
    d = dictionary()
    model = build(d, "cuda", dtype)
    batch = requests(d, options)
    joins = {0: batch[:2], 1: batch[2:4], 4: batch[4:]}
    graphed_engine = DecodeEngine(model, d, max_rows=4)
    graphed = run(graphed_engine, joins)
    assert graphed_engine._graphed.capture and graphed_engine._graphed.graphs
    eager = run(
        DecodeEngine(model, d, max_rows=4, cuda_graphs=False),
        {0: requests(d, options)[:2], 1: requests(d, options)[2:4], 4: requests(d, options)[4:]},
    )
    for i, request in enumerate(requests(d, options)):
        alone = run(DecodeEngine(model, d, max_rows=1), {0: [request]})[i]
        if dtype == torch.float32:  # bf16: rounding at other batch sizes may flip a near tie
            assert graphed[i][0] == eager[i][0] == alone[0], i
        same = next((j for j, (a, b) in enumerate(zip(graphed[i][0], eager[i][0])) if a != b), len(eager[i][0]))
        assert same >= 1
        torch.testing.assert_close(
            torch.tensor(graphed[i][1][:same]), torch.tensor(eager[i][1][:same]), atol=atol, rtol=0
        )


def test_kv_positions_that_fit_bound_what_an_engine_reserves():
    from fairseq.generation import decode_memory

    d = dictionary()
    model = build(d, "cuda", torch.bfloat16)
    fits = decode_memory.kv_positions_that_fit([model], torch.device("cuda"))
    engine = DecodeEngine(model, d, max_rows=4)
    assert fits > engine.kv_capacity_tokens and engine.kv_bytes_per_token == 3 * 2 * 128 * 2
