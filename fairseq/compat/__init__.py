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
- install(): run by `import fairseq`: the explaining ImportError for upstream modules left out
  (fairseq.upstream_absent, the one table) and upstream's `BaseFairseqModel.from_pretrained`.
"""

import importlib.abc
import importlib.machinery
import sys

from fairseq import upstream_absent

_MODEL_BASE = "fairseq.models.fairseq_model"


def from_pretrained(cls, model_name_or_path: str, checkpoint_file: str = "model.pt", data_name_or_path: str = ".",
                    **kwargs):
    """Upstream's hub entry point for a local directory: a fairseq.generation.hub_utils.GeneratorHubInterface
    (encode / decode / sample / score / generate) over the checkpoint(s); see hub_utils.from_pretrained."""
    from fairseq.generation import hub_utils

    loaded = hub_utils.from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path, **kwargs)
    return hub_utils.GeneratorHubInterface(loaded["args"], loaded["task"], loaded["models"])


class _HubEntryOnModelBase(importlib.abc.MetaPathFinder):
    """Adds `from_pretrained` (a classmethod, upstream's API) to BaseFairseqModel as its module is executed, so
    that the model contract does not import the generation layer and `import fairseq` does not import torch."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _MODEL_BASE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_attach(module):
            exec_module(module)
            module.BaseFairseqModel.from_pretrained = classmethod(from_pretrained)

        spec.loader.exec_module = exec_and_attach
        return spec


def install() -> None:
    upstream_absent.install()
    if not any(isinstance(finder, _HubEntryOnModelBase) for finder in sys.meta_path):
        sys.meta_path.insert(0, _HubEntryOnModelBase())
    if _MODEL_BASE in sys.modules:  # imported before install (not through `import fairseq`)
        sys.modules[_MODEL_BASE].BaseFairseqModel.from_pretrained = classmethod(from_pretrained)
