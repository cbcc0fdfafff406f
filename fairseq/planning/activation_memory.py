"""What a decoder layer saves for its backward, and the other activations of a step (per GPU, bytes): the
activation terms of the memory plan (fairseq/planning/memory_model.py walks the step with them;
docs/memory_planner.md lists the formulas and their sources).
"""

from fairseq.criterions.cross_entropy import chunk_rows
from fairseq.planning.memory_calibration import FLASH_DQ_ACCUM_BYTES, FLOAT8_BYTES, LOSS_FP32_CHUNK_COPIES
from fairseq.planning.shapes import ModelShape, TrainingSetup


def _ffn_saved_tensors(activation_fn: str, activation_dropout: bool) -> int:
    """How many ffn-wide tensors one layer saves: fc1's output if the activation needs its input (gelu),
    the activation's output if it needs that (relu, tanh), and fc2's input (often one of those)."""
    if activation_fn in ("gelu", "gelu_accurate", "gelu_fast"):
        return 2  # gelu saves its input; fc2 saves gelu's output (or the dropout's)
    if activation_fn in ("relu", "tanh"):
        return 2 if activation_dropout else 1  # the activation's output is fc2's input unless dropped out
    return 1  # linear: fc2's input is fc1's output (or the dropout's)


def _activation_keeps_fc2_input(shape: ModelShape) -> bool:
    """relu and tanh save their output for backward, which is fc2's input unless activation dropout follows."""
    return shape.activation_fn in ("relu", "tanh") and not shape.activation_dropout > 0


def layer_activation_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """Bytes one decoder layer saves for its backward, without checkpointing.

    Per token, with c the compute dtype's bytes (2 in bf16/fp16): the two layer-norm inputs (residual dtype),
    the q/k/v projections' input, q, k, v, the attention output (saved by SDPA and by out_proj as one tensor),
    fc1's input: 6 embed-wide tensors in c; the ffn-wide tensors of `_ffn_saved_tensors`; 1-byte dropout
    masks (2 residual dropouts, one after the activation); SDPA's fp32 logsumexp per head. Flash/efficient
    SDPA keeps no seq x seq matrix. For gelu, ffn = 4d and dropout > 0 in bf16 that is 34 bytes per token and
    embed dim, Korthikanti et al. 2022's 34*s*b*h minus its 5*a*s^2*b attention-score term.

    Under DDP autocast the residual stream stays fp32 and each of q/k/v casts the norm's output separately.

    With tensor parallelism (t ranks; `shape` is then the local one, see `local_shape`): the residual stream,
    the norms' inputs and the residual dropout masks are split along the sequence (/ t); q, k, v, the
    attention output and the ffn-wide tensors along the features (/ t); the inputs of q/k/v and fc1 are the
    all-gathered sequence, which the column-parallel matmuls save whole.

    With --fp8 --compile (tensorwise; measured on an H200 at 32 x 2560, docs/benchmarks_h200.md) the compiled layer
    saves the float8 casts of the inputs of q/k/v and fc1 (1 byte) instead of the bf16 tensors, and
    recomputes fc2's float8 input from fc1's output instead of saving it: 10 bytes per token and embed dim
    less than bf16, against 11.8 measured (the plan stays on the safe side). Eager float8 saves what bf16
    saves (measured: the same peak).

    Tensorwise float8 under the tensor-parallel styles (torchao's PrepareFloat8ModuleInput and
    Float8ColwiseParallel cast the sequence-split input to float8 before the all-gather, torchao/float8/
    float8_tensor_parallel.py): the gathered inputs of q/k/v and fc1 are float8 tensors, and the matmuls save
    them as they are (1 byte) with or without --compile. Eager, Float8RowwiseParallel also casts the inputs of
    out_proj and fc2 to float8 before their matmuls, which save the casts (1 byte): beside the attention output
    (SDPA keeps it) and beside a relu's or tanh's output (the activation keeps it), in place of fc2's bf16 input
    otherwise (gelu's output, a dropout's output, which only fc2 kept); compiled, as without tensor
    parallelism. The rowwise recipes cast a matmul input twice (scaled along rows for the forward, along
    columns for the weight gradient), so they save what bf16 saves.
    """
    d, f, c, t = shape.embed_dim, shape.ffn_dim, setup.compute_bytes, setup.tensor_parallel
    residual = 4 if setup.autocast else c
    qkv_inputs = 3 if setup.autocast else 1
    compiled_float8 = setup.float8_tensorwise and setup.compiled
    eager_float8_styles = setup.float8_tensorwise and setup.tp_styles and not setup.compiled
    float8_inputs = compiled_float8 or eager_float8_styles
    split = 2 * d * residual + 4 * d * c + (2 * d if shape.dropout > 0 else 0)  # per token, divided by t
    split += d * FLOAT8_BYTES if eager_float8_styles else 0  # out_proj's float8 input (d / t features)
    whole = (qkv_inputs + 1) * d * (FLOAT8_BYTES if float8_inputs else c)  # the inputs of q/k/v and fc1
    ffn_tensors = _ffn_saved_tensors(shape.activation_fn, shape.activation_dropout > 0)
    if compiled_float8:
        ffn_tensors -= 1  # fc2's input, recomputed
        whole += f * FLOAT8_BYTES if ffn_tensors == 0 else 0  # no other ffn-wide tensor to recompute it from
    elif eager_float8_styles:
        whole += f * FLOAT8_BYTES  # fc2's float8 input, saved by its matmul in place of the bf16 tensor ...
        ffn_tensors -= 0 if _activation_keeps_fc2_input(shape) else 1  # ... unless the activation keeps that
    whole += ffn_tensors * f * c
    whole += (f if shape.activation_dropout > 0 else 0) + 4 * shape.heads
    return setup.tokens * whole + setup.tokens * split // t


def checkpointed_layer_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """With --checkpoint-activations a layer keeps only its input (2*s*b*d in bf16); none on the GPU with
    --offload-activations (it is held in pinned host memory)."""
    if setup.offload_activations:
        return 0
    residual = 4 if setup.autocast else setup.compute_bytes
    return setup.tokens * shape.embed_dim * residual // setup.tensor_parallel  # split along the sequence


def saved_layer_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    if setup.checkpoint_activations or setup.offload_activations:
        return checkpointed_layer_bytes(shape, setup)
    return layer_activation_bytes(shape, setup)


def backward_workspace_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """Gradients alive inside one layer's backward: the residual-stream gradient and the branch gradient
    (embed-wide each) plus the larger of the ffn-wide gradient and attention's dq, dk, dv with flash
    attention's fp32 dq accumulator."""
    d, f, c, t = shape.embed_dim, shape.ffn_dim, setup.compute_bytes, setup.tensor_parallel
    if not setup.tp_styles:
        return setup.tokens * (2 * d * c + max(f * c, 3 * d * c + FLASH_DQ_ACCUM_BYTES * d))
    # Local heads and ffn; the residual gradients split along the sequence; the gathered input's gradient whole.
    return setup.tokens * (2 * d * c // t + max(f * c, (3 * d * c + FLASH_DQ_ACCUM_BYTES * d) // t) + d * c)


def root_activation_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """Saved outside the layers: the final norm's input and output (the output projection's input), the
    embedding dropout mask, the embedding layer norm's input."""
    d, c = shape.embed_dim, setup.compute_bytes
    residual = 4 if setup.autocast else c
    per_token = d * residual + shape.output_dim * c
    per_token += d if shape.dropout > 0 else 0
    per_token += d * residual if shape.layernorm_embedding else 0
    return setup.tokens * per_token


def logits_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """The loss backward's peak: the compute-dtype logits (saved by the loss), their gradient being written
    in the same dtype, and at most LOSS_FP32_CHUNK_COPIES chunks of rows in fp32 (the chunked eager loss)."""
    rows = min(setup.tokens, chunk_rows(shape.vocab_size))
    return (2 * setup.compute_bytes * setup.tokens + LOSS_FP32_CHUNK_COPIES * 4 * rows) * shape.vocab_size
