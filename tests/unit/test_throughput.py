"""fairseq.logging.throughput: matrix-weight count N, model FLOPs per token, tflops/mfu in the metrics."""

import uuid

import pytest
import torch

from fairseq.logging import metrics
from fairseq.logging.throughput import Throughput, default_peak_tflops, flops_per_token, matrix_weight_count
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config

V = 104


def tiny(layers=2, d=32, ffn=64, in_out=32, share=True, **kw):
    cfg = preset_config(
        "transformer_lm",
        decoder_layers=layers,
        decoder_embed_dim=d,
        decoder_ffn_embed_dim=ffn,
        decoder_attention_heads=2,
        decoder_input_dim=in_out,
        decoder_output_dim=in_out,
        share_decoder_input_output_embed=share,
        tokens_per_sample=16,
        **kw,
    )
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


def test_interval_values_are_tflops_and_mfu():
    tp = Throughput(model_flops_per_token=1e9, world_size=4, peak_tflops=989.0)
    values = tp.interval_values(ntokens_all_ranks=4e6, elapsed=2.0)  # 1e9 * 4e6 / 4 / 2 s = 500 TFLOP/s per GPU
    assert values == {"tflops": 500.0, "mfu": pytest.approx(100 * 500 / 989)}
    assert list(values) == ["tflops", "mfu"]


def test_interval_values_without_peak_have_no_mfu():
    assert Throughput(2e9, 1, None).interval_values(ntokens_all_ranks=3e5, elapsed=0.5) == {"tflops": 1200.0}


class _Trainer:
    """What log_train_interval reads of a trainer."""

    def __init__(self, throughput):
        from fairseq.criterions.cross_entropy import CrossEntropyCriterion

        self.criterion = CrossEntropyCriterion.__new__(CrossEntropyCriterion)
        self.throughput = throughput
        self.num_updates = 3
        self.precision = type("P", (), {"scaler": None})()
        self.memory_stats = type("M", (), {"available": False})()
        self.ema = None  # no --store-ema

    def get_lr(self):
        return 0.001


def test_log_line_time_weights_tflops_and_keeps_the_order():
    from fairseq.logging.log_line import ORDER, log_train_interval

    name = f"test_throughput_{uuid.uuid4().hex}"
    trainer = _Trainer(Throughput(model_flops_per_token=1e9, world_size=4, peak_tflops=989.0))
    sums = {
        "loss": 8.0,
        "nll_loss": 8.0,
        "ntokens": 4e6,
        "nsentences": 8.0,
        "sample_size": 4e6,
        "updates": 1.0,
        "gnorm": 1.5,
        "train_wall": 2.0,
    }
    with metrics.aggregate(name):
        log_train_interval(trainer, sums, elapsed=2.0)  # 500 TFLOP/s per GPU
        log_train_interval(trainer, dict(sums, ntokens=1e6, sample_size=1e6), elapsed=1.0)  # 250 over 1 s
        values = metrics.get_smoothed_values(name)
    assert values["tflops"] == pytest.approx(round((500 * 2 + 250 * 1) / 3, 1)) == 416.7
    assert values["mfu"] == pytest.approx(round(100 * (500 * 2 + 250) / 3 / 989, 1))
    keys = list(values)
    assert keys[: keys.index("wps")] == ["loss", "ppl"]  # the criterion's keys first, as upstream
    ordered = [k for k in keys if k in ORDER]
    assert ordered == sorted(ordered, key=ORDER.get)
    assert ordered == ["wps", "ups", "wpb", "bsz", "num_updates", "lr", "gnorm", "train_wall", "tflops", "mfu"]
    metrics.reset_meters(name)
