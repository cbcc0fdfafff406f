"""transformer_lm's architecture presets (`--arch transformer_lm*`; the list is in fairseq.models.transformer_lm's
docstring): upstream's functions of an argparse namespace or config, each filling the hyper-parameters still unset,
in upstream's order. `PRESETS` maps each architecture name to its function; fairseq.models.transformer_lm
registers them under the model (and re-exports the functions under upstream's import path).
"""

import logging
from typing import Callable, Dict

from fairseq.dataclass.flag_values import fill_missing
from fairseq.dataclass.utils import flag_name

logger = logging.getLogger(__name__)


def _force(args, name: str, value) -> None:
    # Upstream sets a few values whatever the command line says; mirrored so that the same command
    # line builds the same model, but never silently.
    if hasattr(args, name) and getattr(args, name) != value:
        logger.warning(
            f"{flag_name(name)} {getattr(args, name)!r} is overridden to {value!r} by the "
            f"architecture preset (as in upstream fairseq)"
        )
    setattr(args, name, value)


def transformer_lm(args) -> None:
    """Upstream registers the bare model name as a no-op preset: the config defaults apply as they are, so unset
    input/output dims stay 512 whatever the embed dim (upstream 0.12.2 builds project_in/out then; training says
    so: TransformerLanguageModel.config_notice)."""


def base_lm_architecture(args) -> None:
    fill_missing(
        args,
        dropout=0.1,
        attention_dropout=0.0,
        decoder_embed_dim=512,
        decoder_ffn_embed_dim=2048,
        decoder_layers=6,
        decoder_attention_heads=8,
        adaptive_softmax_cutoff=None,
        adaptive_softmax_dropout=0.0,
        adaptive_softmax_factor=4.0,
        decoder_learned_pos=False,
        activation_fn="relu",
        decoder_layerdrop=0.0,
        decoder_layers_to_keep=None,
        quant_noise_pq=0.0,
        quant_noise_pq_block_size=8,
        quant_noise_scalar=0.0,
        base_layers=0,
        add_bos_token=False,
        no_token_positional_embeddings=False,
        share_decoder_input_output_embed=False,
        character_embeddings=False,
    )
    fill_missing(args, decoder_output_dim=args.decoder_embed_dim, decoder_input_dim=args.decoder_embed_dim)
    _force(args, "decoder_normalize_before", True)  # upstream: "training is not stable without this"
    fill_missing(
        args,
        no_decoder_final_norm=False,
        adaptive_input=False,
        adaptive_input_factor=4.0,
        adaptive_input_cutoff=None,
        tie_adaptive_weights=False,
        tie_adaptive_proj=False,
        no_scale_embedding=False,
        layernorm_embedding=False,
        checkpoint_activations=False,
        offload_activations=False,
        scale_fc=False,
        scale_attn=False,
        scale_heads=False,
        scale_resids=False,
    )
    if args.offload_activations:
        args.checkpoint_activations = True


def transformer_lm_big(args) -> None:
    fill_missing(
        args, decoder_layers=12, decoder_embed_dim=1024, decoder_ffn_embed_dim=4096, decoder_attention_heads=16
    )
    base_lm_architecture(args)


def transformer_lm_baevski_wiki103(args) -> None:
    fill_missing(
        args,
        decoder_layers=16,
        decoder_attention_heads=8,
        dropout=0.3,
        adaptive_input=True,
        tie_adaptive_weights=True,
        adaptive_input_cutoff="20000,60000",
        adaptive_softmax_cutoff="20000,60000",
        adaptive_softmax_dropout=0.2,
        attention_dropout=0.1,
        activation_dropout=0.1,
        no_decoder_final_norm=True,
        tie_adaptive_proj=True,
    )
    transformer_lm_big(args)


def transformer_lm_baevski_gbw(args) -> None:
    fill_missing(args, decoder_embed_dim=512, dropout=0.1, attention_dropout=0.1, no_decoder_final_norm=True)
    transformer_lm_big(args)


def _gpt_family(args, embed_dim: int, ffn_dim: int, layers: int, heads: int) -> None:
    # Upstream's GPT / GPT-2 presets differ only in these four numbers.
    fill_missing(
        args,
        decoder_embed_dim=embed_dim,
        decoder_ffn_embed_dim=ffn_dim,
        decoder_layers=layers,
        decoder_attention_heads=heads,
        dropout=0.1,
        attention_dropout=0.1,
        activation_fn="gelu",
    )
    base_lm_architecture(args)


_GPT_SIZES = {  # name: (embed dim, ffn dim, layers, heads)
    "transformer_lm_gpt": (768, 3072, 12, 12),
    "transformer_lm_gpt2_tiny": (64, 64, 2, 1),
    "transformer_lm_gpt2_small": (1024, 4096, 24, 16),
    "transformer_lm_gpt2_medium": (1280, 5120, 36, 20),
    "transformer_lm_gpt2_big": (1600, 6400, 48, 25),
    "transformer_lm_gpt2_big_wide": (2048, 8192, 24, 32),
    "transformer_lm_gpt2_bigger": (2048, 8192, 48, 32),
}


def base_gpt3_architecture(args) -> None:
    _force(args, "decoder_input_dim", args.decoder_embed_dim)
    _force(args, "decoder_output_dim", args.decoder_embed_dim)
    fill_missing(
        args,
        decoder_ffn_embed_dim=args.decoder_embed_dim * 4,
        decoder_learned_pos=True,
        dropout=0.0,
        attention_dropout=0.0,
        activation_fn="gelu",
    )
    _force(args, "share_decoder_input_output_embed", True)
    base_lm_architecture(args)


_GPT3_SIZES = {  # name: (layers, embed dim, heads); _30 and _66 are OPT sizes upstream lacks
    "transformer_lm_gpt3_small": (12, 768, 12),
    "transformer_lm_gpt3_medium": (24, 1024, 16),
    "transformer_lm_gpt3_large": (24, 1536, 16),
    "transformer_lm_gpt3_xl": (24, 2048, 32),
    "transformer_lm_gpt3_2_7": (32, 2560, 32),
    "transformer_lm_gpt3_6_7": (32, 4096, 32),
    "transformer_lm_gpt3_13": (40, 5120, 40),
    "transformer_lm_gpt3_30": (48, 7168, 56),
    "transformer_lm_gpt3_66": (64, 9216, 72),
    "transformer_lm_gpt3_175": (96, 12288, 96),
}


def _sized_presets() -> Dict[str, Callable]:
    """One preset function per size of the two tables, named after its architecture."""
    presets = {}
    for arch, (embed_dim, ffn_dim, layers, heads) in _GPT_SIZES.items():

        def gpt_preset(args, _dims=(embed_dim, ffn_dim, layers, heads)):
            _gpt_family(args, *_dims)

        gpt_preset.__name__ = gpt_preset.__qualname__ = arch
        presets[arch] = gpt_preset
    for arch, (layers, embed_dim, heads) in _GPT3_SIZES.items():

        def gpt3_preset(args, _dims=(layers, embed_dim, heads)):
            fill_missing(args, decoder_layers=_dims[0], decoder_embed_dim=_dims[1], decoder_attention_heads=_dims[2])
            base_gpt3_architecture(args)

        gpt3_preset.__name__ = gpt3_preset.__qualname__ = arch
        presets[arch] = gpt3_preset
    return presets


# Upstream's Megatron presets (its model_parallel transformer_lm; --model-parallel-size splits them here by
# the model's tensor_parallel_plan): 72 x 3072, 32 heads, gelu, dropout 0.1 in both places, then
# base_lm_architecture (pre-norm, sinusoidal positions). megatron_11b is upstream's 11B recipe (ffn 6 x d).
def _megatron(args, ffn_factor: int) -> None:
    fill_missing(
        args,
        decoder_embed_dim=3072,
        decoder_ffn_embed_dim=3072 * ffn_factor,
        decoder_layers=72,
        decoder_attention_heads=32,
        dropout=0.1,
        attention_dropout=0.1,
        activation_fn="gelu",
    )
    base_lm_architecture(args)


def transformer_lm_megatron(args) -> None:
    _megatron(args, ffn_factor=4)


def transformer_lm_megatron_11b(args) -> None:
    _megatron(args, ffn_factor=6)


# Architecture name -> preset, in upstream's order of registration.
PRESETS: Dict[str, Callable] = {
    "transformer_lm": transformer_lm,
    "transformer_lm_big": transformer_lm_big,
    "transformer_lm_baevski_wiki103": transformer_lm_baevski_wiki103,
    "transformer_lm_wiki103": transformer_lm_baevski_wiki103,
    "transformer_lm_baevski_gbw": transformer_lm_baevski_gbw,
    "transformer_lm_gbw": transformer_lm_baevski_gbw,
    **_sized_presets(),
    "transformer_lm_megatron": transformer_lm_megatron,
    "transformer_lm_megatron_11b": transformer_lm_megatron_11b,
}
