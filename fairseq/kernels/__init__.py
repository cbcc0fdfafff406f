"""Hand-written GPU kernels (Triton) for the few places where eager PyTorch makes several passes over memory
that one kernel makes once (the fused loss, decode attention, the int8 matmul). Each has an eager fallback where
Triton or CUDA is not available; Triton is not imported until a kernel is used."""

import functools
import os
import sys

import torch


def built_with_triton(build):
    """`build(triton, tl)` (its jitted kernels) as a function of no arguments that builds them on first use and
    then returns the same ones; None where Triton is not installed."""

    @functools.lru_cache(maxsize=None)
    def kernels():
        try:
            import triton  # deferred: optional
            import triton.language as tl  # deferred: optional
        except ImportError:
            return None
        return build(triton, tl)

    kernels.__doc__ = build.__doc__
    return kernels


# Functions whose result a compiled step takes as a constant (they read the environment or try an import, which
# dynamo would otherwise trace). torch.compiler's marker loads torch._dynamo (~1 s, with torch.distributed.tensor
# and fsdp), which the entry points that never compile must not pay at import: they are marked when a step is
# compiled (fairseq.generation.compiled_step calls mark_constant_results), or at once where dynamo is loaded.
_CONSTANT_RESULTS = []


def constant_result(fn):
    """Declare `fn`'s result a constant to torch.compile (marked as the comment above says)."""
    _CONSTANT_RESULTS.append(fn)
    if "torch._dynamo" in sys.modules:
        torch.compiler.assume_constant_result(fn)
    return fn


def mark_constant_results() -> None:
    for fn in _CONSTANT_RESULTS:
        torch.compiler.assume_constant_result(fn)  # marks `fn` itself: idempotent


@constant_result
def triton_interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1: on CPU tensors too, as the CPU tests
    do). A constant to torch.compile: a compiled decode step does not trace the environment."""
    return os.environ.get("TRITON_INTERPRET") == "1"
