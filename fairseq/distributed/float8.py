"""Float8 training (`--fp8`): the decoder layers' Linear matmuls in float8 through torchao, everything else bf16.

`apply_float8(model, cfg)` swaps each decoder layer's nn.Linear for torchao's Float8Linear (same parameters,
same names, so checkpoints move between bf16 and float8 runs both ways). It runs first in
`parallelize_model`, before activation checkpointing, compile and FSDP2 (torchao's order). Left in bf16: the
output projection (the vocabulary softmax is the most sensitive matmul) and the embeddings (not matmuls), and
any Linear whose dims are not multiples of 16 (float8 GEMMs need them).

Recipes (`--fp8-recipe`, torchao's names): `tensorwise` (one scale per tensor, the fastest; with
`--fp8-fsdp-all-gather` the FSDP2 all-gather moves float8 weights, half the bytes, and the scales are computed
for all layers at once after each optimizer step), `rowwise` (one scale per row: more accurate, slower) and
`rowwise_with_gw_hp` (rowwise, with the weight gradient in high precision). Needs a GPU of compute capability 8.9 or
higher (Ada, Hopper, Blackwell), `--bf16`, and torchao (`pip install torchao`, the `fp8` extra). On the CPU
(`--cpu`) it runs torch's reference float8 matmuls, slowly: for checking a configuration (the CPU tests of
float8 with tensor parallelism use it).
"""

import importlib.util
import logging
import sys

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MIN_CAPABILITY = (8, 9)
# Kept in bf16 whatever the recipe: module names (as in model.named_modules()) ending with these.
HIGH_PRECISION_MODULES = ("output_projection",)


def check_float8_flags(
    fp8: bool,
    fp16: bool = False,
    bf16: bool = False,
    fp8_recipe: str = "tensorwise",
    fp8_fsdp_all_gather: bool = False,
    ddp_backend: str = "fully_sharded",
) -> None:
    """The --fp8 rules that need no GPU (run by validate(cfg) and the memory planner)."""
    if not fp8:
        if fp8_fsdp_all_gather:
            raise ValueError("--fp8-fsdp-all-gather needs --fp8")
        return
    if fp16:
        raise ValueError("--fp8 runs the rest of the model in bf16: use --fp8 with --bf16, not --fp16")
    if not bf16:
        raise ValueError("--fp8 needs --bf16 (the matmuls torchao leaves alone, and the master copy, run in bf16)")
    if fp8_recipe not in RECIPES:
        raise ValueError(f"--fp8-recipe {fp8_recipe!r}: choose one of {', '.join(RECIPES)}")
    if fp8_fsdp_all_gather:
        if fp8_recipe != "tensorwise":
            raise ValueError(
                f"--fp8-fsdp-all-gather works with --fp8-recipe tensorwise only "
                f"(got {fp8_recipe}); drop the flag or use tensorwise"
            )
        if ddp_backend != "fully_sharded":
            raise ValueError("--fp8-fsdp-all-gather needs --ddp-backend fully_sharded")


def check_float8_environment(fp8: bool, fp8_recipe: str, device: torch.device) -> None:
    """--fp8 (with --fp8-recipe `fp8_recipe`) on a machine that cannot run it: one line naming what is missing
    (before any work starts)."""
    if not fp8:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(
            "--fp8 needs torchao, which is not installed: pip install torchao "
            "(or the project's fp8 extra: pip install 'fairseq[fp8]')"
        )
    if device.type != "cuda":
        if not cpu_float8_matmul():
            raise ValueError(
                "--fp8 needs a CUDA GPU (float8 matmuls; this torch has none on the CPU): drop --fp8 or --cpu"
            )
        if fp8_recipe != "tensorwise" and not cpu_float8_matmul(rowwise=True):
            raise ValueError(
                f"--fp8-recipe {fp8_recipe} on the CPU needs float8 matmuls with one scale per "
                f"row, which torch {torch.__version__} has only on CUDA GPUs: use --fp8-recipe "
                "tensorwise, a GPU, or a newer torch (2.13 has them on the CPU)"
            )
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"--fp8 needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
            f"higher (Ada, Hopper, Blackwell); {torch.cuda.get_device_name(device)} is "
            f"{capability[0]}.{capability[1]}: drop --fp8"
        )


def cpu_float8_matmul(rowwise: bool = False) -> bool:
    """Whether this torch multiplies float8 matrices on the CPU (torch._scaled_mm, what torchao calls), with
    one scale per tensor or (`rowwise`) per row: torch 2.11 has only the first on the CPU, 2.13 both."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    shapes = ((16, 1), (1, 16)) if rowwise else ((), ())
    scale_a, scale_b = (torch.ones(shape, dtype=torch.float32) for shape in shapes)
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _torchao_float8():
    """torchao's float8 package (the `fp8` extra), imported where --fp8 first needs it: the one place this module
    reaches torchao."""
    import torchao.float8.float8_linear  # deferred: optional (loads torchao.float8 and its config too)

    return torchao.float8


def _float8_config(common):
    config_class = _torchao_float8().Float8LinearConfig
    if common.fp8_recipe == "tensorwise":
        return config_class(enable_fsdp_float8_all_gather=bool(common.fp8_fsdp_all_gather))
    return config_class.from_recipe_name(common.fp8_recipe)


def is_float8_convertible(module: nn.Module, name: str, tp: int = 1) -> bool:
    """A Linear whose float8 GEMMs get dims that are multiples of 16 on every rank (with tensor parallelism
    either dim may be split `tp` ways, whichever the plan splits): what apply_float8 converts, and what the
    memory planner counts as float8."""
    if not isinstance(module, nn.Linear) or name.endswith(HIGH_PRECISION_MODULES):
        return False
    return module.in_features % (16 * tp) == 0 and module.out_features % (16 * tp) == 0


def apply_float8(model: nn.Module, cfg) -> int:
    """Swap the convertible nn.Linear modules for torchao's Float8Linear in place; returns how many."""
    converted = []

    tp = cfg.distributed_training.model_parallel_size

    def keep(module: nn.Module, name: str) -> bool:
        ok = is_float8_convertible(module, name, tp)
        if ok:
            converted.append(name)
        return ok

    _torchao_float8().convert_to_float8_training(model, config=_float8_config(cfg.common), module_filter_fn=keep)
    if cfg.common.cpu or not torch.cuda.is_available():
        logger.warning(
            "--fp8 on the CPU runs torch's reference float8 matmuls: for checking a configuration "
            "(tests, small runs), far slower than training without --fp8"
        )
    elif not cfg.distributed_training.compile:
        logger.warning(
            "--fp8 without --compile: torchao's scaling and casts run as separate kernels, which made "
            "training slower than bf16 (0.43x at 32 x 2560 on one H200, docs/fp8.md); add --compile"
        )
    logger.info(
        f"float8 ({cfg.common.fp8_recipe}{', float8 all-gather' if cfg.common.fp8_fsdp_all_gather else ''}): "
        f"{len(converted)} Linear layers converted; kept in bf16: the output projection and the embeddings"
    )
    return len(converted)


def casts_tensorwise(module: nn.Module) -> bool:
    """Whether `module` is a Float8Linear that casts its input with one dynamic scale per tensor, or (a module
    whose input the tensor-parallel plan prepares for its Linears, e.g. the attention) holds only such Linears:
    then tensor parallelism can cast before it all-gathers (torchao's float8 TP styles). Rowwise scales need
    the whole row, so rowwise recipes all-gather in bf16 with the plain styles."""
    if "torchao.float8" not in sys.modules:  # never converted in this process: nothing to import
        return False
    float8 = _torchao_float8()
    tensorwise = float8.config.ScalingGranularity.TENSORWISE
    linears = [module] if isinstance(module, nn.Linear) else [m for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(
        isinstance(m, float8.float8_linear.Float8Linear)
        and m.config.cast_config_input.scaling_granularity is tensorwise
        for m in linears
    )


def needs_scale_precompute(cfg) -> bool:
    return bool(cfg.common.fp8 and cfg.common.fp8_fsdp_all_gather)


def after_optimizer_step(model: nn.Module) -> None:
    """With float8 all-gather: every sharded weight's scale for the next forward, in one fused reduction."""
    _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)
