"""One `validate(cfg)` for a training config, run by every entry point before any process is spawned or any
data is read, so a bad flag combination fails in the first second with the same message everywhere
(fairseq-train, fairseq-hydra-train, in-process `fairseq_cli.train.main`), and the memory planner reuses
the same rules.

Each component keeps its own checks beside its code (the FSDP flags in fairseq.distributed.fsdp, a model's
options in its class's `check_config`); this module only collects them, in a fixed order. Checks that need
the data, the device or the checkpoint stay where those are read.
"""

from fairseq import registry


def check_precision(common) -> None:
    """--fp16 and --bf16 (and their memory_efficient_ spellings) exclude each other."""
    fp16 = getattr(common, "fp16", False) or getattr(common, "memory_efficient_fp16", False)
    bf16 = getattr(common, "bf16", False) or getattr(common, "memory_efficient_bf16", False)
    if fp16 and bf16:
        raise ValueError("--fp16 and --bf16 cannot be combined; pass one of them")


def check_batch_size(dataset) -> None:
    if dataset.max_tokens is None and dataset.batch_size is None:
        raise ValueError("give a batch size with --max-tokens or --batch-size")
    for flag, value in (("--max-tokens", dataset.max_tokens), ("--batch-size", dataset.batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")


def check_sharded_state(distributed) -> None:
    if distributed.use_sharded_state and distributed.ddp_backend != "fully_sharded":
        raise ValueError("--use-sharded-state needs --ddp-backend fully_sharded")


def _training_device(cfg):
    import torch

    if cfg.common.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", 0)  # every GPU of a job is assumed to be of one kind


def validate(cfg) -> None:
    """Raise ValueError, naming the flag and the fix, for the first problem of a training config."""
    from fairseq.distributed.fsdp import check_fsdp_flags
    from fairseq.models.ema import check_ema_config
    from fairseq.distributed.mesh import check_layout_flags
    from fairseq.distributed.tensor_parallel_checks import check_tensor_parallel_config
    from fairseq.float8 import check_float8_environment, check_float8_flags

    check_batch_size(cfg.dataset)
    if cfg.optimizer is None:
        raise ValueError("no --optimizer given; e.g. --optimizer adam")
    if cfg.model is None:
        raise ValueError("no --arch given; e.g. --arch transformer_lm")
    if cfg.optimization.use_bmuf:
        raise ValueError("--use-bmuf (block-wise model update filtering) is not supported; drop the flag")
    check_precision(cfg.common)
    check_float8_flags(cfg)
    check_float8_environment(cfg, _training_device(cfg))
    check_fsdp_flags(cfg)
    check_layout_flags(cfg.distributed_training)
    check_tensor_parallel_config(cfg)
    check_sharded_state(cfg.distributed_training)
    if getattr(cfg.common, "profile_updates", None):
        from fairseq.logging.profiler import parse_update_range

        parse_update_range(cfg.common.profile_updates)
    check_ema_config(getattr(cfg, "ema", None))
    registry.arch_model(cfg.model._name).check_config(cfg.model)
