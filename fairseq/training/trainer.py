"""The trainer orchestrates: it owns the model, optimizer, scheduler and precision, and delegates the
update (fairseq.training.train_step), parallelism (fairseq.distributed.parallelize), checkpoint I/O
(fairseq.checkpoint) and memory statistics (fairseq.logging.memory) to their modules."""

import logging
import math
import time
from typing import Any, Dict, List, Optional

import torch

from fairseq.distributed import float8
from fairseq.data.batching import resolve_limit
from fairseq.dataclass.flag_values import task_block_options
from fairseq.distributed.parallelize import parallelize_model, unwrap_model
from fairseq.distributed.utils import get_data_parallel_group, get_data_parallel_world_size, get_rank, get_world_size
from fairseq.optim import build_optimizer
from fairseq.optim.lr_scheduler import build_lr_scheduler
from fairseq.training.precision import Precision
from fairseq.logging.logging_outputs import LoggingOutputSums
from fairseq.logging.memory import CudaMemoryStats
from fairseq.logging.profiler import UpdateProfiler
from fairseq.logging.throughput import Throughput, default_peak_tflops
from fairseq.training.train_step import run_update, run_valid_step
from fairseq.training.ema import build_ema

logger = logging.getLogger("fairseq.trainer")  # upstream's logger name: log lines read as its

# Per-update statistics that every rank computes identically (the gradient norm is global).
REPLICATED_STATS = ("gnorm", "clip", "updates", "overflows")


def select_device(cfg) -> torch.device:
    if cfg.common.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", cfg.distributed_training.device_id)


def _state_dict_api():
    """torch.distributed.checkpoint.state_dict (~1.5 s to import), loaded at the first save or load."""
    import torch.distributed.checkpoint.state_dict as api  # deferred: startup

    return api


class Trainer:
    def __init__(self, cfg, task, model, criterion):
        self.cfg = cfg
        self.task = task
        self.device = select_device(cfg)
        self.is_sharded = cfg.distributed_training.ddp_backend == "fully_sharded"
        self.criterion = criterion.to(self.device)
        if cfg.distributed_training.compile and hasattr(self.criterion, "compile_loss"):
            self.criterion.compile_loss()  # the layers are compiled by parallelize_model
        self.throughput = _throughput(cfg, model, self.device, get_world_size())
        # Longest item the model accepts (upstream filters longer ones out of every batch iterator).
        self.max_positions = resolve_limit(task.max_positions(), model.max_positions())
        self.memory_stats = CudaMemoryStats.for_device(self.device)
        # --profile-updates; fairseq_cli.train drives it
        self.profiler = UpdateProfiler.from_config(cfg, self.device, get_rank())
        self.model = parallelize_model(model, cfg, self.device)
        # Read after parallelize_model built the mesh: the ranks of a tensor-parallel group share one batch.
        self.data_parallel_size = get_data_parallel_world_size()
        self._float8_scales = float8.needs_scale_precompute(cfg)
        self.precision = Precision(
            cfg.common,
            self.device,
            sharded=self.is_sharded,
            data_parallel_size=self.data_parallel_size,
            update_freq=cfg.optimization.update_freq[0],
        )
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg.optimizer, params, cfg.optimization)
        self.lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, self.optimizer, cfg.optimization)
        self.num_updates = 0
        self.train_stats = LoggingOutputSums()
        self.valid_stats = LoggingOutputSums()
        self.previous_training_time = 0.0  # wall-clock seconds of earlier runs of this training (checkpoint)
        self._start_time = time.time()
        self._interval_train_time = 0.0  # seconds inside train steps this log interval (train_wall)
        # Updates whose gradient norm was inf/nan (fp16 skips them; otherwise they are applied): counted on
        # the device, read before any checkpoint is written so that none holds diverged weights.
        self._nonfinite_updates = torch.zeros((), device=self.device)
        # --store-ema's moving average (fairseq.models.ema.EMA), sharded like the parameters under FSDP2. Built
        # here; as upstream (which builds it at first use), a run that restores no EMA starts it from the weights
        # after its first update, unless --ema-seed-model gave it its start.
        self.ema = None
        if cfg.ema.store_ema:
            self.ema = build_ema(unwrap_model(self.model), cfg.ema, self.device)
        self._ema_starts_at_next_update = self.ema is not None and cfg.ema.ema_seed_model is None

    # ---------------------------------------------------------------- training
    def prepare_sample(self, sample: dict, batch_source) -> dict:
        """Move a batch to the device. An empty batch pads a rank that ran out of data: it becomes a dummy
        batch (a real one, weighted 0) so every rank joins the same collectives."""
        if not sample:
            sample = dict(batch_source.first_batch, is_dummy=True)
        return move_to_device(sample, self.device)

    def train_step(self, samples: List[dict], batch_source) -> None:
        """One update; sets the seed from the update count (upstream's rule), so that a resumed run draws
        the same dropout masks as an uninterrupted one."""
        torch.manual_seed(self.cfg.common.seed + self.num_updates)
        start = time.perf_counter()
        samples = [self.prepare_sample(s, batch_source) for s in samples]
        grad_norm = run_update(
            self.model,
            self.criterion,
            self.optimizer,
            self.precision,
            samples,
            self.train_stats,
            clip_norm=self.cfg.optimization.clip_norm,
            sentence_avg=self.cfg.optimization.sentence_avg,
            device=self.device,
            data_parallel_size=self.data_parallel_size,
        )
        if grad_norm is not None and self._float8_scales:
            float8.after_optimizer_step(self.model)
        if grad_norm is not None or self.precision.scaler is None:
            self.num_updates += 1
            self.lr_scheduler.step_update(self.num_updates)
            if self.ema is not None:  # --store-ema
                self._step_ema()
            self._nonfinite_updates += (~torch.isfinite(grad_norm)).float()
        self._interval_train_time += time.perf_counter() - start
        if self.cfg.common.empty_cache_freq > 0 and self.num_updates % self.cfg.common.empty_cache_freq == 0:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _step_ema(self) -> None:
        model = unwrap_model(self.model)
        if self._ema_starts_at_next_update:
            self.ema.restore(model.state_dict(), build_fp32_params=self.cfg.ema.ema_fp32)
            self._ema_starts_at_next_update = False
        self.ema.step(model, self.num_updates)

    def load_ema_state(self, extra_state: Dict[str, Any], model_state: Dict[str, Any]) -> None:
        """A restored checkpoint's EMA (after its weights are loaded; without one, the EMA restarts from
        `model_state`, upstream's rule); nothing without --store-ema."""
        if self.ema is not None:
            self.ema.load_checkpoint_state(extra_state, model_state)
            self._ema_starts_at_next_update = False

    def cumulative_training_time(self) -> float:
        """Wall-clock seconds of this training so far, earlier (resumed) runs included."""
        return self.previous_training_time + time.time() - self._start_time

    def check_weights_finite(self) -> None:
        """Raise at a log boundary or before a checkpoint if any update applied an inf/nan gradient (one sync)."""
        bad = int(self._nonfinite_updates.item())
        if bad:
            raise FloatingPointError(
                f"the gradient norm was inf/nan in {bad} update(s) by update {self.num_updates}; the weights are "
                "no longer finite, so no checkpoint was written. Lower --lr, set --clip-norm, or use --bf16 "
                "instead of --fp16, and resume from the last checkpoint."
            )

    def read_train_stats(self) -> Dict[str, float]:
        """Interval statistics, read with one transfer and one all-reduce; raises on a non-finite loss."""
        sums = self.train_stats.reduce(group=get_data_parallel_group(), all_reduce=True, device=self.device)
        for key in REPLICATED_STATS:  # the same on every rank: undo the sum over ranks
            if key in sums:
                sums[key] /= self.data_parallel_size
        sums["train_wall"] = self._interval_train_time
        self._interval_train_time = 0.0
        check_finite(sums, self.num_updates)
        self.check_weights_finite()
        return sums

    def valid_step(self, sample: dict, batch_source) -> None:
        sample = self.prepare_sample(sample, batch_source)
        run_valid_step(self.model, self.criterion, self.precision, sample, self.valid_stats)

    def read_valid_stats(self) -> Dict[str, float]:
        return self.valid_stats.reduce(group=get_data_parallel_group(), all_reduce=True, device=self.device)

    def step_epoch_end(self, epoch: int, val_loss: Optional[float]) -> None:
        self.lr_scheduler.step(epoch, val_loss)

    def begin_epoch(self, epoch: int) -> None:
        """An epoch starts: the scheduler's epoch step, then the task's hook (upstream's order; plug-in tasks
        override FairseqTask.begin_epoch to change data or the model per epoch)."""
        self.lr_scheduler.step_begin_epoch(epoch)
        self.task.begin_epoch(epoch, self.model)

    def begin_valid_epoch(self, epoch: int) -> None:
        """Validation starts: the task's hook, as upstream's trainer calls it."""
        self.task.begin_valid_epoch(epoch, self.model)

    # ---------------------------------------------------------------- state
    def _state_dict_options(self, full: bool):
        return _state_dict_api().StateDictOptions(full_state_dict=full, cpu_offload=full)

    def model_and_optimizer_state(self, full: bool = True):
        """Model and optimizer state keyed by parameter names (so they load on any world size).
        With `full`, FSDP gathers everything to rank 0 (other ranks get empty dicts), on the CPU; otherwise the
        tensors are the training state itself (DTensors under FSDP2 or tensor parallelism), which a checkpoint
        save stages (fairseq.checkpoint.staging)."""
        return _state_dict_api().get_state_dict(self.model, self.optimizer, options=self._state_dict_options(full))

    def load_model_and_optimizer_state(self, model_state, optim_state, full: bool = True) -> None:
        api = _state_dict_api()
        options = self._state_dict_options(full)
        options = api.StateDictOptions(full_state_dict=options.full_state_dict, strict=True)
        if optim_state is None:
            api.set_model_state_dict(self.model, model_state, options=options)
        else:
            api.set_state_dict(
                self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options
            )

    def state_dict(self) -> Dict[str, Any]:
        """Stateful: what an exact resume needs besides model and optimizer, each value once (plain Python
        values): the update count, the scheduler, the loss scaler and the training time so far."""
        return {
            "num_updates": self.num_updates,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "loss_scaler": self.precision.state_dict(),
            "train_time": self.cumulative_training_time(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Stateful. A key left out keeps its current value: the checkpoint manager leaves out the update count
        and the scheduler for --reset-optimizer, the scheduler for --reset-lr-scheduler."""
        if "num_updates" in state:
            self.num_updates = state["num_updates"]
        if "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.precision.load_state_dict(state.get("loss_scaler", {}))
        self.previous_training_time = state.get("train_time", 0.0)
        self._start_time = time.time()
        self.lr_scheduler.step_update(self.num_updates)

    @property
    def component_names(self) -> Dict[str, str]:
        """Class names of the criterion and the optimizer (upstream records them in every checkpoint)."""
        return {"criterion": type(self.criterion).__name__, "optimizer": type(self.optimizer).__name__}

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


def _throughput(cfg, model, device, world_size) -> Optional[Throughput]:
    """tflops/mfu for models that know their FLOPs per token (the model contract's flops_per_token)."""
    seq_len, _ = task_block_options(cfg.task)
    model_flops = model.flops_per_token(seq_len) if seq_len else None
    if not model_flops:
        return None
    peak = cfg.common.peak_tflops or default_peak_tflops(device)
    return Throughput(model_flops, world_size, peak)


def move_to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: move_to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to_device(v, device) for v in obj)
    return obj


def check_finite(sums: Dict[str, float], num_updates: int) -> None:
    loss = sums.get("loss")
    if loss is not None and not math.isfinite(loss):
        raise FloatingPointError(
            f"the training loss became {loss} by update {num_updates}. Lower --lr or raise --warmup-updates, "
            "set --clip-norm, or use --bf16 instead of --fp16; resume from the last good checkpoint."
        )
