"""One `validate(cfg)` for a training config, run by every entry point before any process is spawned or any
data is read, so a bad flag combination fails in the first second with the same message everywhere
(fairseq-train, fairseq-hydra-train, in-process `fairseq_cli.train.main`), and the memory planner reuses
the same rules. It reads no file: the checks that do (the --bpe files, the dictionary's size under
--model-parallel-size) run at start-up, `fairseq.training.loop.check_input_files`.

Each component keeps its own checks beside its code (the FSDP flags in fairseq.distributed.fsdp, a model's
options in its class's `check_config`); this module only collects them, in a fixed order. Checks that need
the data, the device or the checkpoint stay where those are read.
"""

import torch

from fairseq import registry
from fairseq.checkpoint.manager import parse_optimizer_overrides
from fairseq.checkpoint.vocabulary import bpe_options, check_bpe_flags
from fairseq.data.indexed_dataset import check_dataset_impl
from fairseq.dataclass.batch_flags import check_batch_flags
from fairseq.dataclass.build import check_precision, check_seed
from fairseq.distributed.float8 import check_float8_environment, check_float8_flags
from fairseq.distributed.fsdp import check_fsdp_flags
from fairseq.distributed.mesh import check_layout_flags
from fairseq.distributed.tensor_parallel_checks import check_tensor_parallel_config
from fairseq.logging.profiler import parse_update_range
from fairseq.optim import check_optimizer_overrides
from fairseq.tasks.language_modeling import check_token_budget
from fairseq.training.ema import check_ema_config


def check_shard(num_shards: int, shard_id: int) -> None:
    """--num-shards / --shard-id of fairseq-generate and fairseq-eval-lm: shard SHARD_ID of NUM_SHARDS."""
    if num_shards < 1 or not 0 <= shard_id < num_shards:
        raise ValueError(
            f"--shard-id {shard_id} must lie in [0, --num-shards {num_shards}) (and --num-shards be at least 1)"
        )


def check_sharded_state(use_sharded_state: bool, ddp_backend: str) -> None:
    if use_sharded_state and ddp_backend != "fully_sharded":
        raise ValueError("--use-sharded-state needs --ddp-backend fully_sharded")


def _training_device(cfg):
    if cfg.common.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", 0)  # every GPU of a job is assumed to be of one kind


def validate(cfg) -> None:
    """Raise ValueError, naming the flag and the fix, for the first problem of a training config."""
    check_batch_flags(cfg, required=True)
    check_token_budget(cfg)
    if cfg.optimizer is None:
        raise ValueError("no --optimizer given; e.g. --optimizer adam")
    if cfg.model is None:
        raise ValueError("no --arch given; e.g. --arch transformer_lm")
    if cfg.optimization.use_bmuf:
        raise ValueError("--use-bmuf (block-wise model update filtering) is not supported; drop the flag")
    check_dataset_impl(cfg.dataset.dataset_impl)
    # a bad literal, key or value fails now, not at resume or at the first update
    overrides = parse_optimizer_overrides(cfg.checkpoint.optimizer_overrides)
    check_optimizer_overrides(cfg.optimizer, cfg.optimization, overrides)
    # --fp16 with --bf16: the front ends refuse it as they read the flags; again here for configs built in code
    # (fairseq_cli.train.main(cfg), convert_namespace_to_config), which no front end read
    check_precision(cfg.common)
    check_seed(cfg.common)
    common, dt = cfg.common, cfg.distributed_training
    check_float8_flags(
        common.fp8, common.fp16, common.bf16, common.fp8_recipe, common.fp8_fsdp_all_gather, dt.ddp_backend
    )
    check_float8_environment(common.fp8, common.fp8_recipe, _training_device(cfg))
    check_fsdp_flags(
        dt.ddp_backend, dt.fsdp_forward_prefetch, dt.fsdp_sync_free, dt.cpu_offload, dt.fsdp_prefetch_depth
    )
    check_layout_flags(dt.model_parallel_size, dt.fsdp_shard_group_size, dt.ddp_backend)
    check_tensor_parallel_config(dt.model_parallel_size, cfg.model)
    check_sharded_state(dt.use_sharded_state, dt.ddp_backend)
    if cfg.common.profile_updates:
        parse_update_range(cfg.common.profile_updates)
    check_ema_config(cfg.ema.store_ema, cfg.ema.ema_decay, cfg.ema.ema_update_freq)
    check_bpe_flags(bpe_options(cfg.bpe))  # the checkpoints will carry them (read at start-up)
    registry.arch_model(cfg.model._name).check_config(cfg.model)
