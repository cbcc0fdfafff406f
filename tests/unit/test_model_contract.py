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
    cfg = preset_config(
        "transformer_lm_gpt3_small",
        decoder_layers=2,
        decoder_embed_dim=16,
        decoder_ffn_embed_dim=32,
        decoder_attention_heads=2,
        tokens_per_sample=8,
    )
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


@pytest.mark.parametrize("arch", ["transformer_lm", "fconv_lm"])
@pytest.mark.parametrize("shape, what", [((1, 0), "empty"), ((0, 4), "empty"), ((0,), "empty"), ((3,), "1-D")])
def test_a_forward_on_no_tokens_is_one_line_naming_the_input(arch, shape, what):
    """Not a reshape error from inside the first layer (transformer_lm) or a convolution (fconv_lm)."""
    if arch == "transformer_lm":
        model = tiny()
    else:
        from fairseq.models.fconv_lm import FConvLanguageModel, preset_config as fconv_config

        model = FConvLanguageModel.build(
            fconv_config("fconv_lm", decoder_layers="[(16, 3)] * 2", decoder_embed_dim=8), 30, 1
        )
    with pytest.raises(ValueError) as error:
        model(torch.zeros(shape, dtype=torch.long))
    assert str(error.value) == (
        f"the model's input tokens are {what} (shape {list(shape)}): pass ids of shape "
        "[batch, length] with at least one sentence of at least one token"
    )
    assert model(torch.tensor([[4, 5]]))[0].shape[:2] == (1, 2)  # the smallest input still runs
