"""Gated convolutional language models (`--arch fconv_lm*`; Dauphin et al., 2017, "Language Modeling with Gated
Convolutional Networks", https://arxiv.org/abs/1612.08083), compatible with upstream fairseq's `fconv_lm`.

Flag names, defaults, presets and parameter names are upstream's, so upstream's command lines
(examples/language_model/README.conv.md) build the same model and upstream checkpoints load:

- `--decoder-layers` is upstream's layer spec, a Python expression of (dim, kernel_size[, residual]) tuples
  combined with `+` and `*`, e.g. "[(850, 6)] * 3 + [(1024, 4)]". It is parsed, never evaluated: only list and
  tuple literals, integers, `+` and `*` are accepted. `residual` (default 1) says which earlier output is
  added back: 1 the previous layer's, N the one N layers back (a projection when the widths differ), 0 none.
- `--decoder-embed-dim` (128), `--dropout` (0.1), `--decoder-attention` ("False": upstream's attention layers
  need an encoder, so only False is accepted), `--adaptive-softmax-cutoff` and `--adaptive-softmax-dropout`.
  As upstream, the adaptive softmax is built only with `--criterion adaptive_loss`; otherwise the cutoffs are
  left unused and the output is `fc2` (to `--decoder-embed-dim`), dropout, `fc3` (to the vocabulary).
  `--decoder-out-embed-dim` is accepted and unused, as upstream.

Presets: `fconv_lm` (13 layers of (1268, 4), embed dim 128), `fconv_lm_dauphin_wikitext103` (14 layers: 850
wide with kernels 6, 1, 5, 1, 4, then 1024 and 2048 wide; embed dim 280; cutoffs 10000,20000,200000) and
`fconv_lm_dauphin_gbw` (a 512-wide layer, then 13 bottleneck blocks of kernels 1, 5, 1 whose last layer takes
the residual from 3 layers back; embed dim 128; cutoffs 10000,50000,200000). `--checkpoint-activations` and
`--offload-activations` (this fork's) apply to each convolution.

The network and its incremental decoding are fairseq.modules.fconv_decoder's `FConvDecoder`. The model holds
no distributed or precision code; FSDP2, activation checkpointing and --compile wrap each convolution
(`transformer_layers()`).
"""

import ast
import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from fairseq import registry
from fairseq.dataclass import build
from fairseq.dataclass.configs import II, opt
from fairseq.dataclass.utils import flag_name
from fairseq.models.fairseq_model import FairseqLanguageModel
from fairseq.modules.adaptive_input import parse_cutoffs
from fairseq.modules.fconv_decoder import FConvDecoder, LayerSpec
from fairseq.modules.gated_convolution import GatedCausalConv, WeightNormLinear, norm_except_dim, weight_normalized
from fairseq.dataclass.flag_values import fill_missing, literal_or_none

logger = logging.getLogger(__name__)

_MAX_LAYERS = 10_000  # a layer spec longer than this is a typo (or an attempt to exhaust memory)


@dataclass
class FConvLanguageModelConfig:
    dropout: float = opt(0.1, "dropout probability")
    decoder_embed_dim: int = opt(128, "decoder embedding dimension")
    decoder_layers: str = opt(
        "[(1268, 4)] * 13",
        "decoder layers [(dim, kernel_size[, residual]), ...], a "
        "list expression such as '[(850, 6)] * 3 + [(1024, 4)]'",
    )
    decoder_out_embed_dim: Optional[int] = opt(
        None,
        "accepted for upstream command lines and unused, as in "
        "upstream's fconv_lm (fc2 has --decoder-embed-dim outputs)",
    )
    decoder_attention: str = opt("False", "decoder attention [True, ...]: only False (no encoder to attend to)")
    adaptive_softmax_cutoff: Optional[str] = opt(
        None,
        "comma separated list of adaptive softmax cutoffs, e.g. 10000,20000,200000 (used with "
        "--criterion adaptive_loss only, as upstream)",
    )
    adaptive_softmax_dropout: float = opt(0.0, "dropout of the adaptive softmax's input and tail projections")
    # This fork's (transformer_lm has them too); parallelize applies them to each convolution.
    checkpoint_activations: bool = opt(False, "checkpoint activations at each convolution (recompute in backward)")
    offload_activations: bool = opt(False, "move checkpointed activations to CPU (implies --checkpoint-activations)")
    # Other groups' options the model's rules depend on (no flags of their own; copied when the config is built).
    criterion: Optional[str] = II("criterion._name", "cross_entropy")
    fp8: bool = II("common.fp8", False)


# ---------------------------------------------------------------------------------------- the layer spec


def _literal(node: ast.AST, spec: str):
    """The value of a layer-spec expression node: int / list / tuple literals, `+` and `*`, nothing else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_literal(e, spec) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _literal(node.left, spec), _literal(node.right, spec)
        if isinstance(node.op, ast.Mult):
            sequence, count = (left, right) if isinstance(left, (list, tuple)) else (right, left)
            if isinstance(sequence, (list, tuple)) and isinstance(count, int) and len(sequence) * count > _MAX_LAYERS:
                raise ValueError(f"--decoder-layers {spec!r} has more than {_MAX_LAYERS} layers")
        try:
            return left + right if isinstance(node.op, ast.Add) else left * right
        except TypeError:
            pass
    raise ValueError(
        f"--decoder-layers {spec!r}: expected a list of (dim, kernel_size[, residual]) tuples, "
        "combined with + and *, e.g. '[(850, 6)] * 3 + [(1024, 4)]'"
    )


def parse_decoder_layers(spec) -> List[LayerSpec]:
    """Upstream's `--decoder-layers` expression -> [(dim, kernel_size, residual)], residual defaulting to 1
    (upstream's `extend_conv_spec`). Raises ValueError naming the flag for anything else."""
    if isinstance(spec, str):
        try:
            tree = ast.parse(spec.strip(), mode="eval")
        except SyntaxError:
            raise ValueError(
                f"--decoder-layers {spec!r} is not a list expression; e.g. '[(850, 6)] * 3 + [(1024, 4)]'"
            ) from None
        value = _literal(tree.body, spec)
    else:
        value = spec
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"--decoder-layers {spec!r}: expected a non-empty list of (dim, kernel_size) tuples")
    layers = []
    for i, layer in enumerate(value):
        if (
            not isinstance(layer, (list, tuple))
            or len(layer) not in (2, 3)
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in layer)
        ):
            raise ValueError(
                f"--decoder-layers: layer {i} is {layer!r}; each layer is (dim, kernel_size) or "
                "(dim, kernel_size, residual) of integers"
            )
        dim, kernel, residual = (*layer, 1) if len(layer) == 2 else layer
        if dim < 1 or kernel < 1:
            raise ValueError(f"--decoder-layers: layer {i} is {tuple(layer)}; dim and kernel_size must be >= 1")
        if not 0 <= residual <= i + 1:
            raise ValueError(
                f"--decoder-layers: layer {i} takes its residual from {residual} layers back, but only "
                f"{i + 1} outputs precede it (fc1's and {i} layers'); use 0 <= residual <= {i + 1}"
            )
        layers.append((dim, kernel, residual))
    return layers


def parse_decoder_attention(value, num_layers: int) -> None:
    """Accept upstream's "False" (or a list of False, one per layer); refuse attention, which attends over an
    encoder's output that a language model does not have (upstream's fconv_lm fails at its first forward)."""
    parsed = literal_or_none(value)
    flags = [parsed] if isinstance(parsed, bool) else parsed
    if not isinstance(flags, (list, tuple)) or not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"--decoder-attention {value!r}: expected False (or a list of booleans, one per layer)")
    if not isinstance(parsed, bool) and len(flags) != num_layers:
        raise ValueError(f"--decoder-attention {value!r} has {len(flags)} entries for {num_layers} layers")
    if any(flags):
        raise ValueError(
            f"--decoder-attention {value!r} is not supported: fconv_lm's attention layers attend over "
            "an encoder's output, which a language model has not; leave --decoder-attention False"
        )


def uses_adaptive_softmax(cfg) -> bool:
    """Upstream's rule: an adaptive softmax only when the cutoffs are given and the criterion is adaptive_loss."""
    return cfg.adaptive_softmax_cutoff is not None and cfg.criterion == "adaptive_loss"


def check_config(cfg) -> None:
    """Reject configurations this model cannot build, naming the flag and what to do instead."""
    layers = parse_decoder_layers(cfg.decoder_layers)
    parse_decoder_attention(cfg.decoder_attention, len(layers))
    if cfg.decoder_embed_dim <= 0:
        raise ValueError(f"--decoder-embed-dim must be positive, got {cfg.decoder_embed_dim}")
    for name in ("dropout", "adaptive_softmax_dropout"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ValueError(f"{flag_name(name)} must be in [0, 1), got {getattr(cfg, name)}")
    if cfg.fp8:
        raise ValueError(
            "--fp8 is not supported by fconv_lm (its convolutions are not Linear layers torchao "
            "converts); drop --fp8 or use --arch transformer_lm*"
        )
    if cfg.criterion == "adaptive_loss":
        if cfg.adaptive_softmax_cutoff is None:
            raise ValueError(
                "--criterion adaptive_loss needs --adaptive-softmax-cutoff (e.g. 10000,20000,200000) "
                "with --arch fconv_lm; or use --criterion cross_entropy"
            )
        parse_cutoffs(cfg.adaptive_softmax_cutoff, "--adaptive-softmax-cutoff")
    elif cfg.adaptive_softmax_cutoff is not None:
        logger.warning(
            f"--adaptive-softmax-cutoff {cfg.adaptive_softmax_cutoff} is unused: fconv_lm builds its "
            f"adaptive softmax only with --criterion adaptive_loss (as upstream), not {cfg.criterion}"
        )
    if cfg.decoder_out_embed_dim is not None and cfg.decoder_out_embed_dim != cfg.decoder_embed_dim:
        logger.warning(
            f"--decoder-out-embed-dim {cfg.decoder_out_embed_dim} has no effect: fconv_lm's fc2 has "
            f"--decoder-embed-dim ({cfg.decoder_embed_dim}) outputs, as in upstream fairseq"
        )


# ---------------------------------------------------------------------------------------------- model


@registry.register_model("fconv_lm", dataclass=FConvLanguageModelConfig)
class FConvLanguageModel(FairseqLanguageModel):
    """`model(src_tokens) -> (logits [B, T, V], None)`; the repeated blocks are `model.decoder.convolutions`."""

    architecture_options = ("decoder_embed_dim", "decoder_layers", "adaptive_softmax_cutoff")

    @classmethod
    def check_config(cls, cfg) -> None:
        check_config(cfg)

    @classmethod
    def describe_config(cls, cfg) -> str:
        return f"embed dim {cfg.decoder_embed_dim}, layers {cfg.decoder_layers}"

    @classmethod
    def build_model(cls, cfg, task) -> "FConvLanguageModel":
        return cls.build(
            cfg,
            len(task.source_dictionary),
            task.source_dictionary.pad(),
            output_vocab_size=len(task.target_dictionary),
        )

    @classmethod
    def build(
        cls, cfg, vocab_size: int, padding_idx: int = 1, output_vocab_size: Optional[int] = None
    ) -> "FConvLanguageModel":
        """Build from a config and a vocabulary size. Works under `with torch.device("meta"):`."""
        check_config(cfg)
        cutoffs = (
            parse_cutoffs(cfg.adaptive_softmax_cutoff, "--adaptive-softmax-cutoff")
            if uses_adaptive_softmax(cfg)
            else None
        )
        layers = parse_decoder_layers(cfg.decoder_layers)
        return cls(
            FConvDecoder(
                vocab_size,
                padding_idx,
                cfg.decoder_embed_dim,
                layers,
                cfg.dropout,
                cutoffs,
                cfg.adaptive_softmax_dropout,
                output_vocab_size,
            )
        )

    def forward(
        self,
        src_tokens: torch.Tensor,
        src_lengths: Optional[torch.Tensor] = None,
        features_only: bool = False,
        incremental_state: Optional[dict] = None,
    ) -> Tuple[torch.Tensor, None]:
        return self.decoder(src_tokens, incremental_state=incremental_state, features_only=features_only)

    def transformer_layers(self) -> nn.ModuleList:
        """The convolutions: one FSDP unit / checkpoint / compile region each (their parameters are most of
        the model's; the residual projections stay with the root)."""
        return self.decoder.convolutions

    def reorder_incremental_state(self, incremental_state: dict, new_order: torch.Tensor) -> None:
        self.decoder.reorder_incremental_state(incremental_state, new_order)

    def flops_per_token(self, seq_len: int) -> Optional[float]:
        """6 x the matrix weights a token passes through (convolution taps included). None with an adaptive
        softmax: a token's cost depends on its band, so on the data's word frequencies."""
        if self.decoder.adaptive_softmax is not None:
            return None
        weights = [m.weight_v for m in self.decoder.modules() if isinstance(m, (WeightNormLinear, GatedCausalConv))]
        return 6.0 * sum(w.numel() for w in weights)

    @classmethod
    def upgrade_state_dict(cls, state_dict: dict, cfg=None) -> dict:
        return upgrade_state_dict(state_dict, cfg)


# ------------------------------------------------------------------------------------------- presets


@registry.register_model_architecture("fconv_lm", "fconv_lm")
def base_lm_architecture(args) -> None:
    fill_missing(
        args,
        dropout=0.1,
        decoder_embed_dim=128,
        decoder_layers="[(1268, 4)] * 13",
        decoder_attention="False",
        adaptive_softmax_cutoff=None,
        adaptive_softmax_dropout=0.0,
    )


WIKITEXT103_LAYERS = (
    "[(850, 6)] * 3 + [(850, 1)] * 1 + [(850, 5)] * 4 + [(850, 1)] * 1 + [(850, 4)] * 3"
    " + [(1024, 4)] * 1 + [(2048, 4)] * 1"
)
GBW_LAYERS = (
    "[(512, 5)] + [(128, 1, 0), (128, 5, 0), (512, 1, 3)] * 3"
    " + [(512, 1, 0), (512, 5, 0), (1024, 1, 3)] * 3"
    " + [(1024, 1, 0), (1024, 5, 0), (2048, 1, 3)] * 6"
    " + [(1024, 1, 0), (1024, 5, 0), (4096, 1, 3)]"
)


@registry.register_model_architecture("fconv_lm", "fconv_lm_dauphin_wikitext103")
def fconv_lm_dauphin_wikitext103(args) -> None:
    fill_missing(
        args,
        decoder_embed_dim=280,
        decoder_layers=WIKITEXT103_LAYERS,
        decoder_attention="False",
        adaptive_softmax_cutoff="10000,20000,200000",
    )
    base_lm_architecture(args)


@registry.register_model_architecture("fconv_lm", "fconv_lm_dauphin_gbw")
def fconv_lm_dauphin_gbw(args) -> None:
    fill_missing(
        args,
        decoder_embed_dim=128,
        decoder_layers=GBW_LAYERS,
        decoder_attention="False",
        adaptive_softmax_cutoff="10000,50000,200000",
    )
    base_lm_architecture(args)


def preset_config(arch: str, **overrides) -> FConvLanguageModelConfig:
    """The config `--arch ARCH` plus the given flags would produce; `criterion` and `fp8` stand for the
    --criterion and --fp8 of the command line (default cross_entropy and False)."""
    return build.preset_config(arch, FConvLanguageModel, "fconv_lm", overrides)


# ---------------------------------------------------------------------------------------------------
# Upstream state dicts.


def upgrade_state_dict(state_dict: dict, cfg=None) -> dict:
    """An upstream fconv_lm state dict under this model's names (they are upstream's); returns a new dict.

    - `_linearized_weight` entries (a cache upstream's LinearizedConvolution kept out of newer files) are dropped;
    - `decoder.version` < 2 (or missing) marks upstream's first weight-norm layout (one norm per kernel tap,
      weight_g [kernel, 1, 1]): the convolutions' weights are re-expressed exactly in today's layout (one norm
      per output channel), as upstream's loader does by rebuilding the weight norm;
    - `cfg` (the saved model config, a dict or config object, when given) is made to match the weights: the
      adaptive softmax is built exactly when the file has one (upstream's rule ties it to --criterion), and a
      residual scale other than upstream's sqrt(0.5) (`normalization_constant` of fairseq 0.6) is refused.
    """
    out = {k: v for k, v in state_dict.items() if not k.endswith("._linearized_weight")}
    version = out.get("decoder.version")
    if version is None or float(version.flatten()[0]) < 2:
        for key in [k for k in out if k.startswith("decoder.convolutions.") and k.endswith(".weight_g")]:
            prefix = key[: -len("weight_g")]
            g, v = out[key], out[prefix + "weight_v"]
            if tuple(g.shape) == (v.size(0), 1, 1):  # today's is (1, 1, channels), never that shape
                weight = weight_normalized(g, v, dim=0)
                out[prefix + "weight_v"] = weight
                out[key] = norm_except_dim(weight, 2)
        out["decoder.version"] = torch.tensor([2.0])
    if cfg is not None:
        values = cfg if isinstance(cfg, dict) else vars(cfg)
        constant = values.get("normalization_constant", 0.5)
        if constant is not None and float(constant) != 0.5:
            raise ValueError(
                f"this fconv_lm checkpoint scales its residuals by sqrt({constant}) "
                "(--normalization-constant); only upstream's sqrt(0.5) is supported"
            )
        has_adaptive = any(k.startswith("decoder.adaptive_softmax.") for k in out)
        if has_adaptive:
            _set(cfg, "criterion", "adaptive_loss")
        elif "decoder.fc3.weight_v" in out:
            _set(cfg, "adaptive_softmax_cutoff", None)
    return out


def _set(cfg, name: str, value) -> None:
    if isinstance(cfg, dict):
        cfg[name] = value
    else:
        setattr(cfg, name, value)
