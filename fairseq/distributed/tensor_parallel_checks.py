"""The --model-parallel-size checks, apart from the plan's application (fairseq.distributed.tensor_parallel): that
module imports torch.distributed.tensor (~1 s), which a run without tensor parallelism never needs.
`check_tensor_parallel_config` reads the config only (validate(cfg)); `check_tensor_parallel_dictionary` reads
the task's dict.txt (at start-up, before anything is trained or saved). What a model can be split into is the
model's to say (its `tensor_parallel_sizes(cfg)` and `tensor_parallel_plan()`, read through `model_plan`, here so
that decoding's split, fairseq.distributed.tensor_parallel_decoding, needs no DTensor).
"""

import math
import os
from typing import Optional, Sequence

from fairseq import registry
from fairseq.distributed.mesh import TP_MESH_OF_ONE
from fairseq.data.dictionary import Dictionary

LOSS_PARALLEL_CRITERIA = ("vocab_parallel_cross_entropy",)


def suggested_size(tp: int, dims: Sequence[int]) -> int:
    """The largest model-parallel size up to `tp` that divides every one of `dims`."""
    common = 0
    for dim in dims:
        common = math.gcd(common, dim)
    return max(d for d in range(1, tp + 1) if common % d == 0) if common else 1


def check_tensor_parallel_shape(tp: int, heads: int, ffn: int, vocab: Optional[int], vocab_source: str = "") -> None:
    """One-line ValueError naming the dimension that --model-parallel-size `tp` does not divide and the size to use."""
    if tp == 1:
        return
    dims = [heads, ffn] + ([vocab] if vocab else [])
    use = suggested_size(tp, dims)
    if heads % tp:
        raise ValueError(
            f"--model-parallel-size {tp} does not divide --decoder-attention-heads {heads}: use "
            f"--model-parallel-size {use} (it divides the heads, the FFN width and the vocabulary)"
        )
    if ffn % tp:
        raise ValueError(
            f"--model-parallel-size {tp} does not divide --decoder-ffn-embed-dim {ffn}: use "
            f"--model-parallel-size {use} (it divides the heads, the FFN width and the vocabulary)"
        )
    if vocab and vocab % tp:
        source = f" of {vocab_source}" if vocab_source else ""
        raise ValueError(
            f"--model-parallel-size {tp} does not divide the vocabulary of {vocab} symbols{source}: use "
            f"--model-parallel-size {use}, or binarize with fairseq-preprocess --padding-factor {tp}"
        )


def _model_sizes(tp: int, model_cfg):
    """The model's TensorParallelSizes (its class says, from its config `model_cfg`), or the one-line refusal of
    a model without a plan."""
    sizes = registry.arch_model(model_cfg._name).tensor_parallel_sizes(model_cfg)
    if sizes is None:
        raise ValueError(
            f"--model-parallel-size {tp} needs a transformer_lm architecture (got --arch {model_cfg._name})"
        )
    return sizes


def check_tensor_parallel_config(model_parallel_size: int, model_cfg) -> None:
    """What validate(cfg) checks before anything starts, from the flags alone: a model with a plan, the options
    its plan does not cover, and its dims (the model's class reads them from its config `model_cfg`) against
    --model-parallel-size (also at size 1 under FAIRSEQ_TP_MESH_OF_ONE=1, which applies the plan)."""
    tp = model_parallel_size
    if tp == 1 and os.environ.get(TP_MESH_OF_ONE) != "1":
        return
    sizes = _model_sizes(tp, model_cfg)
    for flag in sizes.refused:
        raise ValueError(f"{flag} is not supported with --model-parallel-size {tp}: drop one of them")
    check_tensor_parallel_shape(tp, sizes.heads, sizes.ffn, None)


def check_tensor_parallel_dictionary(cfg) -> None:
    """The start-up check that reads a file: the vocabulary of the task's dict.txt (when there is one) against
    --model-parallel-size, with the model's dims in the suggestion (after validate(cfg))."""
    tp = cfg.distributed_training.model_parallel_size
    if tp == 1:
        return
    vocab, source = _dictionary_size(cfg.task)
    if vocab is not None:
        sizes = _model_sizes(tp, cfg.model)
        check_tensor_parallel_shape(tp, sizes.heads, sizes.ffn, vocab, source)


def _dictionary_size(task_cfg):
    """(symbols, path) of the language-modeling task's dict.txt, or (None, '') when there is none to read."""
    data = getattr(task_cfg, "data", None)  # tasks without a data directory (dummy_lm, plug-ins)
    if not isinstance(data, str) or not data:
        return None, ""
    path = os.path.join(data.split(os.pathsep)[0], "dict.txt")
    if not os.path.isfile(path):
        return None, ""

    return len(Dictionary.load(path)), path


def uses_loss_parallel(cfg) -> bool:
    criterion = cfg.criterion
    return getattr(criterion, "_name", None) in LOSS_PARALLEL_CRITERIA


def model_plan(model):
    """`model.tensor_parallel_plan()`, or the one-line refusal of a model without one."""
    plan_of = getattr(model, "tensor_parallel_plan", None)
    plan = plan_of() if plan_of is not None else None
    if plan is None:
        decoder = getattr(model, "decoder", None)
        raise TypeError(
            f"--model-parallel-size has a plan for fairseq's TransformerDecoder only, not for "
            f"{type(decoder).__name__} of {type(model).__name__}"
        )
    return plan
