"""What validate(cfg) checks about --model-parallel-size before anything starts (the model's dims, options the
tensor-parallel plan does not cover), apart from the plan itself (fairseq.distributed.tensor_parallel): that
module imports torch.distributed.tensor (~1 s), which a run without tensor parallelism never needs.
"""

import math
from typing import Optional, Sequence

LOSS_PARALLEL_CRITERIA = ("vocab_parallel_cross_entropy",)
# Model options the plan does not cover (each adds parameters or a softmax it does not split).
UNSUPPORTED_OPTIONS = (
    ("adaptive_input", "--adaptive-input"),
    ("adaptive_softmax_cutoff", "--adaptive-softmax-cutoff"),
    ("character_embeddings", "--character-embeddings"),
)


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
        raise ValueError(f"--model-parallel-size {tp} does not divide --decoder-attention-heads {heads}: use "
                         f"--model-parallel-size {use} (it divides the heads, the FFN width and the vocabulary)")
    if ffn % tp:
        raise ValueError(f"--model-parallel-size {tp} does not divide --decoder-ffn-embed-dim {ffn}: use "
                         f"--model-parallel-size {use} (it divides the heads, the FFN width and the vocabulary)")
    if vocab and vocab % tp:
        source = f" of {vocab_source}" if vocab_source else ""
        raise ValueError(f"--model-parallel-size {tp} does not divide the vocabulary of {vocab} symbols{source}: use "
                         f"--model-parallel-size {use}, or binarize with fairseq-preprocess --padding-factor {tp}")


def check_tensor_parallel_config(cfg) -> None:
    """What validate(cfg) can check before anything starts: the model's dims against --model-parallel-size,
    unsupported options, and the vocabulary when the task's dictionary file is at hand."""
    tp = cfg.distributed_training.model_parallel_size
    if tp == 1:
        return
    model = cfg.model
    heads = getattr(model, "decoder_attention_heads", None)
    ffn = getattr(model, "decoder_ffn_embed_dim", None)
    if heads is None or ffn is None:
        raise ValueError(f"--model-parallel-size {tp} needs a transformer_lm architecture (got --arch "
                         f"{getattr(model, '_name', '?')})")
    for field_name, flag in UNSUPPORTED_OPTIONS:
        if getattr(model, field_name, None):
            raise ValueError(f"{flag} is not supported with --model-parallel-size {tp}: drop one of them")
    if cfg.common.fp8:
        raise ValueError(f"--fp8 is not supported with --model-parallel-size {tp}: drop one of them")
    if cfg.distributed_training.compile:
        raise ValueError(f"--compile is not supported with --model-parallel-size {tp}: drop one of them")
    vocab, source = _dictionary_size(cfg.task)
    check_tensor_parallel_shape(tp, heads, ffn, vocab, source)


def _dictionary_size(task_cfg):
    """(symbols, path) of the language-modeling task's dict.txt, or (None, '') when there is none to read."""
    import os

    data = getattr(task_cfg, "data", None)
    if not isinstance(data, str) or not data:
        return None, ""
    path = os.path.join(data.split(os.pathsep)[0], "dict.txt")
    if not os.path.isfile(path):
        return None, ""
    from fairseq.data import Dictionary

    return len(Dictionary.load(path)), path


def uses_loss_parallel(cfg) -> bool:
    criterion = cfg.criterion
    return getattr(criterion, "_name", None) in LOSS_PARALLEL_CRITERIA
