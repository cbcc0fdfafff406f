"""Decoder-only transformer language models (`--arch transformer_lm*`), compatible with upstream fairseq.

Flag names, defaults and architecture presets are upstream's, so the same command line builds a model
with the same parameter names and shapes, and upstream state dicts load (fairseq.checkpoint.legacy.upgrade_transformer_lm maps their names).

Presets (`--arch`; fairseq.models.transformer_lm_presets), each filling only what the command line leaves unset:

- `transformer_lm`: the config defaults as they stand (upstream registers the bare name as a no-op preset):
  6 x 512, ffn 2048, 8 heads, sinusoidal positions, post-norm, no final layer norm, and
  `--decoder-input-dim`/`--decoder-output-dim` 512 whatever `--decoder-embed-dim` says: another embed dim
  adds the bias-free `project_in_dim` (input dim -> embed dim) and `project_out_dim` (embed dim -> output
  dim) unless both dims are given (a one-line notice says so when the preset runs).
- every other preset goes through upstream's `base_lm_architecture`, which forces pre-norm
  (`decoder_normalize_before = True`, upstream's "training is not stable without this") and derives the
  input/output dims from the embed dim:
  `transformer_lm_big` (12 x 1024, ffn 4096, 16 heads), `transformer_lm_gbw` / `transformer_lm_baevski_gbw`
  (big at 512, no final norm), `transformer_lm_wiki103` / `transformer_lm_baevski_wiki103` (big with 16
  layers, adaptive input and softmax at cutoffs 20000,60000 with tied weights and projections, dropout 0.3);
  `transformer_lm_gpt` (12 x 768), `transformer_lm_gpt2_tiny/small/medium/big/big_wide/bigger`;
- GPT-3 family (learned positions, gelu, dropout 0, ffn 4 x d, shared input/output embeddings, input and
  output dims forced to the embed dim): `transformer_lm_gpt3_small` (125M: 12 x 768, 12 heads),
  `_medium` (350M: 24 x 1024, 16), `_large` (760M: 24 x 1536, 16), `_xl` (1.3B: 24 x 2048, 32),
  `_2_7` (32 x 2560, 32), `_6_7` (32 x 4096, 32), `_13` (40 x 5120, 40), `_175` (96 x 12288, 96), and two
  OPT sizes upstream lacks: `transformer_lm_gpt3_30` (30B: 48 x 7168, 56 heads) and
  `transformer_lm_gpt3_66` (66B: 64 x 9216, 72 heads).

Adaptive input (`--adaptive-input`, fairseq.modules.adaptive_input) replaces the token embedding and
adaptive softmax (`--adaptive-softmax-cutoff`, fairseq.modules.adaptive_softmax) the output projection,
under upstream's parameter names. With an adaptive softmax the model's output is its log-probabilities
(a log-softmax leaves them unchanged, so every consumer of logits works as is); `--criterion adaptive_loss`
asks for the features (`features_only=True`) and scores only each target's band.

The model holds no distributed or precision code: activation checkpointing (`--checkpoint-activations`),
compilation and FSDP are applied per layer from outside.
"""

import logging
from dataclasses import dataclass
from typing import Literal, Optional, Tuple

import torch

from fairseq import registry
from fairseq.dataclass.configs import II, opt
from fairseq.dataclass import build
from fairseq.dataclass.utils import flag_name
from fairseq.logging.throughput import flops_per_token as transformer_flops_per_token
from fairseq.models.fairseq_model import FairseqLanguageModel, TensorParallelPlan, TensorParallelSizes
from fairseq.modules.adaptive_input import AdaptiveInput, parse_cutoffs
from fairseq.modules.transformer_decoder import TransformerDecoder
from fairseq.models.transformer_lm_presets import (  # noqa: F401 (upstream's names, imported from here)
    PRESETS,
    base_gpt3_architecture,
    base_lm_architecture,
    transformer_lm,
    transformer_lm_baevski_gbw,
    transformer_lm_baevski_wiki103,
    transformer_lm_big,
    transformer_lm_megatron,
    transformer_lm_megatron_11b,
)
from fairseq.upstream_absent import refused_options

logger = logging.getLogger(__name__)

DEFAULT_MAX_TARGET_POSITIONS = 1024

ACTIVATION_CHOICES = Literal["relu", "gelu", "gelu_fast", "gelu_accurate", "tanh", "linear"]


@dataclass
class TransformerLanguageModelConfig:
    activation_fn: ACTIVATION_CHOICES = opt("relu", "activation function to use")
    dropout: float = opt(0.1, "dropout probability")
    attention_dropout: float = opt(0.0, "dropout probability for attention weights")
    activation_dropout: float = opt(0.0, "dropout probability after the activation in the FFN")
    relu_dropout: float = opt(0.0, "old name of --activation-dropout, used when that is 0")
    decoder_embed_dim: int = opt(512, "decoder embedding dimension")
    decoder_output_dim: int = opt(
        512,
        "decoder output dimension (the presets but bare transformer_lm default it to --decoder-embed-dim; "
        "another value than the embed dim adds project_out_dim)",
    )
    decoder_input_dim: int = opt(
        512,
        "decoder input dimension (the presets but bare transformer_lm default it to --decoder-embed-dim; "
        "another value than the embed dim adds project_in_dim)",
    )
    decoder_ffn_embed_dim: int = opt(2048, "decoder embedding dimension for FFN")
    decoder_layers: int = opt(6, "number of decoder layers")
    decoder_attention_heads: int = opt(8, "number of decoder attention heads")
    decoder_normalize_before: bool = opt(False, "apply layernorm before each decoder block")
    no_decoder_final_norm: bool = opt(False, "don't add an extra layernorm after the last decoder block")
    no_token_positional_embeddings: bool = opt(False, "disable positional embeddings")
    share_decoder_input_output_embed: bool = opt(False, "share decoder input and output embeddings")
    decoder_learned_pos: bool = opt(False, "use learned positional embeddings in the decoder")
    layernorm_embedding: bool = opt(False, "add layernorm to embedding")
    no_scale_embedding: bool = opt(False, "do not scale embeddings by sqrt(embed dim)")
    checkpoint_activations: bool = opt(False, "checkpoint activations at each layer (recompute in backward)")
    offload_activations: bool = opt(False, "move checkpointed activations to CPU (implies --checkpoint-activations)")
    # The task's options, copied from there when the config is built (upstream keeps them here too, so saved
    # configs hold them); the model reads max_target_positions, else tokens_per_sample.
    add_bos_token: Optional[bool] = II("task.add_bos_token")
    tokens_per_sample: Optional[int] = II("task.tokens_per_sample")
    max_target_positions: Optional[int] = II("task.max_target_positions")
    adaptive_softmax_cutoff: Optional[str] = opt(
        None, "comma separated list of adaptive softmax cutoffs, e.g. 20000,60000 (use with --criterion adaptive_loss)"
    )
    adaptive_softmax_dropout: float = opt(0.0, "dropout of the adaptive softmax's input and tail projections")
    adaptive_softmax_factor: float = opt(4.0, "adaptive softmax: tail i projects to dim // factor**(i+1)")
    adaptive_input: bool = opt(False, "adaptive input embeddings (bands of the vocabulary at smaller widths)")
    adaptive_input_factor: float = opt(4.0, "adaptive input: band i is embedded at --decoder-input-dim // factor**i")
    adaptive_input_cutoff: Optional[str] = opt(None, "comma separated list of adaptive input cutoffs")
    tie_adaptive_weights: bool = opt(False, "share the adaptive input's tables with the adaptive softmax")
    tie_adaptive_proj: bool = opt(False, "share the adaptive input's projections with the adaptive softmax tails")
    # Upstream features this project does not implement: accepted at their defaults, rejected when set.
    character_embeddings: bool = opt(False, "not supported: character CNN token embeddings")
    decoder_layerdrop: float = opt(0.0, "not supported: LayerDrop probability")
    decoder_layers_to_keep: Optional[str] = opt(None, "not supported: layers to keep when pruning")
    quant_noise_pq: float = opt(0.0, "not supported: iterative PQ quantization noise")
    quant_noise_pq_block_size: int = opt(8, "not supported: block size of PQ quantization noise")
    quant_noise_scalar: float = opt(0.0, "not supported: scalar quantization noise")
    base_layers: int = opt(0, "not supported: number of BASE layers")
    # NormFormer (https://arxiv.org/abs/2110.09456), upstream's options and parameter names (TransformerDecoderLayer)
    scale_fc: bool = opt(False, "NormFormer: layer norm of the FFN's activations, between fc1 and fc2 (ffn_layernorm)")
    scale_attn: bool = opt(False, "NormFormer: layer norm of the attention's output, before the residual (attn_ln)")
    scale_heads: bool = opt(False, "NormFormer: a learned scale per attention head (c_attn)")
    scale_resids: bool = opt(False, "NormFormer: a learned scale of the FFN block's residual (w_resid)")


# Upstream features that are not implemented here (the one table).
_UNSUPPORTED = refused_options("transformer_lm")


def check_config(cfg) -> None:
    """Reject configurations this model cannot build, naming the flag and what to do instead."""
    for name, is_set, _ in _UNSUPPORTED:
        value = getattr(cfg, name, None)
        if value is not None and is_set(value):
            raise ValueError(
                f"{flag_name(name)} {value!r} is not supported by this fairseq; leave {flag_name(name)} at its default"
            )
    for name in (
        "decoder_embed_dim",
        "decoder_input_dim",
        "decoder_output_dim",
        "decoder_ffn_embed_dim",
        "decoder_attention_heads",
    ):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{flag_name(name)} must be positive, got {getattr(cfg, name)}")
    if cfg.decoder_layers < 0:
        raise ValueError(f"--decoder-layers must be >= 0, got {cfg.decoder_layers}")
    if cfg.decoder_embed_dim % cfg.decoder_attention_heads != 0:
        raise ValueError(
            f"--decoder-embed-dim {cfg.decoder_embed_dim} is not divisible by --decoder-attention-heads "
            f"{cfg.decoder_attention_heads}; pick a head count that divides the embedding dim"
        )
    if cfg.share_decoder_input_output_embed and cfg.decoder_input_dim != cfg.decoder_output_dim:
        raise ValueError(
            "--share-decoder-input-output-embed needs --decoder-input-dim == --decoder-output-dim "
            f"(got {cfg.decoder_input_dim} and {cfg.decoder_output_dim}); set them equal or drop the flag"
        )
    for name in ("dropout", "attention_dropout", "activation_dropout", "relu_dropout"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ValueError(f"{flag_name(name)} must be in [0, 1), got {getattr(cfg, name)}")
    check_adaptive_config(cfg)
    max_positions = resolve_max_target_positions(cfg)
    if max_positions <= 0:
        raise ValueError(f"--max-target-positions / --tokens-per-sample must be positive, got {max_positions}")


def check_adaptive_config(cfg) -> None:
    """Adaptive input/softmax options: cutoffs that parse, upstream's tying rules (which upstream asserts),
    and combinations that would build something other than what was asked."""
    input_cutoffs = parse_cutoffs(cfg.adaptive_input_cutoff, "--adaptive-input-cutoff")
    softmax_cutoffs = parse_cutoffs(cfg.adaptive_softmax_cutoff, "--adaptive-softmax-cutoff")
    if cfg.adaptive_input and input_cutoffs is None:
        raise ValueError("--adaptive-input needs --adaptive-input-cutoff (e.g. 20000,60000)")
    if input_cutoffs is not None and not cfg.adaptive_input:
        logger.warning(f"--adaptive-input-cutoff {cfg.adaptive_input_cutoff} has no effect without --adaptive-input")
    for name, used in (
        ("adaptive_input_factor", cfg.adaptive_input),
        ("adaptive_softmax_factor", softmax_cutoffs is not None),
    ):
        if used and getattr(cfg, name) <= 0:
            raise ValueError(f"{flag_name(name)} must be positive, got {getattr(cfg, name)}")
    if not 0.0 <= cfg.adaptive_softmax_dropout < 1.0:
        raise ValueError(f"--adaptive-softmax-dropout must be in [0, 1), got {cfg.adaptive_softmax_dropout}")
    if cfg.share_decoder_input_output_embed and (cfg.adaptive_input or softmax_cutoffs is not None):
        raise ValueError(
            "--share-decoder-input-output-embed shares a full embedding matrix, which adaptive input "
            "/ softmax do not have; use --tie-adaptive-weights (and --tie-adaptive-proj) instead"
        )
    if cfg.tie_adaptive_weights:
        if not cfg.adaptive_input or softmax_cutoffs is None:
            raise ValueError("--tie-adaptive-weights needs both --adaptive-input and --adaptive-softmax-cutoff")
        if input_cutoffs != softmax_cutoffs:
            raise ValueError(
                f"--tie-adaptive-weights needs --adaptive-input-cutoff ({cfg.adaptive_input_cutoff}) "
                f"equal to --adaptive-softmax-cutoff ({cfg.adaptive_softmax_cutoff})"
            )
        if cfg.adaptive_input_factor != cfg.adaptive_softmax_factor:
            raise ValueError(
                f"--tie-adaptive-weights needs --adaptive-input-factor ({cfg.adaptive_input_factor}) "
                f"equal to --adaptive-softmax-factor ({cfg.adaptive_softmax_factor})"
            )
        if cfg.decoder_input_dim != cfg.decoder_output_dim:
            raise ValueError(
                "--tie-adaptive-weights needs --decoder-input-dim == --decoder-output-dim "
                f"(got {cfg.decoder_input_dim} and {cfg.decoder_output_dim})"
            )
        if cfg.decoder_output_dim != cfg.decoder_embed_dim:
            # The tails start from the adaptive input's projections, whose rows are the embed dim.
            raise ValueError(
                "--tie-adaptive-weights needs --decoder-output-dim == --decoder-embed-dim "
                f"(got {cfg.decoder_output_dim} and {cfg.decoder_embed_dim})"
            )
    elif cfg.tie_adaptive_proj:
        logger.warning("--tie-adaptive-proj has no effect without --tie-adaptive-weights (as in upstream)")


def _normformer(cfg) -> str:
    flags = [
        flag
        for flag, on in (
            ("--scale-attn", cfg.scale_attn),
            ("--scale-fc", cfg.scale_fc),
            ("--scale-heads", cfg.scale_heads),
            ("--scale-resids", cfg.scale_resids),
        )
        if on
    ]
    return f", NormFormer ({' '.join(flags)})" if flags else ""


def uses_adaptive_modules(cfg) -> bool:
    return bool(cfg.adaptive_input) or cfg.adaptive_softmax_cutoff is not None


def resolve_max_target_positions(cfg) -> int:
    """--max-target-positions, else --tokens-per-sample, else upstream's 1024."""
    if cfg.max_target_positions is not None:
        return cfg.max_target_positions
    return cfg.tokens_per_sample if cfg.tokens_per_sample is not None else DEFAULT_MAX_TARGET_POSITIONS


@registry.register_model("transformer_lm", dataclass=TransformerLanguageModelConfig)
class TransformerLanguageModel(FairseqLanguageModel):
    """`model(src_tokens) -> (logits [B, T, V], extra)`; the layers are `model.decoder.layers` (an nn.ModuleList)."""

    # Options that define the function the network computes: a resumed run must keep them (checked against the
    # checkpoint's config; several change no parameter shape, so the state dict alone would not tell). Tying
    # (--share-decoder-input-output-embed) may change with --reset-optimizer: the same weights, untied.
    architecture_options = (
        "decoder_layers",
        "decoder_embed_dim",
        "decoder_input_dim",
        "decoder_output_dim",
        "decoder_ffn_embed_dim",
        "decoder_attention_heads",
        "decoder_normalize_before",
        "no_decoder_final_norm",
        "no_token_positional_embeddings",
        "decoder_learned_pos",
        "layernorm_embedding",
        "no_scale_embedding",
        "activation_fn",
        "max_target_positions",
        "adaptive_input",
        "adaptive_input_factor",
        "adaptive_input_cutoff",
        "adaptive_softmax_cutoff",
        "adaptive_softmax_factor",
        "tie_adaptive_weights",
        "tie_adaptive_proj",
        "scale_fc",
        "scale_attn",
        "scale_heads",
        "scale_resids",
    )

    def __init__(self, decoder: TransformerDecoder):
        super().__init__(decoder)

    @classmethod
    def check_config(cls, cfg) -> None:
        check_config(cfg)

    @classmethod
    def describe_config(cls, cfg) -> str:
        positions = (
            "no positions"
            if cfg.no_token_positional_embeddings
            else f"{'learned' if cfg.decoder_learned_pos else 'sinusoidal'} positions "
            f"({resolve_max_target_positions(cfg)})"
        )
        adaptive = (f", adaptive input {cfg.adaptive_input_cutoff}" if cfg.adaptive_input else "") + (
            f", adaptive softmax {cfg.adaptive_softmax_cutoff}" if cfg.adaptive_softmax_cutoff else ""
        )
        return (
            f"{cfg.decoder_layers} layers, embed dim {cfg.decoder_embed_dim} (input {cfg.decoder_input_dim}, "
            f"output {cfg.decoder_output_dim}), ffn {cfg.decoder_ffn_embed_dim}, "
            f"{cfg.decoder_attention_heads} heads, {positions}, "
            f"{'pre' if cfg.decoder_normalize_before else 'post'}-norm, {cfg.activation_fn}"
            + (", shared input/output embeddings" if cfg.share_decoder_input_output_embed else "")
            + adaptive
            + _normformer(cfg)
        )

    @classmethod
    def config_notice(cls, cfg) -> str:
        """Bare transformer_lm with input/output dims of 512 (upstream's default) beside another embed dim: which
        projections that adds and the flags that drop them; "" otherwise."""
        if registry.config_name(cfg) != "transformer_lm" or cfg.decoder_embed_dim == 512:
            return ""
        sides = [side for side in ("input", "output") if getattr(cfg, f"decoder_{side}_dim") == 512]
        if not sides:
            return ""
        dim = cfg.decoder_embed_dim
        return (
            f"{'/'.join(sides)} dim{'s' if len(sides) > 1 else ''} 512 (upstream's default) with embed dim {dim}: "
            f"adds project_{'/'.join({'input': 'in', 'output': 'out'}[side] for side in sides)}; pass "
            f"{' '.join(f'--decoder-{side}-dim {dim}' for side in sides)} to drop "
            f"{'them' if len(sides) > 1 else 'it'}"
        )

    @classmethod
    def build_model(cls, cfg, task) -> "TransformerLanguageModel":
        dictionary = task.source_dictionary
        return cls.build(cfg, len(dictionary), dictionary.pad(), output_vocab_size=len(task.target_dictionary))

    @classmethod
    def build(
        cls, cfg, vocab_size: int, padding_idx: int = 1, output_vocab_size: Optional[int] = None
    ) -> "TransformerLanguageModel":
        """Build from a config and a vocabulary size. Works under `with torch.device("meta"):`.

        As upstream, an unset `cfg.max_target_positions` is filled in place from --tokens-per-sample, so
        the config saved with the model says how many positions it has.
        """
        check_config(cfg)
        cfg.max_target_positions = resolve_max_target_positions(cfg)
        return cls(TransformerDecoder(cfg, vocab_size, padding_idx, output_vocab_size))

    def forward(
        self,
        src_tokens: torch.Tensor,
        src_lengths: Optional[torch.Tensor] = None,
        features_only: bool = False,
        incremental_state: Optional[dict] = None,
        return_all_hiddens: bool = False,
    ) -> Tuple[torch.Tensor, dict]:
        """Upstream's `(logits [B, T, V], extra)` (the features with `features_only`); `extra` is
        `{"attn": [None], "inner_states": [...]}` (TransformerDecoder.extract_features says what they hold).
        `src_lengths` is accepted and unused.

        Attention is causal only: as in upstream, right padding never changes the outputs at real tokens.
        With `incremental_state` (a dict kept across calls) only the tokens past the cached ones are computed
        and their logits returned (see TransformerDecoder).
        """
        return self.decoder(
            src_tokens,
            incremental_state=incremental_state,
            features_only=features_only,
            return_all_hiddens=return_all_hiddens,
        )

    def reserve_incremental_state(self, incremental_state: dict, max_length: int, max_batch: int = 0) -> None:
        """Allocate the decoder's KV cache once, for up to `max_length` tokens of `max_batch` rows."""
        self.decoder.reserve_incremental_state(incremental_state, max_length, max_batch)

    def reorder_incremental_state(self, incremental_state: dict, new_order: torch.Tensor) -> None:
        """Row i of the cache continues row `new_order[i]` (beam search, dropped sentences)."""
        self.decoder.reorder_incremental_state(incremental_state, new_order)

    def max_decoder_positions(self) -> int:
        return self.decoder.max_positions()

    def reset_parameters(self) -> None:
        """Re-initialize all weights from the torch RNG (e.g. after `to_empty` on a meta-built model)."""
        self.decoder.reset_parameters()

    def tie_weights(self) -> None:
        self.decoder.tie_weights()

    def flops_per_token(self, seq_len: int) -> Optional[float]:
        """6 x the matrix weights (forward + backward) plus the attention score and value products. None
        (unknown) with adaptive input or softmax: a token passes through its own band only, so the cost
        depends on the data's word frequencies."""
        if isinstance(self.decoder.embed_tokens, AdaptiveInput) or self.decoder.adaptive_softmax is not None:
            return None
        return transformer_flops_per_token(self, len(self.transformer_layers()), self.decoder.embed_dim, seq_len)

    # Options that add parameters or a softmax the tensor-parallel plan does not split. (NormFormer's
    # --scale-attn is a norm of the sequence-split stream, in the plan; --scale-fc normalizes over the FFN dim,
    # which the plan splits, and the per-head / residual scales are parameters of the layer itself.)
    TENSOR_PARALLEL_REFUSED = (
        ("adaptive_input", "--adaptive-input"),
        ("adaptive_softmax_cutoff", "--adaptive-softmax-cutoff"),
        ("character_embeddings", "--character-embeddings"),
        ("scale_fc", "--scale-fc"),
        ("scale_heads", "--scale-heads"),
        ("scale_resids", "--scale-resids"),
    )

    @classmethod
    def tensor_parallel_sizes(cls, cfg) -> TensorParallelSizes:
        refused = tuple(flag for name, flag in cls.TENSOR_PARALLEL_REFUSED if getattr(cfg, name))
        return TensorParallelSizes(cfg.decoder_attention_heads, cfg.decoder_ffn_embed_dim, refused)

    def tensor_parallel_plan(self) -> Optional[TensorParallelPlan]:
        """The decoder's styles (TransformerDecoder.tensor_parallel_styles) under `decoder.`; the sequence is
        split from the first layer's input to the last layer's output."""
        decoder = self.decoder
        if not isinstance(decoder, TransformerDecoder):
            return None
        styles = {f"decoder.{path}": style for path, style in decoder.tensor_parallel_styles().items()}
        layers = decoder.layers
        last = len(layers) - 1
        return TensorParallelPlan(
            styles,
            sequence_parallel=("decoder.layers.0", f"decoder.layers.{last}") if len(layers) else None,
            heads=layers[0].self_attn.num_heads if len(layers) else 0,
            ffn=layers[0].fc1.out_features if len(layers) else 0,
            vocab=decoder.embed_tokens.num_embeddings,
            output_vocab=decoder.output_projection.out_features,
            description=f"{len(layers)} layers split (q/k/v/fc1 by columns, out_proj/fc2 by rows, norms "
            "sequence-parallel), vocabulary-parallel embedding and output",
        )


# Upstream's import path for the presets (fairseq.models.transformer_lm.base_lm_architecture, ...); registered here,
# once the model is.
for _arch, _fill in PRESETS.items():
    registry.register_model_architecture("transformer_lm", _arch)(_fill)


def preset_config(arch: str, **overrides) -> TransformerLanguageModelConfig:
    """The config `--arch ARCH` plus the given flags would produce (e.g. for tests and memory planning).

    `overrides` play the part of the command line: the preset fills only what they leave unset, then the
    config defaults fill the rest.
    """
    return build.preset_config(arch, TransformerLanguageModel, "transformer_lm", overrides)
