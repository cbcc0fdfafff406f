"""The upstream-compatibility wing: upstream fairseq's library surface that this fork's own commands do not
need, over the core's implementations. The core never imports it; upstream's module names are faces onto it
(fairseq.checkpoint_utils, fairseq.utils, fairseq.file_io, fairseq.tokenizer, fairseq.trainer: each the same
module object as its fairseq.compat.* module, so patching either name patches both).

- checkpoint_utils: upstream's loading names (fairseq.checkpoint.inference) and training loop
  (load_checkpoint / save_checkpoint over CheckpointManager's rule, fairseq.checkpoint.manager.choose_restore)
- utils: upstream's helpers, the core's own (import_user_module, run_console_script, ...) re-exported
- file_io: PathManager; tokenizer: tokenize_line
- trainer: upstream's Trainer (the core Trainer with upstream's methods)
- tasks: LegacyFairseqTask (re-exported by fairseq.tasks)
- fp16_optimizer: upstream's FP16Optimizer / MemoryEfficientFP16Optimizer over the trainer's fp16 rules (face: fairseq.optim.fp16_optimizer)
- upstream's `BaseFairseqModel.from_pretrained` is on the model base itself (the one upward import it declares),
  and the explaining ImportError for upstream modules left out is fairseq.upstream_absent's, installed by
  `import fairseq`: nothing here runs at import.
"""

