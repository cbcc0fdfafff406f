"""fairseq-serve: an OpenAI-compatible completions server for a trained language model.

    fairseq-serve --path checkpoints/checkpoint_best.pt data-bin --host 127.0.0.1 --port 8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"prompt": "the cat", "max_tokens": 16, "temperature": 0}'

--path is a checkpoint file, a sharded checkpoint directory or a transformers OPT/XGLM directory (imported
first, as scripts/import_hf.py does); DATA (optional) holds the dictionary when the checkpoint's saved data
directory is elsewhere. The HTTP port opens at once (GET /health answers 503 until the model is loaded);
SIGTERM (or Ctrl-C) stops accepting, lets the running requests finish (--drain-timeout) and exits 0.
With --model-parallel-size N under torchrun, srun or --distributed-world-size N, the model is split over the N
ranks: rank 0 serves HTTP and the others follow its decode loop (fairseq.serving.tensor_parallel).
docs/serving.md has the API, the limits, the metrics and tensor-parallel serving.
"""

import logging
import os
import tempfile
import threading
from typing import List, Optional

from fairseq.distributed.launch import call_main
from fairseq.frontend import options
from fairseq.dataclass.serving import ServeConfig, check_serve_config
from fairseq.dataclass.utils import config_from_namespace
from fairseq.export.hf_import import CHECKPOINT_NAME, import_hf
from fairseq.hub.hub_utils import GeneratorHubInterface
from fairseq.hub.pretrained import _is_transformers_directory
from fairseq.serving.completions import Limits
from fairseq.serving.engine_backend import make_backend
from fairseq.serving.model import ServedModel
from fairseq.serving.scheduler import Scheduler
from fairseq.serving.tensor_parallel import (
    CUDA_GRAPHS as TP_CUDA_GRAPHS,
    Leader,
    LeaderModel,
    OutOfStep,
    TensorParallelGroup,
    check_tensor_parallel_launch,
    follow,
    keep_stopping_on_sigterm,
    tensor_parallel_group,
)
from fairseq_cli.console import run_console_script
from fairseq_cli.generate import load_ensemble, setup

try:  # the serve extra (starlette, uvicorn): main says how to install it when it is missing
    from fairseq.serving.app import Server, build_app, draining_server, uvicorn
except ImportError:
    Server = build_app = draining_server = uvicorn = None

logger = logging.getLogger("fairseq_cli.serve")
KEYS_ENV = "FAIRSEQ_API_KEYS"


def read_api_keys(path: Optional[str]) -> List[str]:
    """--api-keys FILE (one key a line; blank lines and `#` comments skipped), else $FAIRSEQ_API_KEYS
    (comma-separated); [] when neither is given (no key asked for)."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                keys = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        except OSError as err:
            raise ValueError(
                f"--api-keys {path}: cannot read it ({err.strerror or err}); pass a text file with one key a line"
            ) from None
        if not keys:
            raise ValueError(f"--api-keys {path} holds no key: write one key a line")
        return keys
    return [key.strip() for key in os.environ.get(KEYS_ENV, "").split(",") if key.strip()]


def load_served_model(cfg, split=None):
    """The ServedModel of --path (one model: no ensemble), loaded as fairseq-interactive loads it (--bf16, --fp16,
    --quantize, --cpu), a transformers directory imported first; `split`: this rank's part of it (tensor
    parallelism, TensorParallelGroup.split)."""
    path = cfg.common_eval.path or ""
    if os.pathsep in path:
        raise ValueError(f"--path {path}: fairseq-serve serves one model, not an ensemble; pass one checkpoint")
    name = cfg.serve.served_model_name or os.path.basename(os.path.normpath(path)) or "model"
    # a directory with a transformers config.json (the hub's rule; a sharded checkpoint directory has none)
    if path and os.path.isdir(path) and _is_transformers_directory(path, CHECKPOINT_NAME, "."):
        work = tempfile.mkdtemp(prefix="fairseq-serve-import-")
        logger.info(f"{path} is a transformers directory: importing it into {work}")
        import_hf(path, os.path.join(work, "model"))
        cfg.common_eval.path = os.path.join(work, "model", CHECKPOINT_NAME)
        if not cfg.task.data:
            cfg.task.data = os.path.join(work, "model")
    if split is not None and not TP_CUDA_GRAPHS:
        # the hub's generators (best_of, beam) would capture the split model's collectives in CUDA graphs too
        cfg.generation.no_cuda_graphs = True
    models, task, device, codec = load_ensemble(cfg, split)
    hub = GeneratorHubInterface(cfg, task, models)
    hub.codec, hub.tokenizer, hub.bpe = codec, codec.tokenizer, codec.bpe  # the checkpoint's, as interactive's
    hub.quantized = cfg.generation.quantize  # load_ensemble quantized the weights already
    return ServedModel(hub, name)


def cuda_graphs(cfg, tp: Optional[TensorParallelGroup]) -> bool:
    """Whether the engine replays its steps from CUDA graphs (on CUDA): unless --no-cuda-graphs, and under tensor
    parallelism only once capturing its collectives is known to work (fairseq.serving.tensor_parallel)."""
    return not cfg.generation.no_cuda_graphs and (tp is None or TP_CUDA_GRAPHS)


def start_model(server, cfg, tp: Optional[TensorParallelGroup] = None) -> None:
    """Load the model and start the decode thread (the server answers 503 until this is done). Under tensor
    parallelism (rank 0 of `tp`) the scheduler's backend and model calls go through a Leader, which sends each
    operation to the other ranks."""
    try:
        model = load_served_model(cfg, tp.split if tp else None)
    except Exception as err:  # told by /health and the log; the process exits
        logger.error(f"fairseq-serve: error: {err}")
        server.load_error = f"the model failed to load: {err}"
        raise
    serve = cfg.serve
    positions = model.max_positions
    # the engine reserves the caches of --max-running rows x the positions at start (checked against the GPU's
    # free memory): that is the batch's KV capacity, which --max-batch-tokens may lower
    backend = make_backend(model, serve.max_running, cuda_graphs=cuda_graphs(cfg, tp))
    capacity = backend.kv_capacity_tokens or serve.max_running * positions
    limits = Limits(
        max_prompt_tokens=serve.max_prompt_tokens or positions - 1,
        max_tokens=serve.max_tokens if serve.max_tokens is not None else positions,
        max_batch_tokens=min(serve.max_batch_tokens or capacity, capacity),
    )
    scheduled = model
    if tp is not None:
        backend = server.leader = Leader(backend, model, tp)
        scheduled = LeaderModel(model, backend)
    scheduler = Scheduler(
        scheduled, backend, serve.max_running, limits.max_batch_tokens, serve.max_queue, server.metrics
    )
    scheduler.on_fatal = server.on_fatal
    scheduler.start()
    server.ready(model, scheduler, limits)
    logger.info(
        f"serving {model.name} ({positions} positions) on {model.device}"
        f"{f' (tensor parallelism over {tp.size} ranks)' if tp else ''}: --max-running {serve.max_running}, "
        f"--max-batch-tokens {limits.max_batch_tokens}"
    )


def follow_rank(cfg, tp: TensorParallelGroup) -> None:
    """A rank other than 0: its part of the model and an engine over it, applying rank 0's operations until rank
    0 stops (fairseq.serving.tensor_parallel; the group's construction made it keep following on signals)."""
    model = load_served_model(cfg, tp.split)
    backend = make_backend(model, cfg.serve.max_running, cuda_graphs=cuda_graphs(cfg, tp))
    logger.info(f"rank {tp.rank} of {tp.size} (pid {os.getpid()}): loaded; following rank 0")
    follow(model, backend, tp)


def main(cfg) -> None:
    """One rank of the server (or the only process): rank 0 serves HTTP, the others follow it."""
    if uvicorn is None:
        raise ValueError("fairseq-serve needs uvicorn and starlette: pip install 'fairseq[serve]'")
    setup(cfg)
    check_serve_config(cfg.serve)
    tp = tensor_parallel_group(cfg)
    if tp is not None and tp.rank != 0:
        return follow_rank(cfg, tp)
    keys = read_api_keys(cfg.serve.api_keys)
    if cfg.serve.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        logger.warning(f"--host {cfg.serve.host} without --api-keys: anyone who reaches this address can use the model")
    server = Server(cfg.serve, keys)
    failed = []

    def fatal(err):  # the decode thread can serve no more (the ranks are out of step): the server stops
        failed.append(err)
        http.should_exit = True

    server.on_fatal = fatal

    def load():
        try:
            start_model(server, cfg, tp)
        except Exception as err:
            failed.append(err)
            http.should_exit = True

    http = draining_server(
        uvicorn.Config(
            build_app(server),
            host=cfg.serve.host,
            port=cfg.serve.port,
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=cfg.serve.drain_timeout,
            timeout_keep_alive=5,
        ),
        server,
    )
    loader = threading.Thread(target=load, name="fairseq-serve-load", daemon=True)
    loader.start()
    try:
        http.run()
    finally:
        if tp is not None:  # stopped while loading: the followers wait for a word, sent once it is loaded
            keep_stopping_on_sigterm()
            loader.join()
        stop_serving(server)
    if failed:
        raise failed[0]
    logger.info("fairseq-serve stopped")


def stop_serving(server) -> None:
    """The decode thread ends; under tensor parallelism the followers are then told to stop (from this thread:
    the decode thread, which sent everything before, is gone). The decode thread ends after the operation it
    runs, which the followers run too: under tensor parallelism that is waited for however long it takes (a
    best_of call can outlast the drain), up to its collectives' and the agreement's timeouts (then the ranks are
    out of step and the launcher stops them)."""
    scheduler, leader = server.scheduler, server.leader
    if scheduler is None:
        return
    if leader is None:
        scheduler.stop()
        return
    scheduler.stop(1.0)
    if scheduler.thread.is_alive():
        logger.info("waiting for the running operation to end, then the other ranks are told to stop")
        scheduler.thread.join(leader.stop_wait_s)
    if scheduler.failed is not None:  # the ranks are out of step: nothing more is sent
        return
    if scheduler.thread.is_alive():
        raise OutOfStep(
            f"rank 0: the decode thread did not end within {leader.stop_wait_s:g} s of the drain: the other ranks "
            "are left to the launcher"
        )
    leader.stop()


def serve_config(argv: Optional[List[str]] = None):
    """The config fairseq-serve runs with for the flags `argv` (a bad flag exits as a usage error)."""
    parser = options.get_serve_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = options.convert_namespace_to_generation_config(args)
    cfg.serve = config_from_namespace(ServeConfig, args)
    try:
        check_serve_config(cfg.serve)
    except ValueError as e:
        parser.error(str(e))
    return cfg


def cli_main(argv: Optional[List[str]] = None) -> None:
    cfg = serve_config(argv)
    check_tensor_parallel_launch(cfg)
    call_main(cfg, main)


def console_main() -> None:
    run_console_script("fairseq-serve", cli_main)


if __name__ == "__main__":
    console_main()
