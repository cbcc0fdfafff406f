"""One-token decode steps replayed from CUDA graphs (used by fairseq.generation.sequence_generator on CUDA).

A decoder step of a 24-layer model is ~200 small kernels launched from Python: at batch 1, and even at batch
32, the host is slower than the GPU. `TransformerDecoder.forward_static_step` computes a step with shapes that
depend only on the number of rows (positions and the cache slot come from a device tensor, attention runs
over the whole reserved cache, masked), so it is captured once into a `torch.cuda.CUDAGraph` and then replayed:
one launch per step, outside the model.

`GraphedDecodeStep` owns, for one generator:

- the incremental states (KV caches), reserved at the rows and length of a generate call and kept for the
  next call when they are large enough and the models' tensors have not moved (checked at every call); the
  graphs read these buffers, so they live as long as the graphs;
- the static input and output buffers (token per row, the slot, fp32 log-probabilities per row), allocated
  outside the graphs so no graph's memory holds them;
- one graph per row count, the row count rounded up (1, 2, 4, 8 sentences, then multiples of 8, times the
  beam) so that finished sentences leaving the batch cost a few captures, not one per sentence; all graphs
  share one memory pool (they never run concurrently, and none keeps an output in it). The rows past the
  live ones compute on stale (finite) cache rows that nothing reads.

What a graph runs is the generator's `step_fn(tokens [R, 1], slot [1], states, window) -> log-probs [R, V]`
(the ensemble's static steps, log-softmax in fp32 and the step-independent masks), so a replay gives the
log-probabilities the eager path computes. Attention reads the cache's first `window` slots, the live length
rounded up to ATTENTION_WINDOW (one graph per row count and window), not its whole capacity: a step's reads
follow what is cached. fairseq.generation.device_decoding (and device_beam_search) captures a whole decode
step (the model, the selection of the next tokens, their bookkeeping, for beams the reorder of the caches)
through `replay(key, fn)`, on the same caches and pool. With `capture=False` the same buffers and functions
run eagerly: that is how the CPU tests exercise everything but the capture itself.

Capture: a warm-up run on a side stream (the real step: a function that advances state, as the whole decode
step does, runs once per call whether captured or replayed), then the capture on that stream, which records
and runs nothing; later calls replay. SDPA is restricted to the flash, memory-efficient and math kernels:
cuDNN's attention is left out because some cuDNN versions are known to read out of bounds when replayed from a
graph over long uncausal key ranges, which this step is.
"""

from itertools import chain
from typing import Callable, Dict, Hashable, List, Optional

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

# Cache capacity is rounded up to this many slots: later calls with a slightly longer limit reuse the cache
# and graphs, and the attention mask's rows stay aligned for the fused kernels.
CAPACITY_MULTIPLE = 64
# Attention reads the cache up to the live length rounded up to this many slots: few graphs per row count
# (a 2,048-token cache has 8 windows), and a step reads at most this many unused slots per row.
ATTENTION_WINDOW = 256


def round_up_sentences(sentences: int) -> int:
    """The number of sentences a graph is captured for: 1, 2, 4, 8, then multiples of 8."""
    if sentences <= 8:
        return 1 << max(sentences - 1, 0).bit_length()
    return -(-sentences // 8) * 8


def attention_window(step: int, capacity: int) -> int:
    """The cache slots a step feeding the token at index `step` attends over: its live length (step + 1)
    rounded up to ATTENTION_WINDOW, at most the capacity."""
    return min(capacity, -(-(step + 1) // ATTENTION_WINDOW) * ATTENTION_WINDOW)


def _attention_kernels():
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class GraphedDecodeStep:
    """Incremental states and CUDA graphs of one-token steps for the models of an `EnsembleModel`."""

    def __init__(
        self, ensemble, step_fn: Callable[[Tensor, Tensor, List[dict], int], Tensor], width: int, capture: bool = True
    ):
        """`step_fn(tokens, slot, states, window)`: log-probabilities [R, width] of tokens [R, 1] at index
        `slot`, attending over the first `window` cache slots; `capture=False`: run it eagerly on the same
        buffers (no GPU needed)."""
        self.ensemble = ensemble
        self.step_fn = step_fn
        self.width = width
        self.capture = capture
        self.states: Optional[List[dict]] = None
        self.rows = self.capacity = 0
        self.beam = 1
        self.tensors_key = None
        self.graphs: Dict[Hashable, "torch.cuda.CUDAGraph"] = {}
        self.pool = self.stream = None  # one memory pool and one capture stream for the graphs
        self.tokens = self.slot = self.out = None
        # Buffers of the callers' own captured functions (device_decoding's), dropped with the graphs.
        self.extra: Dict[str, object] = {}

    def _tensors_key(self, device: torch.device) -> tuple:
        """What the graphs read besides the caches: every parameter and buffer, by address, dtype and shape."""
        tensors = chain.from_iterable(chain(m.parameters(), m.buffers()) for m in self.ensemble.models)
        return (device,) + tuple((t.data_ptr(), t.dtype, t.shape) for t in tensors)

    def begin(self, bsz: int, beam: int, max_length: int, device: torch.device) -> List[dict]:
        """The incremental states (one per model) for a generate call of `bsz` sentences x `beam` hypotheses and
        up to `max_length` tokens, emptied: the last call's, with its graphs, when they are large enough."""
        rows = beam * round_up_sentences(bsz)
        key = self._tensors_key(device)
        if key != self.tensors_key or rows > self.rows or max_length > self.capacity or beam != self.beam:
            same_models = key == self.tensors_key and beam == self.beam
            rows = max(rows, self.rows) if same_models else rows
            capacity = -(-max_length // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
            capacity = max(capacity, self.capacity) if same_models else capacity
            self._allocate(rows, capacity, beam, device, key)
        else:
            for m, state in zip(self.ensemble.models, self.states):
                m.decoder.set_incremental_length(state, 0)
        return self.states

    def _allocate(self, rows: int, capacity: int, beam: int, device: torch.device, key: tuple) -> None:
        # Graphs first: they hold the old buffers' addresses.
        self.graphs, self.states, self.tokens, self.slot, self.out, self.extra = {}, None, None, None, None, {}
        self.states = self.ensemble.new_incremental_states(max_batch=rows, max_length=capacity)
        self.rows, self.capacity, self.beam, self.tensors_key = rows, capacity, beam, key
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.out = torch.zeros(rows, self.width, dtype=torch.float32, device=device)
        if self.capture:
            self.pool = torch.cuda.graph_pool_handle()
            if self.stream is None or self.stream.device != device:
                self.stream = torch.cuda.Stream(device=device)

    def __call__(self, tokens: Tensor, step: int) -> Tensor:
        """Log-probabilities [R, width] of the next token, given `tokens` [R], the token at index `step` of each
        hypothesis (R at most the rows of `begin`; the caches hold its first `step` tokens). The result is a
        view of the output buffer, valid until the next call."""
        rows = tokens.size(0)
        graph_rows = self.beam * round_up_sentences(rows // self.beam)
        window = attention_window(step, self.capacity)
        self.tokens[:rows, 0].copy_(tokens)
        self.slot.fill_(step)
        self.replay(("step", graph_rows, window), lambda: self._run(graph_rows, window))
        self.set_length(step + 1)
        return self.out[:rows]

    def set_length(self, length: int) -> None:
        """Say that the caches hold `length` tokens (static steps leave the plain-int lengths alone)."""
        for m, state in zip(self.ensemble.models, self.states):
            m.decoder.set_incremental_length(state, length)

    def replay(self, key: Hashable, fn: Callable[[], None]) -> None:
        """Run `fn` (which reads and writes buffers allocated outside it) from the CUDA graph captured for
        `key`, capturing it on first use; eagerly without capture."""
        if not self.capture:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:  # the capture's warm-up ran `fn` once, for real: this call's work is done
            self.graphs[key] = self._capture(fn)
            return
        graph.replay()

    def _run(self, rows: int, window: int) -> None:
        self.out[:rows].copy_(self.step_fn(self.tokens[:rows], self.slot, self.states, window))

    def _capture(self, fn: Callable[[], None]) -> "torch.cuda.CUDAGraph":
        stream = self.stream
        with torch.cuda.device(self.tokens.device):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), _attention_kernels():
                fn()  # warm-up: kernels' first-call setup must not happen under capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: CUDA calls of other threads (a data loader's) do not invalidate this capture.
                with (
                    _attention_kernels(),
                    torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"),
                ):
                    fn()
            except RuntimeError as error:
                raise RuntimeError(
                    f"capturing the decoder step in a CUDA graph failed ({error}); decode "
                    "without: --no-cuda-graphs (SequenceGenerator(..., cuda_graphs=False))"
                ) from error
        return graph
