"""The one-token decode step compiled by inductor (torch.compile), run inside the captured CUDA graphs; and the
prompts' forward (the prefill) compiled behind the same switch.

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
  shape, so one compile per row count and window. The step reads no plain-int length (positions come from
  `slot`, a device tensor): prompts of any width share the compile.
- A compile happens at the first step of its shapes, which the graph runner always runs before capturing (its
  warm-up, outside capture): no compile under capture.
- The first step over new caches runs eagerly before the compiled one: the caches are allocated on a first call,
  and the compiled code should see them allocated (the step is repeated: it writes the same keys and values at
  the same slot, so the repeat changes nothing).
- The split-KV kernels enter inductor's graph as one opaque op (fairseq::decode_attention); the cache writes
  are in place (causal_attention._write_slot writes the whole buffer).

The prefill (`CompiledPrefill`): the prompts' forward into the caches (the decoders' forward_static_prefill) with
the rows and the length as dynamic dimensions, the length padded to a multiple of PREFILL_MULTIPLE (inductor's
default mode whatever the step's: autotuning its GEMMs lengthens every compile): one compile
(two: one row, several) for every prompt width and batch, per size of the caches. SequenceGenerator's prompts over
the graph runner's caches and the decode engine's joining rows (written straight into the running caches) run
through it; the scores of the prompt tokens are computed from its features as the eager prefill computes them.

Off by default: `FAIRSEQ_COMPILE_DECODE_STEP=1` (inductor's default mode) or `=max-autotune-no-cudagraphs` in the
environment (read at import), `set_compile_decode_step(...)`, or `compile_step=` of SequenceGenerator and
DecodeEngine. The CUDA-graph mode of torch.compile ("reduce-overhead") is not offered: the graphs are ours. A
compile that fails, and torch's recompile limit reached (RECOMPILE_LIMIT, counted over the process), are each
said in one warning, and that generator goes on uncompiled.
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
# Compiles a process may keep of the step, and of the prefill (dynamo's limit is per function, 8 by default): row
# counts x windows x the generators alive.
RECOMPILE_LIMIT = 64
# A compiled prefill's length is rounded up to a multiple of this (see prefill_length).
PREFILL_MULTIPLE = 64

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


class _Compiled:
    """`fn` compiled by torch.compile (static shapes unless `dynamic` says otherwise: torch.compile's); a compile
    that fails, or torch's recompile limit reached, leaves `fn` uncompiled from then on, said in one warning
    (`what` names it)."""

    def __init__(self, fn: Callable, what: str, mode: str, backend, dynamic: Optional[bool] = False):
        options = {"mode": mode} if backend == "inductor" else {}
        mark_constant_results()
        self.fn, self.what, self.mode = fn, what, mode
        self.compiled = torch.compile(fn, backend=backend, dynamic=dynamic, **options)
        self.shapes = set()  # the shapes compiled for: one compile each
        self.failed = False  # a compile failed or the limit was reached: the uncompiled fn from then on

    def _run(self, shape, *args):
        if self.failed:
            return self.fn(*args)
        try:
            # Past the limit dynamo would run the function uncompiled without a word; failing, it is said here.
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
                out = self.compiled(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            logger.warning(
                "the compiled %s reached torch.compile's recompile limit (%d compiles of it in this process, "
                "generators and engines together); this generator runs it uncompiled from now on",
                self.what,
                RECOMPILE_LIMIT,
            )
            self.failed = True
            return self.fn(*args)
        except torch._dynamo.exc.TorchDynamoException as error:  # a compile's failure: decode on, uncompiled
            if shape in self.shapes:  # compiled for already: an error of the run's, not the compile's
                raise
            cause = getattr(error, "inner_exception", None) or error  # dynamo wraps the backend's error
            logger.warning(
                "compiling the %s failed (%s: %s); this generator runs it uncompiled",
                self.what,
                type(cause).__name__,
                " ".join(str(cause).split())[:300],
            )
            self.failed = True
            return self.fn(*args)
        self.shapes.add(shape)
        return out


class CompiledStep(_Compiled):
    """`step(tokens, slot, states, window)` compiled (see the module doc); called as the step itself."""

    def __init__(self, step: Callable, model: torch.nn.Module, mode: str = "default", backend="inductor"):
        """`model`: what the step runs (its dtype says whether the decode attention kernel runs); `backend`:
        torch.compile's (tests pass a counting one; `mode` applies to inductor only)."""
        super().__init__(step, "decode step", mode, backend)
        self.step, self.model = step, model
        self._warm_states = None
        self._window_free: Optional[bool] = None

    def __call__(self, tokens: Tensor, slot: Tensor, states: List[dict], window: int) -> Tensor:
        if self.failed:
            return self.step(tokens, slot, states, window)
        if self._window_free is None:  # the kernel reads live lengths: the window is no shape
            self._window_free = decode_attention_available(
                torch.empty(0, dtype=model_dtype(self.model), device=tokens.device)
            )
        if states is not self._warm_states:  # new caches: allocated by an eager step first (see the module doc)
            self.step(tokens, slot, states, window)
            self._warm_states = states
        shape = (tokens.size(0), None if self._window_free else window)
        return self._run(shape, tokens, slot, states, shape[1])


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of `model`'s first floating-point parameter (its activations'), float32 without one."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def prefill_length(length: int, limit: int) -> int:
    """The length a prefill of `length` tokens runs at: rounded up to a multiple of PREFILL_MULTIPLE, at most
    `limit` (the caches' capacity, the model's positions) and at least `length`."""
    return max(length, min(-(-length // PREFILL_MULTIPLE) * PREFILL_MULTIPLE, limit))


class CompiledPrefill(_Compiled):
    """The ensemble's static prefill (`static_prefill(tokens [B, T], rows, states) -> features`: one forward of
    prompts into the caches' rows `rows`, slots 0 .. T-1) compiled with the rows and the length as dynamic
    dimensions, the prompts right-padded with <pad> to a multiple of PREFILL_MULTIPLE (`prefill_length`): two
    compiles (one row; more rows) for every prompt length and batch, per size of the caches. Causal attention: a
    prompt's positions never see the padding after them, so its features and the keys and values of its slots are
    the unpadded forward's (up to the kernels' rounding: attention reduces over more, masked, keys); the padded
    slots hold finite values that the steps overwrite before they read them."""

    def __init__(self, ensemble, pad: int, mode: str = "default", backend="inductor"):
        super().__init__(ensemble.static_prefill, "prefill", mode, backend, dynamic=None)
        self.ensemble, self.pad = ensemble, pad

    def padded_length(self, length: int, capacity: int = 0) -> int:
        """The length a prefill of `length` tokens runs at, within the caches' `capacity` when given."""
        limit = self.ensemble.max_decoder_positions()
        return prefill_length(length, min(limit, capacity) if capacity else limit)

    def __call__(self, tokens: Tensor, states: List[dict], rows: Optional[Tensor] = None) -> List[Tensor]:
        """Feed `tokens` [B, T] into the caches `states`, slots 0 .. T-1 of rows `rows` (a long tensor [B] on the
        device; default: rows 0 .. B-1): each model's features [B, T, C] (views of the padded forward's). The
        plain-int lengths are left alone (the caller says what is cached)."""
        count, length = tokens.shape
        if rows is None:
            rows = torch.arange(count, device=tokens.device)
        capacity = self.ensemble.static_cache_shape(states, count, tokens.device)[1]  # allocated eagerly
        padded = tokens.new_full((count, self.padded_length(length, capacity)), self.pad)
        padded[:, :length] = tokens
        for tensor, dim in ((padded, 0), (padded, 1), (rows, 0)):  # few compiles; one row is its own
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        features = self._run(tuple(padded.shape), padded, rows, states)
        return [f[:, :length] for f in features]
