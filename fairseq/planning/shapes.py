"""What a memory plan is computed from: the model's shapes, read from the real model code built on the meta device
(`model_shape`, exact parameter counts; `local_shape`, one tensor-parallel rank's share), and the training flags
that memory and time depend on (`TrainingSetup`). fairseq/planning/memory_model.py walks a step with them.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from fairseq.distributed.float8 import is_float8_convertible
from fairseq.distributed.fsdp import FSDPSettings
from fairseq.distributed.tensor_parallel import split_dims
from fairseq.planning.memory_calibration import DTYPE_BYTES
from fairseq.models.transformer_lm import TransformerLanguageModel

FLOAT8_MAX_TP = 64  # the largest --model-parallel-size whose float8 conversion is worked out

# ------------------------------------------------------------------------------------------ model shape


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a transformer_lm: parameter shapes and the dims activations scale with."""

    total_params: int  # unique parameters of the built model (tied weights once)
    num_layers: int
    layer_param_shapes: Tuple[Tuple[int, ...], ...]  # one decoder layer (all layers are identical)
    layer_norm_params: int  # of those, the layer norms' (autocast runs layer_norm in fp32: never cast)
    root_param_shapes: Tuple[Tuple[int, ...], ...]  # everything else: embeddings, norms, output projection
    vocab_size: int
    embed_dim: int
    ffn_dim: int
    heads: int
    output_dim: int
    output_projection_tied: bool
    activation_fn: str
    dropout: float
    activation_dropout: float
    layernorm_embedding: bool
    # Per parameter (same order as the shapes): the dim --model-parallel-size splits, None when replicated
    # (fairseq.distributed.tensor_parallel.split_dims, read from the tensor-parallel plan itself).
    layer_param_splits: Tuple[Optional[int], ...] = ()
    root_param_splits: Tuple[Optional[int], ...] = ()
    # Per layer parameter: the --model-parallel-size values (up to FLOAT8_MAX_TP) at which --fp8 makes it a
    # float8 weight (fairseq.distributed.float8.is_float8_convertible: a Linear whose dims stay multiples of 16
    # on every rank). Biases and norms stay in the compute dtype.
    layer_param_float8_tp: Tuple[Tuple[int, ...], ...] = ()

    @property
    def layer_params(self) -> int:
        return sum(math.prod(s) for s in self.layer_param_shapes)

    @property
    def root_params(self) -> int:
        return sum(math.prod(s) for s in self.root_param_shapes)

    @property
    def output_projection_params(self) -> int:
        return self.vocab_size * self.output_dim

    def float8_params(self, tp: int) -> Tuple[bool, ...]:
        """Per layer parameter: whether it is a float8 weight under --model-parallel-size `tp`."""
        return tuple(tp in sizes for sizes in self.layer_param_float8_tp)

    def with_layers(self, num_layers: int) -> "ModelShape":
        """The same layer shape, `num_layers` deep (what `--decoder-layers num_layers` would build)."""
        total = num_layers * self.layer_params + self.root_params
        return dataclasses.replace(self, num_layers=num_layers, total_params=total)


def model_shape(cfg, vocab_size: int, padding_idx: int = 1) -> ModelShape:
    """Build the model of `cfg` on the meta device with the real model code and read its shapes.

    The layers are identical, so at most two are built (enough to see that they are) and the rest counted:
    the time and memory this takes do not grow with --decoder-layers. `padding_idx` 1 is what fairseq's
    Dictionary gives; it sets the learned position table's offset rows.
    """
    TransformerLanguageModel.check_config(cfg)  # the flags as given (the build below changes the layer count)
    num_layers = cfg.decoder_layers
    with torch.device("meta"):  # build() fills max_target_positions in place: a copy
        model = TransformerLanguageModel.build(
            dataclasses.replace(cfg, decoder_layers=min(max(num_layers, 1), 2)), vocab_size, padding_idx
        )
    layers = model.transformer_layers()
    layer_ids = {id(p) for p in layers.parameters()}
    layer_shapes = [tuple(tuple(p.shape) for p in layer.parameters()) for layer in layers]
    if any(s != layer_shapes[0] for s in layer_shapes):
        raise ValueError("decoder layers of different shapes: the planner assumes identical layers")
    one_layer = layer_shapes[0]
    root = tuple(tuple(p.shape) for p in model.parameters() if id(p) not in layer_ids)
    splits = split_dims(model)
    root_splits = tuple(splits[n] for n, p in model.named_parameters() if id(p) not in layer_ids)
    layer_splits = tuple(splits[f"decoder.layers.0.{n}"] for n, _ in layers[0].named_parameters())
    float8_tp = {
        id(m.weight): tuple(tp for tp in range(1, FLOAT8_MAX_TP + 1) if is_float8_convertible(m, n, tp))
        for n, m in layers[0].named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    layer_float8 = tuple(float8_tp.get(id(p), ()) for p in layers[0].parameters())
    norm_params = sum(
        p.numel() for m in layers[0].modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()
    )
    activation_dropout = cfg.activation_dropout or cfg.relu_dropout or 0.0
    built = ModelShape(
        total_params=sum(p.numel() for p in model.parameters()),
        num_layers=len(layers),
        layer_param_shapes=one_layer,
        layer_norm_params=norm_params,
        root_param_shapes=root,
        vocab_size=vocab_size,
        embed_dim=cfg.decoder_embed_dim,
        ffn_dim=cfg.decoder_ffn_embed_dim,
        heads=cfg.decoder_attention_heads,
        output_dim=cfg.decoder_output_dim,
        output_projection_tied=bool(cfg.share_decoder_input_output_embed),
        activation_fn=cfg.activation_fn,
        dropout=cfg.dropout,
        activation_dropout=activation_dropout,
        layernorm_embedding=cfg.layernorm_embedding,
        layer_param_splits=layer_splits,
        root_param_splits=root_splits,
        layer_param_float8_tp=layer_float8,
    )
    assert built.total_params == built.num_layers * built.layer_params + built.root_params
    return built.with_layers(num_layers)


def local_shape(shape: ModelShape, tp: int) -> ModelShape:
    """What one rank of a tensor-parallel group of `tp` holds: every split parameter dim divided by `tp`, and
    the per-rank widths activations scale with (vocabulary, heads, FFN: each rank computes its share)."""
    if tp == 1:
        return shape

    def split(shapes, dims):
        return tuple(tuple(n // tp if i == d else n for i, n in enumerate(s)) for s, d in zip(shapes, dims))

    layer = split(shape.layer_param_shapes, shape.layer_param_splits)
    root = split(shape.root_param_shapes, shape.root_param_splits)
    local = dataclasses.replace(
        shape,
        layer_param_shapes=layer,
        root_param_shapes=root,
        vocab_size=shape.vocab_size // tp,
        heads=shape.heads // tp,
        ffn_dim=shape.ffn_dim // tp,
        total_params=0,
    )
    return dataclasses.replace(local, total_params=local.num_layers * local.layer_params + local.root_params)


# ------------------------------------------------------------------------------------------ training setup


@dataclass(frozen=True)
class TrainingSetup:
    """The training flags memory depends on, per GPU."""

    gpus: int = 1
    batch_size: int = 1  # sequences per data-parallel rank per micro-batch (a tensor-parallel group shares them)
    tokens_per_sample: int = 2048
    dtype: str = "fp32"  # compute dtype: fp32, bf16 or fp16 (parameters and optimizer stay fp32)
    fully_sharded: bool = True  # --ddp-backend fully_sharded; otherwise replicated (DDP)
    checkpoint_activations: bool = False
    offload_activations: bool = False
    reshard_after_forward: bool = True  # False: --no-reshard-after-forward
    cpu_offload: bool = False
    forward_prefetch: bool = False
    prefetch_depth: int = 1
    sync_free: bool = False  # bounds reserved memory, not allocated memory: no term of its own
    update_freq: int = 1
    tensor_parallel: int = 1  # --model-parallel-size (sequence-parallel norms, vocabulary-parallel loss)
    shard_group: int = 0  # --fsdp-shard-group-size: ranks that shard the states (0: every data-parallel rank)
    float8: bool = False  # --fp8 (the decoder layers' Linear layers)
    float8_recipe: str = "tensorwise"  # --fp8-recipe
    float8_all_gather: bool = False  # --fp8-fsdp-all-gather: the layers' weight matrices gathered in float8
    compiled: bool = False  # --compile (changes what a float8 layer saves; nothing in bf16)
    # The tensor-parallel plan applied on a one-rank mesh (FAIRSEQ_TP_MESH_OF_ONE=1 with --model-parallel-size 1:
    # the TP code path on one GPU, which the GPU validation of the plan measures).
    tp_plan_on_one_rank: bool = False

    @property
    def data_parallel(self) -> int:
        return self.gpus // self.tensor_parallel

    @property
    def fsdp(self) -> FSDPSettings:
        """The FSDP flags as fairseq.distributed.fsdp reads them: its prefetch rules, not a copy of them."""
        return FSDPSettings(
            reshard_after_forward=self.reshard_after_forward,
            forward_prefetch=self.forward_prefetch,
            prefetch_depth=self.prefetch_depth,
            sync_free=self.sync_free,
            cpu_offload=self.cpu_offload,
        )

    @property
    def shard_ranks(self) -> int:
        """How many ranks FSDP2 shards each (tensor-parallel-local) parameter over."""
        return self.shard_group or self.data_parallel

    @property
    def tokens(self) -> int:
        return self.batch_size * self.tokens_per_sample

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def tp_styles(self) -> bool:
        """Whether the layers run under the tensor-parallel styles (their hooks, casts and collectives)."""
        return self.tensor_parallel > 1 or self.tp_plan_on_one_rank

    @property
    def float8_tensorwise(self) -> bool:
        return self.float8 and self.float8_recipe == "tensorwise"

    @property
    def autocast(self) -> bool:
        """DDP runs bf16/fp16 under autocast (fp32 weights, cast per op); FSDP2 casts the parameters."""
        return not self.fully_sharded and self.dtype != "fp32"
