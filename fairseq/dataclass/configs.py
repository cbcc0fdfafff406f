"""Configuration groups, named and spelled as upstream fairseq names them.

Each field becomes a command-line flag (`max_tokens` -> `--max-tokens`) through
`fairseq.dataclass.utils.add_dataclass_to_parser`. Every mutable or nested default goes through
`field(default_factory=...)` (upstream 0.12.2's shared mutable defaults are what break it on Python 3.11).
"""

from dataclasses import dataclass, field
from typing import Any, List, Literal, Optional

from fairseq.dataclass.fields import II, opt  # noqa: F401 (imported from here by the components)
from fairseq.dataclass.generation import GenerationConfig, InteractiveConfig  # noqa: F401 (upstream's names here)


LOG_FORMATS = Literal["json", "simple", "tqdm", "none"]
DDP_BACKENDS = Literal["pytorch_ddp", "fully_sharded", "c10d", "no_c10d", "legacy_ddp"]


@dataclass
class CommonConfig:
    no_progress_bar: bool = opt(False, "disable the progress bar (same as --log-format none for tqdm)")
    log_interval: int = opt(100, "log progress every N updates")
    log_format: Optional[LOG_FORMATS] = opt(None, "log format (default: tqdm on a terminal, else simple)")
    log_file: Optional[str] = opt(None, "also write the log lines to this file")
    tensorboard_logdir: Optional[str] = opt(None, "write tensorboard event files under this directory")
    wandb_project: Optional[str] = opt(None, "log to this Weights & Biases project (honours WANDB_MODE)")
    seed: int = opt(1, "pseudo random number generator seed")
    cpu: bool = opt(False, "run on the CPU even when CUDA is available")
    fp16: bool = opt(False, "fp16 mixed precision with dynamic loss scaling")
    bf16: bool = opt(False, "bf16 mixed precision")
    memory_efficient_fp16: bool = opt(False, "accepted for upstream recipes; same as --fp16 here")
    memory_efficient_bf16: bool = opt(False, "accepted for upstream recipes; same as --bf16 here")
    fp8: bool = opt(
        False,
        "float8 matmuls in the decoder layers' Linear layers through torchao (needs --bf16 and a "
        "GPU of compute capability >= 8.9); the output projection stays bf16",
    )
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = opt(
        "tensorwise",
        "--fp8 scaling: one scale per tensor (fastest), per row, or per row with a high-precision weight gradient",
    )
    fp8_fsdp_all_gather: bool = opt(
        False, "--fp8 tensorwise under fully_sharded: all-gather the weights in float8 (half the bytes)"
    )
    fp16_no_flatten_grads: bool = opt(False, "same as the default here: gradients are never flattened into one buffer")
    fp16_init_scale: float = opt(2.0**7, "initial fp16 loss scale")
    fp16_scale_window: Optional[int] = opt(None, "updates without overflow before the loss scale doubles")
    fp16_scale_tolerance: float = opt(0.0, "fraction of overflowing updates tolerated before the scale halves")
    min_loss_scale: float = opt(1e-4, "stop training when the loss scale falls below this")
    threshold_loss_scale: Optional[float] = opt(None, "never lower the fp16 loss scale below this")
    user_dir: Optional[str] = opt(None, "directory of plug-in modules (tasks, models, ...) to import")
    empty_cache_freq: int = opt(0, "empty the CUDA cache every N updates (0: never)")
    suppress_crashes: bool = opt(
        False,
        "upstream (fairseq-hydra-train): return instead of raising when training "
        "fails; here a failure still raises (a start-up notice says so)",
    )
    profile: bool = opt(
        False,
        "run inside torch.cuda.profiler.profile() and emit_nvtx(): NVTX ranges per op for "
        "nsys/nvprof (upstream's flag)",
    )
    profile_updates: Optional[str] = opt(
        None,
        "START:END: record a torch.profiler trace of these updates (1-based, inclusive) on every rank, with a "
        "summary of GPU busy/idle time and kernel time per update (docs/benchmarks_h200.md)",
    )
    profile_dir: Optional[str] = opt(None, "where --profile-updates writes (default: SAVE_DIR/profile)")
    reset_logging: bool = opt(
        False,
        "same result here: fairseq-hydra-train always logs to stdout in fairseq's "
        "line format, which is what upstream's reset set up",
    )
    all_gather_list_size: int = opt(
        16384, "same result at any value: statistics are all-reduced as tensors, no gather buffer of this size is used"
    )
    peak_tflops: Optional[float] = opt(
        None, "peak dense bf16/fp16 TFLOP/s of one accelerator for the mfu stat (default: from the device name)"
    )
    trust_legacy_checkpoint: bool = opt(
        False,
        "allow loading upstream fairseq checkpoints, which contain pickled Python objects; "
        "only pass this for files you trust, since unpickling can run arbitrary code",
    )


@dataclass
class DistributedTrainingConfig:
    distributed_world_size: int = opt(1, "total number of processes across all nodes")
    distributed_num_procs: Optional[int] = opt(None, "processes to spawn on this node (default: all GPUs)")
    distributed_rank: Optional[int] = opt(0, "rank of this process")
    distributed_backend: str = opt("nccl", "process-group backend (gloo is used on CPU)")
    distributed_init_method: Optional[str] = opt(None, "init method URL, e.g. tcp://host:port")
    distributed_port: int = opt(-1, "port for the rendezvous under SLURM (required on several nodes)")
    device_id: int = opt(0, "which local GPU to use (set automatically by launchers)")
    distributed_no_spawn: bool = opt(False, "do not spawn processes even if several GPUs are visible")
    ddp_backend: DDP_BACKENDS = opt("pytorch_ddp", "data-parallel engine")
    bucket_cap_mb: int = opt(25, "DDP bucket size in MB")
    fix_batches_to_gpus: bool = opt(
        False,
        "upstream: keep each rank's batches on it across epochs; here batches are "
        "shuffled across all ranks each epoch (a start-up notice says so)",
    )
    fast_stat_sync: bool = opt(
        False,
        "same as the default here (deprecated upstream): statistics are always "
        "reduced in one all-reduce per log interval",
    )
    find_unused_parameters: bool = opt(False, "let DDP find parameters that receive no gradient")
    heartbeat_timeout: int = opt(
        -1, "seconds before a stuck collective or process-group creation fails the job (-1: 600 s)"
    )
    broadcast_buffers: bool = opt(False, "DDP: copy non-parameter buffers from rank 0 each forward")
    fp32_reduce_scatter: bool = opt(False, "reduce gradients in fp32 (always the case here)")
    cpu_offload: bool = opt(False, "fully_sharded: keep sharded parameters, gradients and optimizer state on CPU")
    use_sharded_state: bool = opt(False, "fully_sharded: save checkpoints as per-rank shards (DCP directory)")
    no_reshard_after_forward: bool = opt(False, "fully_sharded: keep full parameters from forward to backward")
    min_params_to_wrap: int = opt(
        int(1e8),
        "upstream: smallest module wrapped as an FSDP unit; here each transformer "
        "layer is one unit whatever its size (a start-up notice says so)",
    )
    fsdp_forward_prefetch: bool = opt(
        False, "fully_sharded: explicitly prefetch the next layer's all-gather in forward (and in backward)"
    )
    fsdp_prefetch_depth: int = opt(1, "fully_sharded: how many layers ahead --fsdp-forward-prefetch gathers")
    fsdp_sync_free: bool = opt(
        False,
        "fully_sharded: before gathering a layer, wait on the CUDA event recorded when the layer two gathers "
        "back freed its full parameters while the allocator is under pressure (a retry, or reserved memory at "
        "95%% of the GPU), one update back otherwise (bounds the full parameters gathered at once and how far the CPU runs ahead)",
    )
    compile: bool = opt(
        False,
        "torch.compile each transformer layer before sharding; the criterion's compile_loss picks its fastest loss (cross_entropy: the fused kernels on CUDA, else compiled)",
    )
    model_parallel_size: int = opt(
        1,
        "tensor parallelism (Megatron-style) over groups of this many ranks, consecutive ranks (one node); "
        "the world size must be a multiple of it (docs/parallelism.md)",
    )
    fsdp_shard_group_size: int = opt(
        0,
        "fully_sharded: shard the model over groups of this many data-parallel ranks and replicate it across "
        "the groups (hybrid sharding, HSDP); 0: shard over all data-parallel ranks",
    )


@dataclass
class DatasetConfig:
    num_workers: int = opt(1, "data-loading worker processes")
    skip_invalid_size_inputs_valid_test: bool = opt(False, "ignore too-long or too-short examples")
    max_tokens: Optional[int] = opt(None, "maximum tokens in a batch")
    batch_size: Optional[int] = opt(None, "number of examples in a batch", aliases=["--max-sentences"])
    required_batch_size_multiple: int = opt(8, "batch size will be a multiple of this")
    dataset_impl: Optional[str] = opt(
        None, "format of the binarized data: only mmap (MMIDIDX) exists here; other values are an error"
    )
    data_buffer_size: int = opt(10, "batches each data-loading worker prepares ahead (with --num-workers > 0)")
    train_subset: str = opt("train", "data subset to train on")
    valid_subset: str = opt("valid", "comma-separated data subsets to validate on")
    combine_valid_subsets: Optional[bool] = opt(
        None,
        "validate each --valid-subset together with its numbered splits (valid, valid1, valid2, ...) as one set",
        aliases=["--combine-val"],
    )
    ignore_unused_valid_subsets: bool = opt(
        False, "do not fail when DATA holds numbered valid splits (valid1, ...) that --valid-subset leaves out"
    )
    validate_interval: int = opt(1, "validate every N epochs")
    validate_interval_updates: int = opt(0, "validate every N updates (0: only at epoch ends)")
    validate_after_updates: int = opt(0, "do not validate before this many updates")
    fixed_validation_seed: Optional[int] = opt(
        None,
        "fairseq-train: seed the random generators with this before each validation (training re-seeds per update)",
    )
    disable_validation: bool = opt(False, "never validate")
    max_tokens_valid: Optional[int] = opt(None, "maximum tokens in a validation batch (default: --max-tokens)")
    batch_size_valid: Optional[int] = opt(None, "validation batch size (default: --batch-size)")
    max_valid_steps: Optional[int] = opt(None, "validate on at most this many batches", aliases=["--nval"])
    curriculum: int = opt(0, "fairseq-train: do not shuffle the batches for the first N epochs")
    gen_subset: str = opt("test", "the split that fairseq-generate and fairseq-eval-lm read")
    num_shards: int = opt(
        1,
        "fairseq-generate and fairseq-eval-lm: split the batches into N shards and process "
        "only --shard-id's (training shards by the data-parallel ranks instead)",
    )
    shard_id: int = opt(0, "fairseq-generate and fairseq-eval-lm: which shard to process, 0 <= id < --num-shards")


@dataclass
class OptimizationConfig:
    max_epoch: int = opt(0, "stop after this epoch (0: no limit)")
    max_update: int = opt(0, "stop after this many updates (0: no limit)")
    stop_time_hours: float = opt(0.0, "stop after this many hours of training (0: no limit)")
    clip_norm: float = opt(0.0, "clip gradients to this global L2 norm (0: no clipping)")
    sentence_avg: bool = opt(False, "normalize the loss by sentences instead of tokens")
    update_freq: List[int] = opt([1], "accumulate gradients over N batches before each update")
    lr: List[float] = opt([0.25], "learning rate (upstream takes a list; the first value is used)")
    stop_min_lr: float = opt(-1.0, "stop when the learning rate falls to this value")
    use_bmuf: bool = opt(False, "not supported: an error if set")


@dataclass
class CheckpointConfig:
    save_dir: str = opt("checkpoints", "where to save checkpoints")
    restore_file: str = opt("checkpoint_last.pt", "checkpoint to resume from (in --save-dir unless a path)")
    finetune_from_model: Optional[str] = opt(
        None, "start from this model's weights with a fresh optimizer, scheduler, meters and data iterator"
    )
    reset_dataloader: bool = opt(False, "do not restore the data iterator position")
    reset_lr_scheduler: bool = opt(False, "do not restore the learning-rate scheduler")
    reset_meters: bool = opt(False, "do not restore the meters")
    reset_optimizer: bool = opt(False, "do not restore the optimizer state")
    optimizer_overrides: str = opt(
        "{}",
        "Python dict literal of values set in every optimizer parameter group "
        "after the optimizer state is restored, e.g. \"{'weight_decay': 0.0}\"; "
        "keys and values are checked by the optimizer at start-up",
    )
    save_interval: int = opt(1, "save a checkpoint every N epochs")
    save_interval_updates: int = opt(0, "save a checkpoint every N updates (0: only at epoch ends)")
    keep_interval_updates: int = opt(-1, "keep only the last N update checkpoints (-1: all)")
    keep_interval_updates_pattern: int = opt(-1, "keep update checkpoints whose update count is a multiple of N")
    keep_last_epochs: int = opt(-1, "keep only the last N epoch checkpoints (-1: all)")
    keep_best_checkpoints: int = opt(-1, "keep only the best N checkpoints by the metric (-1: all)")
    no_save: bool = opt(False, "do not save checkpoints")
    no_epoch_checkpoints: bool = opt(False, "only keep checkpoint_last and checkpoint_best")
    no_last_checkpoints: bool = opt(False, "do not write checkpoint_last")
    no_save_optimizer_state: bool = opt(False, "do not save the optimizer state")
    best_checkpoint_metric: str = opt("loss", "metric that defines checkpoint_best")
    maximize_best_checkpoint_metric: bool = opt(False, "a larger metric is better")
    patience: int = opt(-1, "stop after N validations without improvement (-1: never)")
    checkpoint_suffix: str = opt("", "suffix added to checkpoint file names")
    load_checkpoint_on_all_dp_ranks: bool = opt(
        False, "same as the default here: every rank reads the checkpoint itself (nothing is broadcast from rank 0)"
    )
    write_checkpoints_asynchronously: bool = opt(
        False,
        "write checkpoints in the background: training resumes once "
        "the state is copied to host memory (sharded: DCP "
        "async_save); one write at a time",
    )


@dataclass
class EMAConfig:
    """Upstream's --ema-* flags (fairseq.models.ema.EMA, stepped by the trainer after each update)."""

    store_ema: bool = opt(
        False, "keep an exponential moving average (EMA) of the weights; checkpoints hold it in extra_state['ema']"
    )
    ema_decay: float = opt(0.9999, "decay of the moving average: ema = decay * ema + (1 - decay) * weights")
    ema_start_update: int = opt(0, "before this many updates the EMA copies the weights (decay 0)")
    ema_seed_model: Optional[str] = opt(None, "start the EMA from the EMA weights saved in this checkpoint")
    ema_update_freq: int = opt(1, "update the EMA every N updates")
    ema_fp32: bool = opt(False, "keep an fp32 copy of the EMA for its updates (upstream's option for fp16 weights)")


@dataclass
class EvalLMConfig:
    output_word_probs: bool = opt(
        False, "log each sample's words with their log probabilities (natural log; BPE pieces joined with --remove-bpe)"
    )
    output_word_stats: bool = opt(
        False,
        "log per-word statistics at the end: word, count, summed log probability, "
        "is BPE, summed log probability of the next word, count with a next word",
    )
    context_window: int = opt(0, "tokens of left context scored but not counted, for sliding-window evaluation")
    softmax_batch: int = opt(
        2**62,
        "upstream: compute the softmax in chunks of this many tokens to save "
        "memory; here a batch's softmax is computed at once (a start-up notice says so)",
    )


@dataclass
class CommonEvalConfig:
    path: Optional[str] = opt(None, "checkpoint to evaluate: a .pt file or a sharded checkpoint directory")
    quiet: bool = opt(False, "fairseq-generate: print no S/T/H/D/P lines, only the summary")
    model_overrides: str = opt("{}", "Python dict literal of model config values to override when loading")
    results_path: Optional[str] = opt(
        None,
        "a directory (created if missing) for the results: fairseq-generate writes its S/T/H/D/P lines to "
        "DIR/generate-SPLIT.txt instead of stdout; fairseq-eval-lm writes its scores to DIR/eval_lm.SPLIT.json "
        "as well as logging them",
    )
    post_process: Optional[str] = opt(
        None,
        "undo the BPE of the dictionary's pieces. fairseq-generate and fairseq-interactive join the pieces "
        "of the S, T and H lines into words: the flag alone (subword_nmt) removes '@@ ', 'sentencepiece' "
        "joins the pieces reading U+2581 as a space, any other value is a marker that is removed; the "
        "checkpoint's --bpe is then not applied, so D lines are the joined text (pass --bpe NAME to decode "
        "them). fairseq-eval-lm reports loss and perplexity per word instead of per token, and joins the "
        "words of --output-word-probs/--output-word-stats; words are those of the --bpe scheme (or the "
        "checkpoint's) for the flag alone or the scheme's name, pieces starting with U+2581 for "
        "'sentencepiece', else end where a piece lacks the marker ('@@' for the flag alone)",
        aliases=["--remove-bpe"],
        const="subword_nmt",
    )


@dataclass
class PreprocessConfig:
    source_lang: Optional[str] = opt(
        None, "source language: the input files are PREFIX.SRC (translation's layout)", aliases=["-s"]
    )
    target_lang: Optional[str] = opt(
        None,
        "target language (translation; with --only-source only its train file counts, for --joined-dictionary)",
        aliases=["-t"],
    )
    trainpref: Optional[str] = opt(None, "train file prefix (also used to build the dictionary)")
    validpref: Optional[str] = opt(None, "comma-separated valid file prefixes")
    testpref: Optional[str] = opt(None, "comma-separated test file prefixes")
    destdir: str = opt("data-bin", "destination directory")
    only_source: bool = opt(False, "only process the source language (language modeling)")
    srcdict: Optional[str] = opt(None, "reuse this dictionary instead of building one")
    thresholdsrc: int = opt(0, "map words appearing fewer than this many times to <unk>")
    nwordssrc: int = opt(-1, "keep at most this many words in the dictionary (-1: all)")
    # upstream's target-side options: with --only-source there is no target dictionary (upstream_absent says so)
    thresholdtgt: int = opt(0, "translation's target dictionary threshold (no target dictionary with --only-source)")
    nwordstgt: int = opt(-1, "translation's target dictionary size (no target dictionary with --only-source)")
    tgtdict: Optional[str] = opt(
        None,
        "reuse this target dictionary; with --only-source read only with "
        "--joined-dictionary, as the dictionary when --srcdict is not given",
    )
    joined_dictionary: bool = opt(
        False,
        "one dictionary for both languages: built from the train files of "
        "--source-lang and --target-lang (both, when given)",
    )
    align_suffix: Optional[str] = opt(None, "not supported: word alignment files (translation)")
    alignfile: Optional[str] = opt(None, "not supported: a word alignment file (translation)")
    padding_factor: int = opt(8, "pad the dictionary size to a multiple of this")
    workers: int = opt(1, "number of parallel workers")
    dict_only: bool = opt(False, "only build the dictionary")
    json_key: Optional[str] = opt(
        None,
        "read --trainpref/--validpref/--testpref as JSONL (a .jsonl[.gz|.zst] file or "
        "a split directory of corpora) with the text under this key, as "
        "--task streaming_language_modeling reads it",
    )
    dataset_impl: str = opt("mmap", "output format (mmap is the only one)")


@dataclass
class FairseqConfig:
    common: CommonConfig = field(default_factory=CommonConfig)
    distributed_training: DistributedTrainingConfig = field(default_factory=DistributedTrainingConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    optimization: OptimizationConfig = field(default_factory=OptimizationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval_lm: EvalLMConfig = field(default_factory=EvalLMConfig)
    common_eval: CommonEvalConfig = field(default_factory=CommonEvalConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    # Component configs: the registered component's own dataclass instance, chosen by name.
    task: Any = None
    model: Any = None
    criterion: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    bpe: Any = None  # --bpe: the scheme's config (GPT2BPEConfig, SentencepieceConfig, ...), as upstream
    tokenizer: Any = None  # --tokenizer
