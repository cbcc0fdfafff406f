"""Models. Each module here registers its model and architectures when the registry first loads it
(build one with `task.build_model(cfg.model)`, which looks up `--arch`)."""

# Upstream's names, for plug-ins (--user-dir) that import them from here (FairseqEncoder and
# FairseqEncoderDecoderModel are the compat wing's: this package's __getattr__ finds them, fairseq.upstream_absent).
from fairseq.modules.fairseq_decoder import FairseqDecoder  # noqa: E402,F401
from fairseq.modules.fairseq_incremental_decoder import FairseqIncrementalDecoder  # noqa: E402,F401
from fairseq.models.fairseq_model import BaseFairseqModel, FairseqLanguageModel  # noqa: E402,F401
from fairseq.registry import (  # noqa: E402,F401
    ARCH_CONFIG_REGISTRY,
    ARCH_MODEL_REGISTRY,
    MODEL_REGISTRY,
    register_model,
    register_model_architecture,
)
from fairseq.upstream_absent import absent_name as _absent_name


def build_model(cfg, task, from_checkpoint: bool = False):
    """Upstream's `fairseq.models.build_model`: the model of architecture `cfg._name` (or `cfg.arch`)."""
    return task.build_model(cfg, from_checkpoint)


def __getattr__(name):
    return _absent_name(__name__, name)
