"""fairseq.generation.decode_memory (the bytes a generation batch needs: weights, KV cache) on numbers, and
fairseq.generation.quantize's rules and choice of Linears, without a GPU (the quantized decoding itself:
tests/gpu/test_quantize_gpu.py)."""

import pytest
import torch
from torch import nn

from fairseq.generation.decode_memory import (
    attention_shape,
    check_decode_memory,
    decode_bytes,
    decode_memory_error,
    decode_positions,
    kv_cache_bytes,
    model_bytes,
    tensor_bytes,
)
from fairseq.generation.quantize import check_quantize, quantizable_linears
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig, preset_config


def test_kv_cache_bytes_of_the_13b_preset_at_batch_32():
    # 32 rows x (512 prompt + 256 new + the </s> generation starts from) x 24 layers x (key, value) x 2048 x bf16
    assert kv_cache_bytes(rows=32, positions=769, layers=24, embed_dim=2048, dtype_bytes=2) == 4_838_129_664
    assert kv_cache_bytes(rows=4 * 8, positions=769, layers=24, embed_dim=2048, dtype_bytes=2) == 4_838_129_664
    assert kv_cache_bytes(rows=1, positions=1, layers=1, embed_dim=1, dtype_bytes=4) == 8


def test_decode_positions_follow_the_generators_length_rule():
    assert decode_positions(512, 0, 768, 2049) == 769  # the prompt counts: max_len_b covers prompt + new tokens
    assert decode_positions(10, 1.5, 5, None) == 21  # int(1.5 * 10 + 5) tokens + </s>
    assert decode_positions(100, 0, 200, 32) == 32  # capped at the model's positions - 1, + </s>


def test_attention_shape_and_decode_bytes_of_a_preset_built_on_meta():
    with torch.device("meta"):
        model = TransformerLanguageModel.build(preset_config("transformer_lm_gpt3_xl"), 50272, 1)
    assert attention_shape(model) == (24, 2048)
    assert decode_bytes([model], rows=32, positions=769) == 2 * 4_838_129_664  # fp32: 4 bytes a value
    assert decode_bytes([model, model], rows=32, positions=769) == 4 * 4_838_129_664  # an ensemble: one cache each
    assert attention_shape(nn.Linear(4, 4)) == (0, 0)


def test_tensor_and_model_bytes_count_int8_weights_as_stored():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    linear = nn.Linear(64, 32).to(torch.bfloat16)
    assert model_bytes([linear]) == 32 * 64 * 2 + 32 * 2
    quantize_(linear, Int8WeightOnlyConfig(set_inductor_config=False))
    assert linear.weight.dtype == torch.bfloat16  # what the subclass says it is
    weight = linear.weight
    assert weight.qdata.dtype == torch.int8 and weight.scale.shape == weight.zero_point.shape == (32, 1)
    per_row = weight.scale.element_size() + weight.zero_point.element_size()  # one scale (and zero point) a row
    assert tensor_bytes(weight) == 32 * 64 + 32 * per_row  # 1 byte per value + the rows' scales
    assert model_bytes([linear]) == 32 * 64 + 32 * per_row + 32 * 2
    assert model_bytes([linear], device=torch.device("cpu")) == 0  # all there already
    shared = nn.Sequential(linear, linear)
    assert model_bytes([shared, linear]) == model_bytes([linear])  # each tensor once


def test_the_memory_error_on_numbers():
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False))  # 4 MiB of fp32 weights, no attention
    assert decode_memory_error([model], 1, 1, 10, available=4 * 2**20, where="cuda:0", fix="fix") is None
    assert decode_memory_error([model], 1, 1, 10, available=4 * 2**20 - 1, where="cuda:0", fix="fix") == (
        "a batch of 1 prompt(s) x beam 1 x 10 positions needs 0.00 GiB of KV cache (0 layers x 2 x 0 values per "
        "position) besides 0.00 GiB of weights, more than the 0.00 GiB cuda:0 has for this process (free + held by "
        "torch); fix"
    )
    with torch.device("meta"):
        xl = TransformerLanguageModel.build(preset_config("transformer_lm_gpt3_xl"), 50272, 1).to(torch.bfloat16)
    weights = model_bytes([xl])
    cache = 4 * 4_838_129_664  # 32 sentences x beam 4 x 769 positions in bf16
    fits = decode_memory_error([xl], 32, 4, 769, available=weights + cache, where="cuda:0", fix="fix")
    assert fits is None
    error = decode_memory_error(
        [xl],
        32,
        4,
        769,
        available=weights + cache - 1,
        where="cuda:0",
        fix="lower --batch-size / --max-tokens, --beam or --max-len-b",
    )
    assert error == (
        f"a batch of 32 prompt(s) x beam 4 x 769 positions needs 18.02 GiB of KV cache (24 layers x 2 "
        f"x 2048 values per position) besides {weights / 2**30:.2f} GiB of weights, more than the "
        f"{(weights + cache - 1) / 2**30:.2f} GiB cuda:0 has for this process (free + held by torch); "
        "lower --batch-size / --max-tokens, --beam or --max-len-b"
    )
    # the 1.3B preset in bf16: 1,313,660,928 parameters (the tied output projection once) and a 2-byte buffer
    assert weights == 2 * 1_313_660_928 + 2


def test_the_memory_check_is_skipped_off_cuda():
    with torch.device("meta"):
        model = TransformerLanguageModel.build(preset_config("transformer_lm_gpt3_xl"), 50272, 1)
    assert check_decode_memory([model], 10**6, 5, 2049, torch.device("cpu")) is None


def tiny(share):
    cfg = TransformerLanguageModelConfig(
        decoder_embed_dim=32,
        decoder_ffn_embed_dim=64,
        decoder_layers=2,
        decoder_attention_heads=2,
        share_decoder_input_output_embed=share,
    )
    return TransformerLanguageModel.build(cfg, 40, 1)


def test_a_tied_output_projection_is_not_quantized():
    tied, untied = quantizable_linears(tiny(True)), quantizable_linears(tiny(False))
    assert "decoder.output_projection" not in tied and "decoder.output_projection" in untied
    assert sorted(set(untied) - set(tied)) == ["decoder.output_projection"]
    assert len(tied) == sum(isinstance(m, nn.Linear) for m in tiny(True).modules()) - 1


def test_fconv_lm_has_no_linear_to_quantize():
    from fairseq.models.fconv_lm import FConvLanguageModel, preset_config as fconv_config

    # its weight-normed layers compute their weight in forward: quantize_for_generation refuses such a model
    assert quantizable_linears(FConvLanguageModel.build(fconv_config("fconv_lm"), 100, 1)) == []


@pytest.mark.parametrize(
    "dtype, keyword, message",
    [
        (
            torch.float16,
            False,
            "--quantize int8-weight-only needs a bf16 model (int8 decoding is built and measured for "
            "bf16 models): pass --bf16",
        ),
        (
            torch.float32,
            False,
            "--quantize int8-weight-only needs a bf16 model (an fp32 model gains nothing from int8 "
            "weights): pass --bf16",
        ),
        (
            torch.float32,
            True,
            "quantize='int8-weight-only' needs a bf16 model (an fp32 model gains nothing from int8 "
            "weights): cast it with lm.to(torch.bfloat16)",
        ),
    ],
)
def test_quantize_needs_bf16(dtype, keyword, message):
    with pytest.raises(ValueError) as error:
        check_quantize("int8-weight-only", torch.device("cuda"), dtype, keyword=keyword)  # only its type is read
    assert str(error.value) == message
    assert check_quantize("int8-weight-only", torch.device("cuda"), torch.bfloat16) is None
    assert check_quantize("none", torch.device("cpu"), torch.float32) is None
