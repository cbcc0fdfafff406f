"""Reading flag values written the way upstream writes them, filling a legacy namespace, and the task options
that a task config may lack."""

import ast
from dataclasses import dataclass, fields
from typing import Optional, Tuple


def literal_or_none(value):
    """A flag value as upstream writes Python literals ("(0.9, 0.98)", "[20000, 60000]", "False"): the parsed
    literal for a string, None if it is not one; anything else is returned unchanged. Never `eval`s."""
    if not isinstance(value, str):
        return value
    try:
        return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return None


def fill_missing(args, **defaults) -> None:
    """Set each attribute `args` does not have yet (how upstream's architecture functions fill a namespace)."""
    for name, value in defaults.items():
        if not hasattr(args, name):
            setattr(args, name, value)


@dataclass(frozen=True)
class TaskOptions:
    """The options of a task config that other components read, with what they mean where a task lacks one: a
    built-in task's config has them all, a plug-in task's (its own dataclass, a legacy namespace) may not. The
    one place they are read optionally (`TaskOptions.of`)."""

    data: Optional[str] = None  # DATA, the data directory
    tokens_per_sample: Optional[int] = None
    sample_break_mode: str = "none"
    add_bos_token: bool = False

    @classmethod
    def of(cls, task_cfg) -> "TaskOptions":
        return cls(**{f.name: getattr(task_cfg, f.name) for f in fields(cls) if hasattr(task_cfg, f.name)})


def task_block_options(task_cfg) -> Tuple[Optional[int], str]:
    """(--tokens-per-sample, --sample-break-mode) the task cuts blocks with; (None, "none") where it lacks them."""
    options = TaskOptions.of(task_cfg)
    return options.tokens_per_sample, options.sample_break_mode


def task_adds_bos(task_cfg) -> bool:
    """Whether the task prepends <s> to every sample (--add-bos-token); False where it lacks the option."""
    return bool(TaskOptions.of(task_cfg).add_bos_token)


def task_data_dir(task_cfg) -> Optional[str]:
    """The task's data directory (DATA); None where it lacks one."""
    return TaskOptions.of(task_cfg).data
