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

Network (batch-major, [B, T, C]): token embedding (no positions: the convolutions see order), dropout, fc1 to
the first layer's width, then per layer `residual` (projected if needed), `GatedCausalConv` (dropout, causal
convolution, GLU), `(x + residual) * sqrt(0.5)`; then the output layer. The model holds no distributed or
precision code; FSDP2, activation checkpointing and --compile wrap each convolution (`transformer_layers()`).

Incremental decoding keeps, per convolution, its last kernel - 1 inputs; any number of new tokens per call.
"""

import ast
import logging
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq import registry
from fairseq.dataclass import build
from fairseq.dataclass.configs import II, opt
from fairseq.dataclass.utils import flag_name
from fairseq.modules.incremental_decoding_utils import IncrementalState
from fairseq.modules.fairseq_incremental_decoder import FairseqIncrementalDecoder, check_token_input
from fairseq.models.fairseq_model import FairseqLanguageModel
from fairseq.modules.adaptive_input import parse_cutoffs
from fairseq.modules.adaptive_softmax import AdaptiveSoftmax
from fairseq.modules.gated_convolution import GatedCausalConv, WeightNormLinear, norm_except_dim, weight_normalized
from fairseq.modules.positional_embedding import zero_row_
from fairseq.dataclass.flag_values import fill_missing, literal_or_none

logger = logging.getLogger(__name__)

_STATE_KEY = "fconv_state"
_MAX_LAYERS = 10_000  # a layer spec longer than this is a typo (or an attempt to exhaust memory)
LayerSpec = Tuple[int, int, int]  # (dim, kernel_size, residual)


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


# -------------------------------------------------------------------------------------------- decoder


class FConvDecoder(FairseqIncrementalDecoder):
    """Embedding -> fc1 -> gated causal convolutions with residuals -> fc2, fc3 (or an adaptive softmax).

    State-dict keys (under the model's `decoder.`): `version` ([2.], upstream's weight-norm layout),
    `embed_tokens.weight`, `fc1.{weight_g,weight_v,bias}`, `projections.N.*` (only for layers whose residual
    has another width), `convolutions.N.{weight_g,weight_v,bias}`, `fc2.*` and `fc3.*`, or
    `adaptive_softmax.*` (fairseq.modules.adaptive_softmax's names)."""

    def __init__(
        self,
        vocab_size: int,
        padding_idx: int,
        embed_dim: int,
        layers: List[LayerSpec],
        dropout: float,
        adaptive_softmax_cutoff: Optional[List[int]] = None,
        adaptive_softmax_dropout: float = 0.0,
        output_vocab_size: Optional[int] = None,
    ):
        super().__init__(dictionary=None)  # built from sizes; the task holds the dictionary
        self.register_buffer("version", torch.tensor([2.0]))
        self.padding_idx = padding_idx
        self.dropout = dropout
        out_size = vocab_size if output_vocab_size is None else output_vocab_size
        self.embed_tokens = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx)
        self.embed_positions = None  # upstream's fconv_lm has no positional embeddings
        in_channels = layers[0][0]
        self.fc1 = WeightNormLinear(embed_dim, in_channels, dropout=dropout)
        self.projections = nn.ModuleList()
        self.convolutions = nn.ModuleList()
        self.residuals = []
        layer_in_channels = [in_channels]  # the width of each output a residual may come from
        for out_channels, kernel_size, residual in layers:
            residual_dim = out_channels if residual == 0 else layer_in_channels[-residual]
            self.projections.append(
                WeightNormLinear(residual_dim, out_channels) if residual_dim != out_channels else None
            )
            self.convolutions.append(GatedCausalConv(in_channels, out_channels, kernel_size, dropout=dropout))
            self.residuals.append(residual)
            in_channels = out_channels
            layer_in_channels.append(out_channels)
        self.output_dim = in_channels
        self.adaptive_softmax = None
        self.fc2 = self.fc3 = None
        if adaptive_softmax_cutoff is not None:
            if adaptive_softmax_cutoff[0] <= padding_idx:
                raise ValueError(
                    f"--adaptive-softmax-cutoff {','.join(map(str, adaptive_softmax_cutoff))}: the first "
                    f"cutoff must be larger than the padding index {padding_idx}"
                )
            self.adaptive_softmax = AdaptiveSoftmax(
                out_size, in_channels, adaptive_softmax_cutoff, dropout=adaptive_softmax_dropout
            )
        else:
            self.fc2 = WeightNormLinear(in_channels, embed_dim)
            self.fc3 = WeightNormLinear(embed_dim, out_size, dropout=dropout)
        self._init_embedding()

    def _init_embedding(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=0.1)
        zero_row_(self.embed_tokens.weight, self.padding_idx)

    def reset_parameters(self) -> None:
        """Initialize every parameter and buffer as upstream does, drawing from the torch RNG."""
        self._init_embedding()
        for module in (self.fc1, *self.projections, *self.convolutions, self.fc2, self.fc3, self.adaptive_softmax):
            if module is not None:
                module.reset_parameters()
        with torch.no_grad():
            self.version.fill_(2.0)

    def max_positions(self) -> Optional[int]:
        return None  # no positional embeddings: any length (upstream says float("inf"))

    def extract_features(
        self, prev_output_tokens: torch.Tensor, encoder_out=None, incremental_state: Optional[IncrementalState] = None
    ) -> torch.Tensor:
        """Outputs of the last convolution, [B, T, last dim]; with `incremental_state`, of the tokens past the
        cached ones only."""
        if encoder_out is not None:
            raise ValueError(
                "FConvDecoder is a language model's decoder and has no encoder attention; pass encoder_out=None"
            )
        check_token_input(prev_output_tokens)
        histories = None
        tokens = prev_output_tokens
        if incremental_state is not None:
            entry = self._state_entry(incremental_state)
            start = entry["length"]
            if tokens.size(1) <= start:
                raise ValueError(
                    f"incremental decoding: {tokens.size(1)} tokens given but {start} are cached "
                    "already; pass the whole sequence so far plus at least one new token"
                )
            tokens, histories = tokens[:, start:], entry["histories"]
            entry["length"] = prev_output_tokens.size(1)
        x = F.dropout(self.embed_tokens(tokens), self.dropout, self.training)
        x = self.fc1(x)
        outputs = [x]  # fc1's output, then every layer's: where residuals come from
        for i, (projection, conv, residual_from) in enumerate(zip(self.projections, self.convolutions, self.residuals)):
            residual = None
            if residual_from > 0:
                residual = outputs[-residual_from]
                if projection is not None:
                    residual = projection(residual)
            if histories is None:
                x = conv(x)
            else:
                history = histories[i]
                histories[i] = conv.next_history(x, history)
                x = conv(x, history)
            if residual is not None:
                x = (x + residual) * math.sqrt(0.5)
            outputs.append(x)
        return x

    def output_layer(self, features: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (fc2, dropout, fc3), or an adaptive softmax's fp32 log-probabilities over the whole
        vocabulary (a log-softmax leaves them unchanged; --criterion adaptive_loss takes the features instead)."""
        if self.adaptive_softmax is not None:
            return self.adaptive_softmax.get_log_prob(features)
        x = F.dropout(self.fc2(features), self.dropout, self.training)
        return self.fc3(x)

    def forward(
        self,
        prev_output_tokens: torch.Tensor,
        encoder_out=None,
        incremental_state: Optional[IncrementalState] = None,
        features_only: bool = False,
        src_lengths: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, None]:
        """Upstream's `(logits [B, T, V], attention)` (the features with `features_only`); the attention is
        None, as upstream's for a language model (no encoder to attend to)."""
        features = self.extract_features(prev_output_tokens, encoder_out, incremental_state)
        return (features if features_only else self.output_layer(features)), None

    def get_normalized_probs_scriptable(self, net_output, log_probs: bool, sample: Optional[dict] = None):
        # The output is logits or the adaptive softmax's log-probabilities, never features (unlike upstream's).
        logits = net_output[0] if isinstance(net_output, (tuple, list)) else net_output
        return F.log_softmax(logits.float(), dim=-1) if log_probs else F.softmax(logits.float(), dim=-1)

    # ---- incremental state: per convolution, its last kernel - 1 inputs --------------------------------------
    def _state_entry(self, incremental_state: IncrementalState) -> dict:
        entry = self.get_incremental_state(incremental_state, _STATE_KEY)
        if entry is None:
            entry = {"length": 0, "histories": [None] * len(self.convolutions)}
            self.set_incremental_state(incremental_state, _STATE_KEY, entry)
        return entry

    def reserve_incremental_state(
        self, incremental_state: IncrementalState, max_length: int, max_batch: int = 0
    ) -> None:
        """The caches have a fixed size (kernel - 1 inputs per layer), whatever the length: nothing to reserve.
        Having this method tells the generator that one call may take several new tokens (a whole prompt)."""
        self._state_entry(incremental_state)

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: torch.Tensor) -> None:
        """Row i of every cache continues row `new_order[i]` (beam search, dropped sentences)."""
        entry = self._state_entry(incremental_state)
        entry["histories"] = [h.index_select(0, new_order) if h is not None else None for h in entry["histories"]]

    def reorder_incremental_state_scripting(self, incremental_state: IncrementalState, new_order: torch.Tensor) -> None:
        self.reorder_incremental_state(incremental_state, new_order)


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
