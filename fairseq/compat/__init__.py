"""The upstream-compatibility wing: upstream fairseq's library surface that this fork's own commands do not
need, over the core's implementations. The core never imports it for its own work.

Upstream's names reach it two ways:
- faces at the package root (fairseq.checkpoint_utils, fairseq.utils, fairseq.file_io, fairseq.tokenizer,
  fairseq.trainer): each the same module object as its fairseq.compat.* module, so patching either name patches
  both;
- names inside the core's packages (fairseq.modules.MultiheadAttention, fairseq.data.LanguagePairDataset,
  fairseq.models.FairseqEncoder / FairseqEncoderDecoderModel, fairseq.tasks.LegacyFairseqTask, and the modules
  fairseq.modules.multihead_attention, fairseq.data.language_pair_dataset, fairseq.models.fairseq_encoder,
  fairseq.optim.fp16_optimizer, fairseq.models.ema): fairseq.upstream_absent's tables name the wing's module,
  which `load` imports on first use (no file at the upstream path, so no core folder imports the wing).

- checkpoint_utils: upstream's loading names (fairseq.checkpoint.inference) and training loop
  (load_checkpoint / save_checkpoint over CheckpointManager's rule, fairseq.checkpoint.manager.choose_restore)
- utils: upstream's helpers, the core's own (import_user_module, run_console_script, ...) re-exported
- file_io: PathManager; tokenizer: tokenize_line
- trainer: upstream's Trainer (the core Trainer with upstream's methods)
- tasks: LegacyFairseqTask and the task hooks the core never calls (build_dictionary, has_sharded_data,
  logging_outputs_can_be_summed)
- multihead_attention: upstream's MultiheadAttention (time first, head pruning, xformers arguments)
- fairseq_encoder: FairseqEncoder, EncoderOut, FairseqEncoderDecoderModel; language_pair_dataset: pair batches
- fp16_optimizer: upstream's FP16Optimizer / MemoryEfficientFP16Optimizer over the trainer's fp16 rules
- ema: upstream's fairseq.models.ema package over the trainer's fairseq.training.ema
- upstream's `BaseFairseqModel.from_pretrained` is on the model base itself (the one upward import it declares).
Nothing here runs at import.
"""

import importlib


def load(module: str):
    """The wing's module `module` (a fairseq.compat.* name), imported on first use: fairseq.upstream_absent's
    door for upstream's names in the core's packages."""
    if not module.startswith(__name__ + "."):
        raise ValueError(f"{module} is not a module of {__name__}")
    return importlib.import_module(module)
