"""Small helpers shared by the command-line tools."""

import importlib
import os
import sys


def import_user_module(user_dir: str):
    """Import a plug-in directory (a Python package) so that its register_* decorators run."""
    path = os.path.abspath(os.path.expanduser(user_dir))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--user-dir {user_dir!r}: no such directory")
    parent, name = os.path.split(path)
    if name in sys.modules:
        loaded = getattr(sys.modules[name], "__file__", None) or ""
        if os.path.dirname(os.path.abspath(loaded)) == path:
            return  # already imported
        raise ImportError(
            f"--user-dir {user_dir!r}: a module named {name!r} is already imported from elsewhere; rename the directory"
        )
    sys.path.insert(0, parent)
    try:
        importlib.import_module(name)
    finally:
        sys.path.remove(parent)


def run_console_script(name: str, main_fn, argv=None):
    """Run an entry point; an error about the user's input is printed once, as the single line
    `NAME: error: MESSAGE` on stderr (no traceback), and the process exits 1."""
    from fairseq.checkpoint.io import CheckpointError

    try:
        return main_fn(argv)
    except (ValueError, FileNotFoundError, CheckpointError, FloatingPointError) as e:
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        sys.stdout.flush()  # what was logged before the error comes before it
        print(f"{name}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(1)


# Upstream's `fairseq.utils` helpers that plug-in criterions call in their reduce_metrics.
def get_perplexity(loss, round: int = 2, base: float = 2):
    from fairseq.logging.metrics import get_perplexity as perplexity

    return perplexity(loss, round=round, base=base)


def item(value):
    """A Python number from a 0-dim tensor (a plain number passes through)."""
    return value.item() if hasattr(value, "item") else value
