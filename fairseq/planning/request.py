"""The memory planner's input: its command line (training flags spelled as fairseq-train spells them, generated
from the same config fields; model flags override the --arch preset) or a composed training config, read into a
`Request`: the model's shape (built on the meta device by the real model code) and the training setup, checked as
fairseq-train checks them. fairseq.planning.plan_memory reports on it."""

import argparse
import dataclasses
import math
import os
import sys
import typing
from typing import List, Optional

from fairseq.planning import hardware as hw
from fairseq.planning import memory_model as mm
from fairseq import registry
from fairseq.dataclass import configs
from fairseq.dataclass.build import check_precision
from fairseq.dataclass.argument_parser import FairseqArgumentParser
from fairseq.dataclass.batch_flags import check_batch_size, check_max_tokens, check_update_freq
from fairseq.dataclass.utils import add_dataclass_to_parser
from fairseq.distributed.float8 import check_float8_flags
from fairseq.distributed.fsdp import FSDPSettings, check_fsdp_flags
from fairseq.distributed.mesh import TP_MESH_OF_ONE, ParallelLayout
from fairseq.distributed.tensor_parallel import check_tensor_parallel_shape
from fairseq.models.transformer_lm import (
    TransformerLanguageModelConfig,
    preset_config,
    resolve_max_target_positions,
    uses_adaptive_modules,
)
from fairseq.tasks.language_modeling import LanguageModelingConfig

# Device totals in GiB, as PyTorch reports them (what fairseq's memory log calls GB): fairseq/planning/hardware.py
# says where each comes from. Pass --gpu-memory-gb for your card.
GPU_MEMORY_GIB = {name: gpu.memory_gib for name, gpu in hw.GPUS.items()}
DEFAULT_GPU_MEMORY_GIB = hw.DEFAULT.memory_gib
DEFAULT_TOKENS_PER_SAMPLE = 2048
DEFAULT_VOCAB_SIZE = 50272  # the OPT/GPT-2 BPE dictionary with fairseq's specials, padded to a multiple of 8
MODELED_OPTIMIZERS = ("adam", "cpu_adam")  # both are torch.optim.AdamW here (fairseq/optim/adam.py)
# The most memory one GPU may have (--gpu-memory-gb): more than any has (the largest sold in 2026 hold 288 GB).
# With mm.MAX_GPUS, the largest setup the planner takes: a model whose training state alone exceeds its memory is
# refused before it is modelled (check_model_size).
MAX_GPU_MEMORY_GIB = 1024.0
STATE_BYTES_PER_PARAM = (
    mm.MASTER_PARAM_BYTES + mm.GRAD_BYTES + mm.ADAM_STATE_BYTES
)  # on the GPUs or, offloaded, the hosts


def _add_fields(group, dc, names, **defaults) -> None:
    """Add the flags of `names` from config dataclass `dc` exactly as fairseq-train generates them
    (same spelling, aliases, types and help), with some defaults changed for planning."""
    fields = {f.name: f for f in dataclasses.fields(dc)}
    hints = typing.get_type_hints(dc)
    subset = []
    for name in names:
        f = fields[name]
        if name in defaults:
            default = dataclasses.field(default=defaults[name], metadata=f.metadata)
        elif f.default_factory is not dataclasses.MISSING:
            default = dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
        else:
            default = dataclasses.field(default=f.default, metadata=f.metadata)
        subset.append((name, hints[name], default))
    add_dataclass_to_parser(group, dataclasses.make_dataclass(dc.__name__, subset))


def build_parser() -> argparse.ArgumentParser:

    parser = FairseqArgumentParser(  # usage errors in one line, misspelt flags named
        prog="python -m fairseq.planning.plan_memory",
        allow_abbrev=False,
        description="Per-GPU memory of training a transformer_lm with fairseq-train (see docs/memory_planner.md).",
    )
    parser.add_argument("--arch", "-a", required=True, metavar="ARCH", help="a transformer_lm architecture")
    planner = parser.add_argument_group("planner")
    _add_setup_flags(planner)
    _add_output_flags(planner)
    _add_training_flags(parser.add_argument_group("training (as fairseq-train spells them)"))
    model = parser.add_argument_group("model (override the --arch preset)")
    add_dataclass_to_parser(model, TransformerLanguageModelConfig, suppress_defaults=True)
    return parser


def _add_setup_flags(planner) -> None:
    """The machines: how many GPUs, which, and their speeds."""
    planner.add_argument(
        "--gpus",
        "--distributed-world-size",
        dest="gpus",
        type=int,
        default=1,
        help="number of GPUs (default: 1); with --model-parallel-size N, N per data-parallel rank",
    )
    planner.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="GPUs per node, to tell which collectives cross the network (default: 8)",
    )
    planner.add_argument(
        "--recommend-layout",
        action="store_true",
        help="compare every tensor-parallel x shard-group layout of --gpus at this global batch "
        "(memory, estimated step time) and recommend the fastest",
    )
    planner.add_argument(
        "--gpu",
        choices=sorted(GPU_MEMORY_GIB),
        help="a GPU by name, for its memory: " + ", ".join(f"{k} {v} GiB" for k, v in GPU_MEMORY_GIB.items()),
    )
    planner.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=None,
        help=f"memory of one GPU in GiB, as the training log's *_gb fields count it "
        f"(default: the --gpu's, else {DEFAULT_GPU_MEMORY_GIB:g})",
    )
    for flag, field, unit in (
        ("--achieved-tflops", "achieved_tflops", "TFLOP/s per GPU that bf16 training reaches"),
        ("--intra-node-gbps", "intra_node_gbps", "GB/s per GPU of collectives inside a node"),
        ("--inter-node-gbps", "inter_node_gbps", "GB/s per GPU of collectives across nodes"),
    ):
        planner.add_argument(
            flag,
            type=float,
            default=None,
            metavar="X",
            help=f"{unit}, for the time estimates (default: the --gpu's, else "
            f"{getattr(hw.DEFAULT, field):g}; fairseq/planning/hardware.py)",
        )


def _add_output_flags(planner) -> None:
    """What else the plan is computed for and reports."""
    planner.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help=f"dictionary size, specials included (default: {DEFAULT_VOCAB_SIZE})",
    )
    planner.add_argument(
        "--node-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="host RAM per node: with --write-checkpoints-asynchronously, warn when the checkpoint "
        "snapshots of a node's ranks need more",
    )
    planner.add_argument(
        "--max-layers-that-fit",
        action="store_true",
        help="also report the largest --decoder-layers of this layer shape that fits",
    )


def _add_training_flags(training) -> None:
    """fairseq-train's flags that change the plan, generated from the same config fields."""
    _add_fields(training, configs.DatasetConfig, ["batch_size", "max_tokens"])
    _add_fields(
        training,
        LanguageModelingConfig,
        ["tokens_per_sample", "max_target_positions"],
        tokens_per_sample=DEFAULT_TOKENS_PER_SAMPLE,
    )
    _add_fields(
        training,
        configs.CommonConfig,
        ["fp16", "bf16", "memory_efficient_fp16", "memory_efficient_bf16", "fp8", "fp8_recipe", "fp8_fsdp_all_gather"],
    )
    _add_fields(
        training,
        configs.DistributedTrainingConfig,
        [
            "ddp_backend",
            "cpu_offload",
            "no_reshard_after_forward",
            "fsdp_forward_prefetch",
            "fsdp_prefetch_depth",
            "fsdp_sync_free",
            "model_parallel_size",
            "fsdp_shard_group_size",
            "compile",
            "use_sharded_state",
        ],
        ddp_backend="fully_sharded",
    )
    _add_fields(training, configs.CheckpointConfig, ["write_checkpoints_asynchronously"])
    _add_fields(training, configs.OptimizationConfig, ["update_freq"])
    training.add_argument(
        "--optimizer",
        default="adam",
        metavar="OPTIMIZER",
        help=f"optimizer: {', '.join(registry.OPTIMIZER_REGISTRY.choices())} (default: adam)",
    )


@dataclasses.dataclass(frozen=True)
class Request:
    arch: str
    shape: mm.ModelShape
    setup: mm.TrainingSetup
    gpu_memory_gib: float
    gpu_name: Optional[str]
    optimizer: str
    max_layers_that_fit: bool
    gpus_per_node: int = 8
    recommend_layout: bool = False
    hardware: hw.Hardware = hw.DEFAULT  # its memory_gib is gpu_memory_gib
    async_checkpoints: bool = False  # --write-checkpoints-asynchronously
    sharded_state: bool = False  # --use-sharded-state
    node_memory_gib: Optional[float] = None


def parse(argv: Optional[List[str]] = None) -> Request:
    """Parse the command line into a model shape (built on meta) and a training setup; usage errors exit 2."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model_fields = {f.name for f in dataclasses.fields(TransformerLanguageModelConfig)}
        overrides = {k: v for k, v in vars(args).items() if k in model_fields}
        overrides.update(tokens_per_sample=args.tokens_per_sample, max_target_positions=args.max_target_positions)
        cfg = preset_config(args.arch, **overrides)
        if uses_adaptive_modules(cfg):
            # Their outputs' sizes depend on how often each band's words occur; the planner has no such term.
            raise ValueError(
                f"--arch {args.arch}: adaptive input/softmax (--adaptive-input, "
                "--adaptive-softmax-cutoff) are not modeled by the memory planner, which assumes a full "
                "output projection; plan with a plain preset of the same size (e.g. transformer_lm_big)"
            )
        if args.vocab_size < 2:
            raise ValueError(f"--vocab-size must be at least 2 (padding is symbol 1), got {args.vocab_size}")
        shape = mm.model_shape(cfg, args.vocab_size)
        check_model_size(shape, args.arch)
        check_fsdp_flags(
            args.ddp_backend,
            args.fsdp_forward_prefetch,
            args.fsdp_sync_free,
            args.cpu_offload,
            args.fsdp_prefetch_depth,
        )
        setup = _training_setup(args, cfg)
        if args.optimizer not in MODELED_OPTIMIZERS:
            raise ValueError(
                f"--optimizer {args.optimizer} is not modeled; the planner knows "
                f"{', '.join(MODELED_OPTIMIZERS)} (AdamW: two fp32 states per parameter)"
            )
    except ValueError as err:
        parser.error(str(err))
    hardware = _hardware(parser, args)
    if args.gpus_per_node < 1:
        parser.error(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
    if setup.float8 and not hardware.float8:
        parser.error(
            f"--fp8 needs a GPU of compute capability 8.9 or higher (Ada, Hopper, Blackwell); --gpu "
            f"{args.gpu} has none: drop --fp8 or plan for --gpu h100 / h200"
        )
    return Request(
        args.arch,
        shape,
        setup,
        hardware.memory_gib,
        args.gpu,
        args.optimizer,
        args.max_layers_that_fit,
        args.gpus_per_node,
        args.recommend_layout,
        hardware,
        args.write_checkpoints_asynchronously,
        args.use_sharded_state,
        args.node_memory_gib,
    )


def check_model_size(shape: mm.ModelShape, arch: str) -> None:
    """ValueError for a model whose training state (fp32 weights, gradients and Adam's two states) exceeds the
    memory of the largest setup the planner takes (mm.MAX_GPUS GPUs of MAX_GPU_MEMORY_GIB): no setup could
    train it, so it is not modelled. Read from the parameter count alone."""
    largest = mm.MAX_GPUS * MAX_GPU_MEMORY_GIB * mm.GIB
    state = shape.total_params * STATE_BYTES_PER_PARAM
    if state > largest:
        raise ValueError(
            f"--arch {arch} with {shape.num_layers} layers x {shape.embed_dim}, ffn {shape.ffn_dim}, vocabulary "
            f"{shape.vocab_size} has {shape.total_params:.3g} parameters, whose training state ({STATE_BYTES_PER_PARAM} "
            f"bytes each: {state / 2**50:.3g} PiB) exceeds {mm.MAX_GPUS} GPUs of {MAX_GPU_MEMORY_GIB:g} GiB, the "
            "largest setup the planner takes; lower --decoder-layers or the widths"
        )


def _hardware(parser, args) -> hw.Hardware:
    """The --gpu's figures (hardware.py), with the command line's overrides; a non-positive one is a usage error."""
    gpu = hw.GPUS[args.gpu] if args.gpu else hw.DEFAULT
    changes = {
        "memory_gib": args.gpu_memory_gb,
        "achieved_tflops": args.achieved_tflops,
        "intra_node_gbps": args.intra_node_gbps,
        "inter_node_gbps": args.inter_node_gbps,
    }
    flags = {
        "memory_gib": "--gpu-memory-gb",
        "achieved_tflops": "--achieved-tflops",
        "intra_node_gbps": "--intra-node-gbps",
        "inter_node_gbps": "--inter-node-gbps",
    }
    for field, value in changes.items():
        if value is not None and not 0 < value < math.inf:
            parser.error(f"{flags[field]} must be a positive finite number, got {value:g}")
    if args.gpu_memory_gb is not None and args.gpu_memory_gb > MAX_GPU_MEMORY_GIB:
        parser.error(
            f"--gpu-memory-gb {args.gpu_memory_gb:g} is more than any GPU holds: at most "
            f"{MAX_GPU_MEMORY_GIB:g} (GiB of one GPU, as the training log's *_gb fields count it)"
        )
    if args.node_memory_gib is not None and not 0 < args.node_memory_gib < math.inf:
        parser.error(f"--node-memory-gib must be a positive finite number, got {args.node_memory_gib:g}")
    return dataclasses.replace(gpu, **{k: v for k, v in changes.items() if v is not None})


def inputs_from_config(cfg, gpus: int, vocab_size: int = DEFAULT_VOCAB_SIZE, environ: Optional[dict] = None):
    """(model shape, training setup) of a composed training config (a FairseqConfig: a recipe and its
    overrides, as fairseq-hydra-train builds it) on `gpus` GPUs: what this command line computes for the same
    flags. With FAIRSEQ_TP_MESH_OF_ONE=1 in `environ` (default: this process's environment) and
    --model-parallel-size 1, the tensor-parallel plan runs on a one-rank mesh (setup.tp_plan_on_one_rank)."""
    flags = {}
    for group in (cfg.task, cfg.optimization, cfg.dataset, cfg.distributed_training, cfg.common):
        flags.update(vars(group))
    args = argparse.Namespace(**dict(flags, gpus=gpus, vocab_size=vocab_size))
    shape = mm.model_shape(cfg.model, vocab_size)
    setup = _training_setup(args, cfg.model)
    environ = os.environ if environ is None else environ
    one_rank = setup.tensor_parallel == 1 and environ.get(TP_MESH_OF_ONE) == "1"
    return shape, dataclasses.replace(setup, tp_plan_on_one_rank=one_rank)


def _training_setup(args, cfg) -> mm.TrainingSetup:
    check_precision(args)
    check_float8_flags(args.fp8, args.fp16, args.bf16, args.fp8_recipe, args.fp8_fsdp_all_gather, args.ddp_backend)
    dtype = "fp32"
    if args.fp16 or args.memory_efficient_fp16:
        dtype = "fp16"
    elif args.bf16 or args.memory_efficient_bf16:
        dtype = "bf16"
    if not 1 <= args.gpus <= mm.MAX_GPUS:
        raise ValueError(f"--gpus {args.gpus} is out of range: 1 to {mm.MAX_GPUS} (more than any job has used)")
    layout = ParallelLayout.from_config(args, args.gpus)  # the flags' own checks and messages
    check_tensor_parallel_shape(
        layout.tp, cfg.decoder_attention_heads, cfg.decoder_ffn_embed_dim, args.vocab_size, "--vocab-size"
    )
    check_max_tokens(args.max_tokens)  # fairseq-train's checks
    check_batch_size(args.batch_size)
    check_update_freq(args.update_freq)
    batch_size = args.batch_size
    if batch_size is None:
        if args.max_tokens is not None:
            batch_size = args.max_tokens // args.tokens_per_sample
            if batch_size < 1:
                raise ValueError(
                    f"--max-tokens {args.max_tokens} holds no sequence of --tokens-per-sample "
                    f"{args.tokens_per_sample}; raise --max-tokens or pass --batch-size"
                )
        else:
            batch_size = 1
    max_positions = resolve_max_target_positions(cfg)
    if args.tokens_per_sample > max_positions:
        raise ValueError(
            f"--tokens-per-sample {args.tokens_per_sample} exceeds the model's "
            f"--max-target-positions {max_positions}; lower one or raise the other"
        )
    return mm.TrainingSetup(
        gpus=args.gpus,
        batch_size=batch_size,
        tokens_per_sample=args.tokens_per_sample,
        dtype=dtype,
        fully_sharded=args.ddp_backend == "fully_sharded",
        checkpoint_activations=bool(cfg.checkpoint_activations or cfg.offload_activations),
        offload_activations=bool(cfg.offload_activations),
        **dataclasses.asdict(FSDPSettings.from_flags(args)),
        update_freq=args.update_freq[0],
        tensor_parallel=layout.tp,
        shard_group=args.fsdp_shard_group_size,
        float8=args.fp8,
        float8_recipe=args.fp8_recipe,
        float8_all_gather=args.fp8_fsdp_all_gather,
        compiled=args.compile,
    )
