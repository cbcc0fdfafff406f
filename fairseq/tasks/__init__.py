"""Tasks, chosen with --task. The task registry imports every module of this package on first use."""

from fairseq.registry import TASK_REGISTRY, register_task  # noqa: F401 (re-exported)
from fairseq.tasks.fairseq_task import FairseqTask  # noqa: F401


def setup_task(task_cfg, **kwargs):
    """The task that `task_cfg._name` (--task) names, set up from its config."""
    return TASK_REGISTRY.get(task_cfg._name).setup_task(task_cfg, **kwargs)
