"""Compute time of a training step per GPU: FLOPs (as fairseq/logging/throughput.py counts them, plus the
recomputed forward of --checkpoint-activations) at a GPU's achieved throughput (fairseq/planning/hardware.py),
with the decoder layers' matmuls sped up by float8 as measured (docs/fp8.md). The communication that may hide
behind it is fairseq/planning/communication_model.py's; fairseq/planning/step_time.py puts the two together.

FLOPs per token: 2 per matrix weight and token in forward, twice that in backward (6N), plus attention's score
and value products, 4·d·s per layer in forward (12·L·d·s in all); a tensor-parallel rank does 1/t of its data-
parallel rank's work (heads, FFN columns and vocabulary rows are split). Not modeled: that narrower matmuls
under tensor parallelism run less efficiently, the optimizer step, the data loader.
"""

import math

from fairseq.planning.shapes import ModelShape, TrainingSetup

# How much faster float8 runs the decoder layers' matmul FLOPs than bf16, scaling work (amax, casts) included.
# Derived from end-to-end measurements on one H200 (docs/fp8.md, torchao 0.17) by this model's own FLOP split,
# so that it reproduces them (tests/unit/test_plan_time.py):
# - tensorwise with --compile: 1.332x end to end at 12 x 6144, batch 5 x 2048 (89.8% of the FLOPs in the layers'
#   matmuls) -> 1.384 on those FLOPs. At 32 x 2560 the same constant predicts 1.31x where 1.19-1.23x was measured:
#   narrower layers gain less, so estimates for them are optimistic; the 66B and 175B layers are wider.
# - rowwise with --compile: 1.009x at 32 x 2560, batch 16 -> 1.011 (rowwise_with_gw_hp, not measured: the same).
# - any recipe without --compile: 0.43x at 32 x 2560, batch 8 (torchao's casts as separate kernels) -> 0.389.
FLOAT8_COMPILED_SPEEDUP = {"tensorwise": 1.384, "rowwise": 1.011, "rowwise_with_gw_hp": 1.011}
FLOAT8_EAGER_SPEEDUP = 0.389


def layer_matrix_params(shape: ModelShape) -> int:
    """Matrix weights of one decoder layer (q, k, v, out, fc1, fc2), whole (not split)."""
    return sum(math.prod(s) for s in shape.layer_param_shapes if len(s) == 2)


def float8_layer_matrix_params(shape: ModelShape, tp: int) -> int:
    """Of those, the ones --fp8 runs in float8 under --model-parallel-size `tp`."""
    return sum(math.prod(s) for s, f8 in zip(shape.layer_param_shapes, shape.float8_params(tp)) if f8)


def float8_speedup(setup: TrainingSetup) -> float:
    if not setup.float8:
        return 1.0
    return FLOAT8_COMPILED_SPEEDUP[setup.float8_recipe] if setup.compiled else FLOAT8_EAGER_SPEEDUP


def layer_forward_seconds(shape: ModelShape, setup: TrainingSetup, tflops: float) -> float:
    """One decoder layer's forward on one GPU for one micro-batch (its share under tensor parallelism).
    Its backward costs twice this; its recomputation with --checkpoint-activations once more."""
    float8 = float8_layer_matrix_params(shape, setup.tensor_parallel) if setup.float8 else 0
    matmuls = 2 * (layer_matrix_params(shape) - float8) + 2 * float8 / float8_speedup(setup)
    attention = 4 * shape.embed_dim * setup.tokens_per_sample
    return setup.tokens * (matmuls + attention) / setup.tensor_parallel / (tflops * 1e12)


def root_seconds(shape: ModelShape, setup: TrainingSetup, tflops: float) -> float:
    """The output projection's forward and backward on one GPU for one micro-batch (kept in bf16 by --fp8;
    counted even when tied to the embedding, whose lookup is no matmul)."""
    return setup.tokens * 6 * shape.vocab_size * shape.output_dim / setup.tensor_parallel / (tflops * 1e12)


def layer_passes(setup: TrainingSetup) -> int:
    """Forward-sized passes per layer and micro-batch: forward, backward (2), the recomputed forward."""
    return 4 if setup.checkpoint_activations else 3


def compute_seconds(shape: ModelShape, setup: TrainingSetup, tflops: float) -> float:
    """Compute of one optimizer step (every micro-batch of --update-freq) on one GPU."""
    layers = shape.num_layers * layer_passes(setup) * layer_forward_seconds(shape, setup, tflops)
    return setup.update_freq * (layers + root_seconds(shape, setup, tflops))
