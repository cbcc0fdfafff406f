"""Tasks, chosen with --task. The task registry imports every module of this package on first use."""

from fairseq.registry import TASK_REGISTRY, register_task  # noqa: F401 (re-exported)
from fairseq.registry import config_name
from fairseq.tasks.fairseq_task import FairseqTask  # noqa: F401 (LegacyFairseqTask: the wing's, via __getattr__)
from fairseq.upstream_absent import absent_name as _absent_name


def setup_task(task_cfg, **kwargs):
    """The task that `task_cfg._name` (--task; `task` in a legacy argparse namespace) names, set up from
    its config."""
    name = config_name(task_cfg, "task")
    return TASK_REGISTRY.get(name).setup_task(task_cfg, **kwargs)


def get_task(name: str):
    """Upstream's name: the task class registered as `name`."""
    return TASK_REGISTRY.get(name)


def __getattr__(name):
    return _absent_name(__name__, name)
