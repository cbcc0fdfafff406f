"""Tensor-parallel serving (`--model-parallel-size N` under torchrun, srun or the project's launcher): rank 0
runs the HTTP server and the scheduler; every rank holds its part of the model (fairseq.distributed.
tensor_parallel_decoding) and a decode engine over it; each operation rank 0 makes on its engine or model is
broadcast to the other ranks (the followers), which apply the same operations in the same order, so the
collectives inside every forward line up and the caches stay in step.

The protocol: one message per broadcast, `torch.distributed.broadcast_object_list` from rank 0 over a gloo group
of all ranks (the control group: no GPU work while a follower waits); a message is a list of operations, applied
in order:

    ("add", Choice)        a row joins at the next step: prompt ids, max tokens, sampling options, seed, index
    ("cancel", choice id)  a row leaves at the next step
    ("step",)              one chunk of decode steps for every live row
    ("call", name, args)   a ServedModel call that runs the model outside the running batch (LeaderModel's)
    ("beat",)              nothing: rank 0 is idle (sent at least every 30 s, so that a follower's wait never
                           reaches the process group's timeout, --heartbeat-timeout)
    ("stop",)              rank 0 has drained: the followers leave their loop and exit 0

An error that only some ranks meet must not leave the others in a collective that never completes. So the ranks
agree, on a second gloo group whose collectives wait at most --heartbeat-timeout / 2 (30 s at most: `agree_s`):
before a call runs the model, on each rank's check of it (`ServedModel.precheck`: the decode memory check of a
best_of request, which reads each GPU's own free memory), and all refuse it together when one rank's check fails
(rank 0's client gets that rank's line); after each call and each step, on each rank's outcome. A call that
failed on some ranks fails on all (it changed no state; its client gets the first failing rank's line); a step
that failed on some ranks only (their engines are no longer in step) stops the server, as does a rank that does
not answer in time (it failed inside the model and left the others in one of its collectives, or it stalls):
`OutOfStep`, one line naming the rank and the cause, every rank exits non-zero (the launcher stops the ranks
still waiting). An error that every rank meets alike (the same input) fails the request and the server goes on.

`add` and `cancel` change nothing before the next step, so rank 0 keeps them and sends them with the next
operation that runs the model: one broadcast per chunk. Sampling is the same on every rank without sending any
token: a row draws from counter-based noise keyed by its seed (sent with the row) over logits that every rank
holds whole (the vocabulary-parallel output is all-gathered), so every rank picks the same token.
"""

import logging
import os
import re
import signal
import time
from datetime import timedelta
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from fairseq.checkpoint.inference import config_from_saved, read_checkpoint_config, transformers_model_type
from fairseq.distributed.launch import process_group_timeout
from fairseq.distributed.mesh import ParallelLayout, init_parallel_mesh
from fairseq.distributed.tensor_parallel_checks import check_tensor_parallel_config, check_tensor_parallel_dictionary
from fairseq.distributed.tensor_parallel_decoding import split_for_decoding
from fairseq.runtime.env import detect_launch
from fairseq.runtime.errors import UserError
from fairseq.serving.model import ServedModel
from fairseq.serving.scheduler import Fatal

logger = logging.getLogger("fairseq.serving.tensor_parallel")

HEARTBEAT_S = 30.0
AGREE_S = 30.0  # the most a rank waits for the others' check or outcome (they run the same work in step)
# The split model's decode steps run eagerly (the engine's device loop without CUDA graphs): capturing its NCCL
# collectives in a graph is what tests/gpu/test_serve_tensor_parallel_gpu.py tries, not yet run on a GPU.
CUDA_GRAPHS = False


class ServeError(UserError, ValueError):
    """A flag or checkpoint that tensor-parallel serving cannot take: one line, from every entry point and from
    the launcher (a UserError), without a traceback."""


class OutOfStep(Fatal, UserError):
    """The ranks are no longer in step (a step failed on some of them, or a rank did not answer): the server
    stops; told in one line naming the rank and the cause, on every rank and by the launcher."""


# ---- before the ranks start -------------------------------------------------------------------------------------
def check_tensor_parallel_launch(cfg) -> None:
    """What fairseq-serve checks before any rank starts: one server is one tensor-parallel group (as many ranks
    as --model-parallel-size); with N > 1, the flags and the checkpoint's model (its plan, heads, FFN width and
    vocabulary against N; the checkpoint's config is read for this)."""
    tp = cfg.distributed_training.model_parallel_size
    cpu = cfg.common.cpu or not torch.cuda.is_available()
    world = detect_launch(cfg.distributed_training, os.environ, cpu=cpu).world_size
    if tp == 1 and world > 1:
        raise ServeError(
            f"fairseq-serve without --model-parallel-size runs in one process, this launch has {world} ranks: start "
            f"one process, or pass --model-parallel-size {world} to split the model over them (one server per "
            "replica behind a load balancer for more)"
        )
    if world != tp:
        raise ServeError(
            f"fairseq-serve runs one tensor-parallel group: --model-parallel-size {tp} takes {tp} rank(s), this "
            f"launch has {world}; start {tp} (torchrun --nproc-per-node {tp}, srun --ntasks {tp}, or "
            f"--distributed-world-size {tp}), and one server per group behind a load balancer for more"
        )
    if tp == 1:
        return
    if cfg.generation.quantize not in (None, "none"):
        raise ServeError(f"--quantize {cfg.generation.quantize} is not supported with --model-parallel-size {tp}")
    path = cfg.common_eval.path or ""
    if os.pathsep in path or not os.path.exists(path):
        return  # told by the load, on every rank, as without tensor parallelism
    if os.path.isdir(path) and transformers_model_type(path) is not None:
        raise ServeError(
            f"--path {path} is a transformers directory: with --model-parallel-size {tp}, import it first "
            "(python scripts/import_hf.py) and serve the checkpoint it writes"
        )
    saved = config_from_saved(read_checkpoint_config(path, cfg.common.trust_legacy_checkpoint)[0])
    saved.distributed_training.model_parallel_size = tp
    if cfg.task.data:
        saved.task.data = cfg.task.data
    try:
        check_tensor_parallel_config(tp, saved.model)
        check_tensor_parallel_dictionary(saved)
    except ValueError as err:
        raise ServeError(f"--path {path}: {err}") from None


# ---- the group -----------------------------------------------------------------------------------------------
class TensorParallelGroup:
    """This rank's place in a tensor-parallel server: the 1-D mesh its model is split over, the gloo control
    group the operations travel on (created by every rank together, in this order)."""

    def __init__(self, cfg, device_type: str):
        self.size, self.rank = cfg.distributed_training.model_parallel_size, dist.get_rank()
        if self.rank != 0:  # before the groups: rank 0 can open its port (and get a SIGTERM) only once they exist
            keep_following_on_signals(self.rank)
        self.mesh = init_parallel_mesh(ParallelLayout(tp=self.size), device_type).tp_mesh
        timeout = process_group_timeout(cfg.distributed_training)
        self.timeout_s = timeout.total_seconds()
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        # the followers wait in a collective while rank 0 is idle: a beat well within the group's timeout
        self.heartbeat_s = min(HEARTBEAT_S, timeout.total_seconds() / 4)
        self.agree_s = min(AGREE_S, timeout.total_seconds() / 2)
        self.agreement = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.agree_s))

    def split(self, model):
        """This rank's part of `model` (fairseq.distributed.tensor_parallel_decoding)."""
        try:
            return split_for_decoding(model, self.mesh)
        except (TypeError, ValueError) as err:
            raise ServeError(str(err)) from None


def tensor_parallel_group(cfg) -> Optional[TensorParallelGroup]:
    """The group of a --model-parallel-size N > 1 rank (check_tensor_parallel_launch ran before); None for one
    process."""
    if cfg.distributed_training.model_parallel_size == 1:
        return None
    use_cuda = torch.cuda.is_available() and not cfg.common.cpu
    return TensorParallelGroup(cfg, "cuda" if use_cuda else "cpu")


def _broadcast(message: Optional[list], group) -> list:
    box = [message]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _first_line(err: BaseException) -> str:
    """The error's type and first line (gloo's `[file.cc:129] ` prefix left out)."""
    lines = str(err).strip().splitlines()
    first = re.sub(r"^\[[^]]*\] ", "", lines[0]) if lines else ""
    return f"{type(err).__name__}: {first}"


def agree(tp, what: str, error: Optional[str]) -> List[Tuple[int, str]]:
    """Every rank's outcome of the same `what` (its error line, or None), on the agreement group: [(rank, error)]
    of the ranks that failed, the same list on every rank. OutOfStep when a rank does not answer within
    tp.agree_s (it failed inside the model and left the others in a collective, it stalls, or it is gone)."""
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    try:
        dist.all_reduce(failed, group=tp.agreement)
        if failed.item() == 0:
            return []
        errors: list = [None] * tp.size
        dist.all_gather_object(errors, error, group=tp.agreement)
    except Exception as err:
        mine = f"{what} failed here ({error}), and " if error else ""
        raise OutOfStep(
            f"rank {tp.rank}: {mine}the other ranks did not answer within {tp.agree_s:g} s after the {what} (a "
            f"rank failed inside the model, stalls or is gone; {_first_line(err)}): the ranks are out of step, "
            "stopping the server"
        ) from None
    return [(rank, line) for rank, line in enumerate(errors) if line is not None]


def _named(failed: List[Tuple[int, str]]) -> str:
    rank, error = failed[0]
    others = f" (and on {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    return f"rank {rank}: {error}{others}"


def run_call(tp, model: ServedModel, name: str, args: tuple):
    """A ServedModel call that runs the model, on this rank in step with the others: refused on every rank when
    one rank's check of it fails (before anything runs), failed on every rank when it failed on one (after every
    rank ran it). Raises the error (this rank's own, else a RuntimeError naming the first rank that failed)."""
    refused = agree(tp, f"check of {name}", model.precheck(name, args))
    if refused:
        raise RuntimeError(_named(refused))
    try:
        result, error = getattr(model, name)(*args), None
    except Exception as err:
        result, error = None, err
    failed = agree(tp, name, None if error is None else _first_line(error))
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(_named(failed))
    return result


def run_step(tp, backend) -> list:
    """One chunk of decode steps on this rank, in step with the others. A step that failed alike on every rank
    raises its error (the running requests fail, the engines stay alike); one that failed on some ranks only, or
    differently, leaves their engines out of step: OutOfStep."""
    try:
        events, error = backend.step(), None
    except Exception as err:
        events, error = None, err
    failed = agree(tp, "decode step", None if error is None else _first_line(error))
    if failed and (len(failed) < tp.size or len({line for _, line in failed}) > 1):
        raise OutOfStep(f"{_named(failed)}: a decode step failed on some ranks only, stopping the server") from error
    if error is not None:
        raise error
    return events


class Leader:
    """Rank 0's backend (the scheduler's `add`, `cancel`, `step`, `live`, `idle`) and the model calls of the
    decode thread: each applied here and sent to the followers. Used from the decode thread only, and after it
    stopped, `stop` from the main thread."""

    def __init__(self, backend, model: ServedModel, tp: TensorParallelGroup):
        self.backend, self.model, self.tp = backend, model, tp
        self.pending: List[tuple] = []
        self.sent_at = time.monotonic()
        # the longest a running operation can take when a rank is stuck: its collectives' timeout, then the
        # agreement's (the drain waits this long for the decode thread before the followers are told to stop)
        self.stop_wait_s = tp.timeout_s + tp.agree_s + 5

    @property
    def live(self):
        return self.backend.live

    @property
    def kv_capacity_tokens(self):
        return self.backend.kv_capacity_tokens

    def add(self, choice) -> None:
        self.backend.add(choice)  # a row the engine refuses is not sent
        self.pending.append(("add", choice))

    def cancel(self, choice_id: str) -> None:
        self.backend.cancel(choice_id)
        self.pending.append(("cancel", choice_id))

    def step(self) -> list:
        self._send(("step",))
        return run_step(self.tp, self.backend)

    def idle(self) -> None:
        if time.monotonic() - self.sent_at >= self.tp.heartbeat_s:
            self._send(("beat",))

    def call(self, name: str, *args):
        self._send(("call", name, args))
        return run_call(self.tp, self.model, name, args)

    def stop(self) -> None:
        self._send(("stop",))

    def _send(self, operation: tuple) -> None:
        message, self.pending = self.pending + [operation], []
        try:
            _broadcast(message, self.tp.group)
        except Exception as err:
            raise OutOfStep(
                f"rank 0: the other ranks did not take the next operation ({_first_line(err)}): a rank is gone or "
                "stalls, stopping the server"
            ) from None
        self.sent_at = time.monotonic()


class LeaderModel:
    """The ServedModel as rank 0's scheduler sees it: the calls that run the model (score, top_logprobs, beam:
    echo, scoring and best_of) are sent to the followers first; the rest (text <-> ids) is the model's own."""

    def __init__(self, model: ServedModel, leader: Leader):
        self._model, self._leader = model, leader

    def score(self, ids):
        return self._leader.call("score", ids)

    def top_logprobs(self, ids, top_n):
        return self._leader.call("top_logprobs", ids, top_n)

    def beam(self, prompt, max_new, width, nbest):
        return self._leader.call("beam", prompt, max_new, width, nbest)

    def __getattr__(self, name):
        return getattr(self._model, name)


def follow(model: ServedModel, backend, tp: TensorParallelGroup) -> int:
    """A follower's loop: apply rank 0's operations until it says stop (the group installed
    keep_following_on_signals). Returns how many messages came; OutOfStep when the ranks fell out of step or
    rank 0 is gone."""
    handlers: dict = {
        "add": backend.add,
        "cancel": backend.cancel,
        "step": lambda: run_step(tp, backend),
        "call": lambda name, args: run_call(tp, model, name, args),
        "beat": lambda: None,
    }
    received = 0
    while True:
        try:
            message = _broadcast(None, tp.group)
        except Exception as err:  # rank 0 died, or stalled past the group's timeout
            raise OutOfStep(
                f"rank {tp.rank}: rank 0 is gone or stalls ({_first_line(err)}), stopping after {received} messages"
            ) from None
        received += 1
        for operation, *args in message:
            if operation == "stop":
                logger.info(f"rank {tp.rank}: rank 0 stopped serving ({received} messages followed)")
                return received
            _apply(handlers[operation], args, operation, tp.rank)


def _apply(handler: Callable, args, operation: str, rank: int) -> None:
    try:
        handler(*args)
    except Fatal:
        raise
    except Exception as err:
        if operation in ("add", "cancel"):  # rank 0 sends only what its own engine took: the engines now differ
            raise OutOfStep(f"rank {rank}: {operation} failed here but not on rank 0 ({_first_line(err)})") from None
        # run_call and run_step: every rank learned it, and rank 0 told its client
        logger.warning(f"rank {rank}: {operation} failed, as the ranks agreed: {err}")


def keep_following_on_signals(rank: int) -> None:
    """On a follower, from its start: SIGTERM and SIGINT (torchrun, srun and the launcher pass them to every rank)
    are logged and left to rank 0, which drains and then says stop (after its model is loaded, if it was still
    loading)."""

    def note(signum, frame):
        logger.info(f"rank {rank}: {signal.Signals(signum).name}: rank 0 drains; following it until it stops")

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, note)


def keep_stopping_on_sigterm() -> None:
    """On rank 0 once its HTTP side has stopped (uvicorn has put the default handlers back): a further SIGTERM
    (the user's, a supervisor's) is logged instead of killing rank 0 while it waits for the model to load or for
    the running operation to end, which would leave the followers to the process group's timeout. SIGINT (a
    second Ctrl-C) still ends it."""

    def note(signum, frame):
        logger.info("rank 0: SIGTERM: already stopping; the other ranks are told once the running operation ends")

    signal.signal(signal.SIGTERM, note)
