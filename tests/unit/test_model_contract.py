"""The model contract (fairseq.models.fairseq_model): the registry enforces it, and FSDP, activation
checkpointing, the planner and tflops/mfu reach the model only through it."""

import pytest
import torch
from torch import nn

from fairseq import registry
from fairseq.distributed.fsdp import transformer_layers
from fairseq.distributed.parallelize import apply_activation_checkpointing
from fairseq.logging.throughput import matrix_weight_count
from fairseq.models import BaseFairseqModel, FairseqLanguageModel
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config


def tiny():
    cfg = preset_config("transformer_lm_gpt3_small", decoder_layers=2, decoder_embed_dim=16,
                        decoder_ffn_embed_dim=32, decoder_attention_heads=2, tokens_per_sample=8)
    return TransformerLanguageModel.build(cfg, vocab_size=40)


def test_registry_refuses_a_model_outside_the_contract():
    with pytest.raises(ValueError, match="must extend fairseq.models.fairseq_model.BaseFairseqModel"):
        registry.register_model("contract_test_plain_module")(nn.Module)
    assert "contract_test_plain_module" not in registry.MODEL_REGISTRY


def test_transformer_lm_follows_the_contract():
    model = tiny()
    assert isinstance(model, FairseqLanguageModel)
    assert transformer_layers(model) is model.decoder.layers and len(model.transformer_layers()) == 2
    assert model.max_positions() == 8
    # 6N + 12 L d T (Megatron's formula, as throughput.py documents)
    assert model.flops_per_token(8) == 6.0 * matrix_weight_count(model) + 12.0 * 2 * 16 * 8
    assert "decoder_attention_heads" in model.architecture_options


def test_parallelization_needs_the_contract():
    class NotAFairseqModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = nn.Module()
            self.decoder.layers = nn.ModuleList([nn.Linear(2, 2)])

    with pytest.raises(TypeError, match="does not follow the model contract"):
        transformer_layers(NotAFairseqModel())


def test_activation_checkpointing_wraps_the_contract_layers_in_place():
    model = tiny()
    tokens = torch.randint(4, 40, (2, 8))
    torch.manual_seed(0)
    expected = model(tokens)[0]
    apply_activation_checkpointing(model)
    assert all(type(layer).__name__ != "TransformerDecoderLayer" for layer in model.transformer_layers())
    assert torch.equal(model(tokens)[0], expected)  # dropout 0 in the gpt3 presets: the same function


def test_a_contract_model_without_layers_says_what_is_missing():
    class Incomplete(BaseFairseqModel):
        pass

    with pytest.raises(NotImplementedError, match="transformer_layers"):
        Incomplete().transformer_layers()
