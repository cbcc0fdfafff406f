"""The one-token decode step compiled by inductor (torch.compile), run inside the captured CUDA graphs.

A decode step of the 1.3B preset is ~400 small kernels (24 layers of layer norms, GEMMs, bias, GELU, residual
adds, cache writes and the log-softmax); the CUDA graphs (fairseq.generation.cuda_graph_decoding) removed the
host's time between them, not the kernels. Compiled, the elementwise work fuses into the GEMMs' neighbours: the
same step in fewer, larger kernels, which the graphs then capture as they capture the eager step.

What is compiled is the StepModel's static step (`step(tokens [R, 1], slot, states, window) -> log-probs [R, V]`:
the ensemble's forward_static_step, the log-softmax in fp32, the step-independent masks), nothing around it: the
loops' choice of tokens and bookkeeping stay eager inside the same graph. It is used wherever that step runs
through the graph runner: SequenceGenerator's device loops and step-by-step loop on CUDA, the decode engine.

- Shapes are static (`dynamic=False`): one compile per row count the graphs are captured for (1, 2, 4, 8, then
  multiples of 8, fairseq.generation.cuda_graph_decoding.round_up_sentences). Where the split-KV decode attention
  kernel runs (CUDA), attention reads each row's live length from the device whatever the window, so the window
  is left out of the compiled call (the whole capacity is the kernel's bound, which sizes its grid only): one
  compile per row count, shared by every window's graph. Elsewhere (SDPA over a window: the CPU) the window is a
  shape, so one compile per row count and window.
- A compile happens at the first step of its shapes, which the graph runner always runs before capturing (its
  warm-up, outside capture): no compile under capture.
- The first step over new caches runs eagerly before the compiled one: the caches are allocated on a first call,
  and the compiled code should see them allocated (the step is repeated: it writes the same keys and values at
  the same slot, so the repeat changes nothing).
- The split-KV kernels enter inductor's graph as one opaque op (fairseq::decode_attention); the cache writes
  are in place (causal_attention._write_slot writes the whole buffer).

Off by default: `FAIRSEQ_COMPILE_DECODE_STEP=1` (inductor's default mode) or `=max-autotune-no-cudagraphs` in the
environment (read at import), `set_compile_decode_step(...)`, or `compile_step=` of SequenceGenerator and
DecodeEngine. The CUDA-graph mode of torch.compile ("reduce-overhead") is not offered: the graphs are ours.
"""

import logging
import os
from typing import Callable, List, Optional, Union

import torch
from torch import Tensor

from fairseq.kernels import mark_constant_results
from fairseq.kernels.decode_attention import decode_attention_available

logger = logging.getLogger(__name__)

MODES = ("default", "max-autotune-no-cudagraphs")
# Compiles a process may keep of the step (dynamo's limit is per function, 8 by default): row counts x windows
# x the generators alive.
RECOMPILE_LIMIT = 64

_setting: List[Optional[str]] = [None]


def compile_mode(value: Union[None, bool, str]) -> Optional[str]:
    """The inductor mode `value` asks for, or None (off): False, None, "", "0" are off; True, "1", "default"
    inductor's default mode; "max-autotune-no-cudagraphs" (or "max-autotune") that mode."""
    if value is None or value is False or value in ("", "0"):
        return None
    if value is True or value in ("1", "default"):
        return "default"
    if value in ("max-autotune", "max-autotune-no-cudagraphs"):
        return "max-autotune-no-cudagraphs"
    raise ValueError(
        f"compile decode step: {value!r} is not a mode; use 0 (off), 1 (inductor's default mode) or "
        "max-autotune-no-cudagraphs (FAIRSEQ_COMPILE_DECODE_STEP, compile_step=)"
    )


def set_compile_decode_step(value: Union[None, bool, str]) -> Optional[str]:
    """Compile the decode steps of generators and engines built from now on (see compile_mode); returns the
    previous mode."""
    previous, _setting[0] = _setting[0], compile_mode(value)
    return previous


def compile_decode_step_mode() -> Optional[str]:
    """The mode set by set_compile_decode_step or FAIRSEQ_COMPILE_DECODE_STEP (None: off)."""
    return _setting[0]


_setting[0] = compile_mode(os.environ.get("FAIRSEQ_COMPILE_DECODE_STEP", "0"))


class CompiledStep:
    """`step(tokens, slot, states, window)` compiled (see the module doc); called as the step itself."""

    def __init__(self, step: Callable, model: torch.nn.Module, mode: str = "default", backend="inductor"):
        """`model`: what the step runs (its dtype says whether the decode attention kernel runs); `backend`:
        torch.compile's (tests pass a counting one; `mode` applies to inductor only)."""
        self.step, self.model = step, model
        options = {"mode": mode} if backend == "inductor" else {}
        mark_constant_results()
        self.compiled = torch.compile(step, backend=backend, dynamic=False, **options)
        self.mode = mode
        self._warm_states = None
        self._window_free: Optional[bool] = None
        self.shapes = set()  # the (rows, window or None) compiled for: one compile each
        self.failed = False  # a compile failed: the uncompiled step from then on (said once)

    def __call__(self, tokens: Tensor, slot: Tensor, states: List[dict], window: int) -> Tensor:
        if self.failed:
            return self.step(tokens, slot, states, window)
        if self._window_free is None:  # the kernel reads live lengths: the window is no shape
            dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
            self._window_free = decode_attention_available(torch.empty(0, dtype=dtype, device=tokens.device))
        if states is not self._warm_states:  # new caches: allocated by an eager step first (see the module doc)
            self.step(tokens, slot, states, window)
            self._warm_states = states
        shape = (tokens.size(0), None if self._window_free else window)
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                out = self.compiled(tokens, slot, states, shape[1])
        except Exception as error:  # a compile's failure (a first call of its shape): decode on, uncompiled
            if shape in self.shapes:
                raise
            cause = getattr(error, "inner_exception", None) or error  # dynamo wraps the backend's error
            logger.warning(
                "compiling the decode step failed (%s: %s); this generator decodes with the uncompiled step",
                type(cause).__name__,
                " ".join(str(cause).split())[:300],
            )
            self.failed = True
            return self.step(tokens, slot, states, window)
        self.shapes.add(shape)
        return out
