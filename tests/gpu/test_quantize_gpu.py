"""--quantize int8-weight-only on CUDA: a small model trained here for a few hundred steps decodes greedily with
int8 weights (Int8WeightOnlyLinear: the Triton int8 matmul in the decode steps) to the bf16 model's tokens on
>= 95% of 256 tokens, with the decode steps replayed from CUDA graphs (the int8 weights and scales are ordinary
CUDA buffers the graphs read) as eagerly; fairseq-generate runs with the flag; a batch whose KV cache cannot fit is one line before any
decoding; every launch shape of the int8 kernels, the one timed at first use (and replayed from a CUDA graph) and
FAIRSEQ_INT8_MATMUL=inductor's compiled form against the fp32 product on the 1.3B preset's Linear shapes. Run:
python -m pytest -s -m gpu tests/gpu/test_quantize_gpu.py (the figures are printed)."""

import io
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from fairseq.checkpoint.io import atomic_torch_save
from fairseq.data.dictionary import Dictionary
from fairseq.dataclass.utils import config_to_dict
from fairseq.generation.decode_memory import model_bytes
from fairseq.generation.quantize import quantize_for_generation
from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.kernels import int8_matmul, int8_tuning
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig, preset_config
from fairseq_cli import generate, interactive
from tests.train_fixtures import console_in_process

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORDS, PROMPTS, PROMPT_LEN, NEW_TOKENS = 128, 16, 8, 16  # 16 prompts x 16 greedy tokens = 256 tokens compared


def dictionary():
    d = Dictionary()
    for i in range(WORDS):
        d.add_symbol(f"w{i}")
    return d


def markov_batches(d, steps, batch=32, length=64, seed=0):
    """Text from a chain where each word is followed by its successor (a fixed permutation) 85% of the time,
    else by a random word: a model learns it in a few hundred steps, and greedy decoding has a clear answer."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(WORDS, generator=g) + d.nspecial
    for _ in range(steps):
        tokens = torch.empty(batch, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(d.nspecial, len(d), (batch,), generator=g)
        for t in range(1, length):
            follow = torch.rand(batch, generator=g) < 0.85
            random = torch.randint(d.nspecial, len(d), (batch,), generator=g)
            tokens[:, t] = torch.where(follow, successor[tokens[:, t - 1] - d.nspecial], random)
        yield tokens


@pytest.fixture(scope="module")
def trained():
    d = dictionary()
    torch.manual_seed(0)
    cfg = TransformerLanguageModelConfig(
        decoder_embed_dim=256,
        decoder_input_dim=256,
        decoder_output_dim=256,
        decoder_ffn_embed_dim=1024,
        decoder_layers=4,
        decoder_attention_heads=4,
        max_target_positions=256,
        dropout=0.0,
        share_decoder_input_output_embed=False,
    )  # the output projection is quantized too
    model = TransformerLanguageModel.build(cfg, len(d), d.pad()).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for tokens in markov_batches(d, steps=300):
        tokens = tokens.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])[0]
        loss = F.cross_entropy(logits.float().reshape(-1, len(d)), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return d, model.eval(), loss.item()


def greedy(model, d, cuda_graphs=True):
    """(new tokens [PROMPTS, NEW_TOKENS], seconds of the second call) of greedy decoding from fixed prompts."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(d.nspecial, len(d), (PROMPTS, PROMPT_LEN), generator=g).cuda()
    total = PROMPT_LEN + NEW_TOKENS
    src = torch.cat([torch.full((PROMPTS, 1), d.eos(), device="cuda"), prompts], dim=1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((PROMPTS,), src.size(1), device="cuda")}}
    generator = SequenceGenerator([model], d, beam_size=1, max_len_b=total, min_len=total, cuda_graphs=cuda_graphs)
    for _ in range(2):  # the second call replays the graphs the first captured
        torch.cuda.synchronize()
        start = time.perf_counter()
        hypos = generator.generate([model], sample, prefix_tokens=prompts)
        torch.cuda.synchronize()
    tokens = torch.stack([h[0]["tokens"][PROMPT_LEN:total] for h in hypos])
    return tokens, time.perf_counter() - start, generator


def test_int8_weight_only_greedy_tokens_agree_with_bf16(trained, record_property):
    d, model, loss = trained
    assert loss < 1.5  # learnt the chain (uniform over 128 words: 4.85)
    bf16 = model.to(torch.bfloat16)
    reference, bf16_s, _ = greedy(bf16, d)
    bf16_bytes = model_bytes([bf16])
    # 4 layers x (q, k, v, out, fc1, fc2) + the untied output projection
    assert quantize_for_generation(bf16, "int8-weight-only", torch.device("cuda")) == 4 * 6 + 1
    assert type(bf16.decoder.layers[0].fc1).__name__ == "Int8WeightOnlyLinear"
    int8_bytes = model_bytes([bf16])
    graphed, int8_s, generator = greedy(bf16, d, cuda_graphs=True)
    eager, _, _ = greedy(bf16, d, cuda_graphs=False)
    runner = generator.step_model.graphed
    assert runner is not None and runner.graphs  # the steps were captured and replayed
    agree = float((graphed == reference).float().mean())
    graph_vs_eager = float((graphed == eager).float().mean())
    print(
        f"\nint8-weight-only vs bf16 greedy: {agree:.1%} of {reference.numel()} tokens agree (CUDA-graph steps); "
        f"replayed vs eager int8: {graph_vs_eager:.1%}; weights {bf16_bytes / 2**20:.2f} -> {int8_bytes / 2**20:.2f} "
        f"MiB; {PROMPTS} x {NEW_TOKENS} tokens in {bf16_s * 1e3:.1f} ms bf16, {int8_s * 1e3:.1f} ms int8 "
        f"(train loss {loss:.3f})"
    )
    record_property("int8_vs_bf16_token_agreement", agree)
    record_property("int8_graphed_vs_eager_agreement", graph_vs_eager)
    assert reference.numel() == 256 and agree >= 0.95
    assert graph_vs_eager >= 0.95
    assert int8_bytes < 0.6 * bf16_bytes  # embeddings and norms stay bf16


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_lm_checkpoint):
    return tiny_lm_checkpoint


def test_fairseq_generate_with_quantize(tiny_data, tiny_ckpt):
    argv = [
        str(tiny_data),
        "--task",
        "language_modeling",
        "--path",
        str(tiny_ckpt),
        "--gen-subset",
        "test",
        "--tokens-per-sample",
        "32",
        "--sample-break-mode",
        "eos",
        "--batch-size",
        "40",
        "--num-workers",
        "0",
        "--prefix-size",
        "2",
        "--beam",
        "1",
        "--max-len-b",
        "8",
        "--bf16",
    ]
    status, plain, err = console_in_process("fairseq-generate", generate.cli_main, argv)
    assert status == 0, err
    status, out, err = console_in_process(
        "fairseq-generate", generate.cli_main, argv + ["--quantize", "int8-weight-only"]
    )
    assert status == 0, err
    assert "--quantize int8-weight-only: " in out and "Linear weights are int8" in out  # the log line
    hypotheses = [line for line in out.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == len([line for line in plain.splitlines() if line.startswith("H-")]) == 40
    for name, main in (("fairseq-generate", generate.cli_main), ("fairseq-interactive", interactive.cli_main)):
        no_bf16 = [a for a in argv if a != "--bf16"] + ["--quantize", "int8-weight-only"]
        status, _, err = console_in_process(
            name,
            main,
            no_bf16
            if name == "fairseq-generate"
            else [str(tiny_data), "--path", str(tiny_ckpt), "--quantize", "int8-weight-only"],
        )
        assert status == 1 and err.strip().endswith(
            "--quantize int8-weight-only needs a bf16 model (an fp32 model gains nothing from int8 weights): pass "
            "--bf16"
        ), err


def test_a_batch_whose_kv_cache_cannot_fit_is_one_line(tmp_path, monkeypatch):
    """8 layers x 1024 dims x 4,096 positions, random weights: --beam 2000 with --max-len-b 4000 reserves
    2000 x 4001 x 8 x 2 x 1024 x 2 bytes = 244.2 GiB of KV cache in bf16, more than any one GPU has."""
    d = Dictionary()
    for i in range(2100):
        d.add_symbol(f"w{i}")
    cfg = preset_config(
        "transformer_lm",
        decoder_embed_dim=1024,
        decoder_input_dim=1024,
        decoder_output_dim=1024,
        decoder_ffn_embed_dim=1024,
        decoder_layers=8,
        decoder_attention_heads=8,
        tokens_per_sample=4096,
    )  # a config that names its arch
    model = TransformerLanguageModel.build(cfg, len(d), d.pad())
    path = tmp_path / "checkpoint.pt"
    atomic_torch_save(
        {
            "cfg": {
                "model": config_to_dict(cfg),
                "task": {"_name": "language_modeling", "data": str(tmp_path), "tokens_per_sample": 4096},
            },
            "model": model.state_dict(),
        },
        str(path),
    )
    d.save(str(tmp_path / "dict.txt"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("w1 w2 w3\n"))
    status, out, err = console_in_process(
        "fairseq-interactive",
        interactive.cli_main,
        [
            str(tmp_path),
            "--path",
            str(path),
            "--bf16",
            "--tokens-per-sample",
            "4096",
            "--beam",
            "2000",
            "--nbest",
            "1",
            "--max-len-b",
            "4000",
        ],
    )
    assert status == 1 and len(err.strip().splitlines()) == 1, err
    message = err.strip().split(": error: ", 1)[1]
    assert message.startswith(
        "a batch of 1 prompt(s) x beam 2000 x 4001 positions needs 244.20 GiB of KV cache "
        "(8 layers x 2 x 1024 values per position) besides "
    ), message
    assert message.endswith("; lower --batch-size / --max-tokens, --beam or --max-len-b")
    assert "H-0" not in out


def test_a_model_without_linears_is_refused():
    from fairseq.models.fconv_lm import FConvLanguageModel, preset_config as fconv_config

    model = FConvLanguageModel.build(fconv_config("fconv_lm"), 100, 1).cuda().to(torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"^--quantize int8-weight-only: FConvLanguageModel has no nn.Linear weight "
        r"of its own to quantize; drop it for this model$",
    ):
        quantize_for_generation(model, "int8-weight-only", torch.device("cuda"))


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_every_int8_launch_shape_matches_the_fp32_product(rows):
    """The 1.3B preset's Linear shapes (d 2048, FFN 8192; q/k/v fused: 6144) plus one with N and K no multiple of
    any block: each candidate launch shape (split-K summed in the kernel and by the second kernel), then the one
    timed at first use, within one rounding to bf16 (2**-8
    relative: the GPU rounds to nearest) and the fp32 sums' error; a CUDA graph replays the timed one."""
    torch.manual_seed(0)
    for columns, depth in ((6144, 2048), (2048, 8192), (8192, 2048), (1000, 1100)):
        x = torch.randn(rows, depth, device="cuda").to(torch.bfloat16)
        qweight = torch.randint(-127, 128, (columns, depth), dtype=torch.int8, device="cuda")
        scale = torch.rand(columns, device="cuda") / 1000
        bias = torch.randn(columns, device="cuda").to(torch.bfloat16)
        want = x.float() @ qweight.float().t() * scale + bias.float()
        # one rounding of the output, plus the fp32 sums' error in any order (2**-20 of the sum of |products|)
        bound = 2**-8 * want.abs() + 2**-20 * (x.float().abs() @ qweight.float().abs().t() * scale)
        shapes = int8_tuning.candidates(rows, columns, depth)
        two_launches = [c._replace(sum_in_kernel=False) for c in shapes if c.split_k > 1][:2]  # (fewer compiles)
        shapes += two_launches + [None]  # None: the timed one
        for config in shapes:
            got = int8_matmul.int8_matmul_kernel(x, qweight, scale, bias, config).float()
            assert ((got - want).abs() <= bound).all(), (rows, columns, depth, config, (got - want).abs().max())
        key = (int8_tuning.row_bucket(rows), columns, depth, torch.bfloat16, True, x.device)
        assert key in int8_tuning.tuned_configs()  # the None call timed them
        eager = int8_matmul.int8_matmul_kernel(x, qweight, scale, bias)
        graph, out = torch.cuda.CUDAGraph(), None
        with torch.cuda.graph(graph):
            out = int8_matmul.int8_matmul_kernel(x, qweight, scale, bias)
        graph.replay()
        assert torch.equal(out, eager)  # the same launch shape, a deterministic sum (no atomics)


def test_the_inductor_form_compiled_on_cuda_matches_the_fp32_product():
    torch.manual_seed(0)
    qweight = torch.randint(-127, 128, (2048, 2048), dtype=torch.int8, device="cuda")
    scale, bias = torch.rand(2048, device="cuda") / 1000, torch.randn(2048, device="cuda").to(torch.bfloat16)
    previous = int8_matmul.set_int8_matmul("inductor")
    try:
        linear = torch.compile(lambda x: int8_matmul.int8_linear(x, qweight, scale, bias), fullgraph=True)
        for rows in (1, 32):
            x = torch.randn(rows, 2048, device="cuda").to(torch.bfloat16)
            product = x.float() @ qweight.float().t() * scale
            got, want = linear(x).float(), product + bias.float()
            # one row: fp32 sums, one rounding; more: F.linear's bf16 output rounded, then the bias, rounded again
            assert ((got - want).abs() <= 2**-8 * (product.abs() + want.abs()) + 1e-3).all(), rows
    finally:
        int8_matmul.set_int8_matmul(previous)
