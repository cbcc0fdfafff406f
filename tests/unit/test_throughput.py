"""fairseq.logging.throughput: matrix-weight count N, model FLOPs per token, tflops/mfu in the metrics."""

import uuid

import pytest
import torch

from fairseq.logging import metrics
from fairseq.logging.throughput import Throughput, default_peak_tflops, flops_per_token, matrix_weight_count
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config

V = 104


def tiny(layers=2, d=32, ffn=64, in_out=32, share=True, **kw):
    cfg = preset_config("transformer_lm", decoder_layers=layers, decoder_embed_dim=d, decoder_ffn_embed_dim=ffn,
                        decoder_attention_heads=2, decoder_input_dim=in_out, decoder_output_dim=in_out,
                        share_decoder_input_output_embed=share, tokens_per_sample=16, **kw)
    return TransformerLanguageModel.build(cfg, V, 1)


def test_weight_count_tied_output_projection_is_counted():
    model = tiny()
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    per_layer = 4 * 32 * 32 + 2 * 32 * 64  # q, k, v, out + fc1, fc2 (no biases)
    assert matrix_weight_count(model) == 2 * per_layer + V * 32
    assert matrix_weight_count(model) == 19712


def test_weight_count_untied_is_the_same():
    assert matrix_weight_count(tiny(share=False)) == 2 * (4 * 32 * 32 + 2 * 32 * 64) + V * 32


def test_weight_count_with_input_and_output_dim_projections():
    model = tiny(layers=3, d=32, ffn=48, in_out=24)
    assert model.decoder.project_in_dim is not None and model.decoder.project_out_dim is not None
    expected = 3 * (4 * 32 * 32 + 2 * 32 * 48) + 24 * 32 + 32 * 24 + V * 24
    assert matrix_weight_count(model) == expected


def test_weight_count_leaves_out_embeddings_biases_and_norms():
    model = tiny(decoder_learned_pos=True, layernorm_embedding=True)
    total = sum(p.numel() for p in model.parameters())  # tied weight counted once here
    n = matrix_weight_count(model)
    embeddings = V * 32 + model.decoder.embed_positions.weight.numel()
    assert n == 2 * (4 * 32 * 32 + 2 * 32 * 64) + V * 32
    # every other parameter is an embedding or a bias/norm vector
    small = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 1)
    assert total == n - V * 32 + embeddings + small


def test_flops_per_token():
    model = tiny()
    assert flops_per_token(model, num_layers=2, width=32, seq_len=16) == 6 * 19712 + 12 * 2 * 32 * 16
    assert flops_per_token(model, 2, 32, 16) == 130560.0


def test_default_peak_tflops_is_none_on_cpu():
    assert default_peak_tflops(torch.device("cpu")) is None


def test_log_writes_tflops_and_mfu():
    name = f"test_throughput_{uuid.uuid4().hex}"
    tp = Throughput(model_flops_per_token=1e9, world_size=4, peak_tflops=989.0)
    with metrics.aggregate(name):
        tp.log(ntokens_all_ranks=4e6, elapsed=2.0)  # 1e9 * 4e6 / 4 / 2 s = 500 TFLOP/s per GPU
        values = metrics.get_smoothed_values(name)
        assert values["tflops"] == 500.0
        assert values["mfu"] == round(100 * 500 / 989, 1) == 50.6
        assert list(values).index("tflops") < list(values).index("mfu")
        tp.log(ntokens_all_ranks=1e6, elapsed=1.0)  # 250 TFLOP/s over 1 s: averaged weighted by time
        values = metrics.get_smoothed_values(name)
    assert values["tflops"] == pytest.approx(round((500 * 2 + 250 * 1) / 3, 1)) == 416.7
    assert values["mfu"] == pytest.approx(round(100 * (500 * 2 + 250) / 3 / 989, 1))
    metrics.reset_meters(name)


def test_log_without_peak_has_no_mfu():
    name = f"test_throughput_{uuid.uuid4().hex}"
    with metrics.aggregate(name):
        Throughput(2e9, 1, None).log(ntokens_all_ranks=3e5, elapsed=0.5)
        values = metrics.get_smoothed_values(name)
    assert values == {"tflops": 1200.0}  # 2e9 * 3e5 / 0.5 s / 1e12
