"""Reading flag values written the way upstream writes them, filling a legacy namespace, and the task options
that a task config may lack."""

import ast
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


# A task config's options that plug-in task configs (their own dataclasses, legacy namespaces) may lack: the
# one place they are read optionally.


def task_block_options(task_cfg) -> Tuple[Optional[int], str]:
    """(--tokens-per-sample, --sample-break-mode) the task cuts blocks with; (None, "none") where it lacks them."""
    return getattr(task_cfg, "tokens_per_sample", None), getattr(task_cfg, "sample_break_mode", "none")


def task_adds_bos(task_cfg) -> bool:
    """Whether the task prepends <s> to every sample (--add-bos-token); False where it lacks the option."""
    return bool(getattr(task_cfg, "add_bos_token", False))


def task_data_dir(task_cfg) -> Optional[str]:
    """The task's data directory (DATA); None where it lacks one."""
    return getattr(task_cfg, "data", None)
