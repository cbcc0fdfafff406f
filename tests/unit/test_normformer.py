"""NormFormer on transformer_lm (--scale-attn, --scale-fc, --scale-heads, --scale-resids): the layer computes what
upstream's TransformerDecoderLayer computes (written out below, time first, with upstream's MultiheadAttention
on the same weights), under upstream's parameter names; training, resuming, incremental decoding, the
tensor-parallel plan's refusals and the export's."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from fairseq import options
from fairseq.checkpoint.legacy import upgrade_state_dict
from fairseq.frontend.validate import validate
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config
from fairseq.modules import MultiheadAttention, TransformerDecoderLayer
from tests.train_fixtures import train_in_process

FLAGS = ("scale_attn", "scale_fc", "scale_heads", "scale_resids")
C, H, FFN = 16, 4, 32


def upstream_layer_forward(layer, x, normalize_before):
    """Upstream's NormFormer decoder layer on x [T, B, C] (causal self-attention, dropout off)."""
    attn = MultiheadAttention(C, H, self_attention=True).double()
    attn.load_state_dict(layer.self_attn.state_dict())
    causal = torch.full((x.size(0), x.size(0)), float("-inf"), dtype=x.dtype).triu(1)
    residual = x
    if normalize_before:
        x = layer.self_attn_layer_norm(x)
    x, _ = attn(query=x, key=x, value=x, need_weights=False, attn_mask=causal)
    if layer.c_attn is not None:
        t, b = x.size(0), x.size(1)
        x = torch.einsum("tbhd,h->tbhd", x.view(t, b, H, C // H), layer.c_attn).reshape(t, b, C)
    if layer.attn_ln is not None:
        x = layer.attn_ln(x)
    x = residual + x
    if not normalize_before:
        x = layer.self_attn_layer_norm(x)
    residual = x
    if normalize_before:
        x = layer.final_layer_norm(x)
    x = F.relu(layer.fc1(x))
    if layer.ffn_layernorm is not None:
        x = layer.ffn_layernorm(x)
    x = layer.fc2(x)
    if layer.w_resid is not None:
        residual = torch.mul(layer.w_resid, residual)
    x = residual + x
    if not normalize_before:
        x = layer.final_layer_norm(x)
    return x


@pytest.mark.parametrize("normalize_before", [True, False])
@pytest.mark.parametrize("on", [FLAGS] + [(flag,) for flag in FLAGS])
def test_layer_computes_upstreams_normformer(normalize_before, on):
    torch.manual_seed(0)
    layer = (
        TransformerDecoderLayer(
            C, H, FFN, dropout=0.0, normalize_before=normalize_before, **{flag: True for flag in on}
        )
        .double()
        .eval()
    )
    with torch.no_grad():  # scales and norms away from their initial values
        for name, param in layer.named_parameters():
            if name in ("c_attn", "w_resid") or "attn_ln" in name or "ffn_layernorm" in name:
                param.uniform_(0.5, 1.5)
    x = torch.randn(2, 6, C, dtype=torch.float64)
    with torch.no_grad():
        want = upstream_layer_forward(layer, x.transpose(0, 1), normalize_before).transpose(0, 1)
        torch.testing.assert_close(layer(x), want)


def test_parameters_have_upstreams_names_and_start_at_one():
    layer = TransformerDecoderLayer(C, H, FFN, scale_attn=True, scale_fc=True, scale_heads=True, scale_resids=True)
    plain = TransformerDecoderLayer(C, H, FFN)
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items() if k not in plain.state_dict()}
    assert shapes == {
        "attn_ln.weight": (C,),
        "attn_ln.bias": (C,),
        "c_attn": (H,),
        "ffn_layernorm.weight": (FFN,),
        "ffn_layernorm.bias": (FFN,),
        "w_resid": (C,),
    }
    with torch.no_grad():
        layer.c_attn.zero_()
        layer.w_resid.zero_()
    layer.reset_parameters()
    assert torch.equal(layer.c_attn, torch.ones(H)) and torch.equal(layer.w_resid, torch.ones(C))
    assert "attn_ln" in layer.tensor_parallel_styles() and "attn_ln" not in plain.tensor_parallel_styles()


def build(**flags):
    cfg = preset_config(
        "transformer_lm",
        decoder_layers=2,
        decoder_embed_dim=C,
        decoder_ffn_embed_dim=FFN,
        decoder_attention_heads=H,
        dropout=0.0,
        tokens_per_sample=16,
        **flags,
    )
    torch.manual_seed(0)
    return cfg, TransformerLanguageModel.build(cfg, 24, 1).eval()


def test_model_decodes_incrementally_as_it_computes_in_full():
    cfg, model = build(**{flag: True for flag in FLAGS}, decoder_normalize_before=True)
    assert (
        "NormFormer (--scale-attn --scale-fc --scale-heads --scale-resids)"
        in TransformerLanguageModel.describe_config(cfg)
    )
    tokens = torch.randint(4, 24, (2, 9))
    with torch.no_grad():
        full, _ = model(tokens)
        state, steps = {}, []
        for t in (4, 6, 7, 8, 9):  # a prompt of 4 tokens, then more
            steps.append(model(tokens[:, :t], incremental_state=state)[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def tp_config(*flags):
    parser = options.get_training_parser()
    return options.convert_namespace_to_config(
        options.parse_args_and_arch(
            parser,
            [
                "data",
                "--arch",
                "transformer_lm_gpt",
                "--decoder-layers",
                "2",
                "--decoder-embed-dim",
                "32",
                "--decoder-ffn-embed-dim",
                "64",
                "--decoder-attention-heads",
                "4",
                "--optimizer",
                "adam",
                "--lr",
                "0.001",
                "--tokens-per-sample",
                "32",
                "--max-tokens",
                "64",
                "--ddp-backend",
                "fully_sharded",
                "--model-parallel-size",
                "2",
                *flags,
            ],
        )
    )


@pytest.mark.parametrize("flag", ["--scale-fc", "--scale-heads", "--scale-resids"])
def test_tensor_parallelism_refuses_what_its_plan_does_not_split(flag):
    with pytest.raises(ValueError, match=f"{flag} is not supported with --model-parallel-size 2: drop one of them"):
        validate(tp_config(flag))
    validate(tp_config("--scale-attn"))  # a norm of the sequence-split stream: in the plan
    # (tests/distributed/test_normformer_tensor_parallel.py trains it on 2 processes)


def test_trains_resumes_only_as_itself_evaluates_and_is_not_exported(tiny_data, tmp_path, train_args, capsys):
    from fairseq.export.hf import choose_model_type, load_source

    flags = ["--scale-attn", "--scale-fc", "--scale-heads", "--scale-resids"]
    status, out, err = train_in_process(train_args(tiny_data, tmp_path, *flags, max_update=3))
    assert status == 0, err
    assert "NormFormer (--scale-attn --scale-fc --scale-heads --scale-resids)" in out
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert {
        "decoder.layers.1.c_attn",
        "decoder.layers.1.w_resid",
        "decoder.layers.0.attn_ln.weight",
        "decoder.layers.0.ffn_layernorm.bias",
    } <= set(state["model"])
    assert state["cfg"]["model"]["scale_fc"] is True
    status, _, err = train_in_process(train_args(tiny_data, tmp_path, *flags[:3], max_update=4))
    assert status != 0 and "--scale-resids" in err  # another network: refused by name
    with pytest.raises(
        ValueError,
        match=r"NormFormer's --scale-attn --scale-fc --scale-heads --scale-resids "
        r"\(extra norms and learned scales in each layer\) have no equivalent in OPT "
        "or XGLM",
    ):
        choose_model_type(load_source(str(tmp_path / "checkpoint_last.pt")), "opt")


@pytest.mark.parametrize("flags", list(itertools.combinations(FLAGS, 2))[:2])
def test_upstream_state_dicts_load(flags):
    """An upstream NormFormer state dict (the same names) loads strictly into the model the flags build."""
    _, model = build(**{flag: True for flag in flags})
    _, again = build(**{flag: True for flag in flags})
    upstream = {k: v + 0.5 if k.endswith(("c_attn", "w_resid")) else v for k, v in model.state_dict().items()}
    again.load_state_dict(upgrade_state_dict(TransformerLanguageModel, upstream), strict=True)
    assert all(torch.equal(again.state_dict()[k], upstream[k]) for k in upstream)
