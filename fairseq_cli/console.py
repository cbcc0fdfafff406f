"""How every console entry point (fairseq-train, ..., scripts/*.py) ends on a user error."""

import sys

from fairseq.data.encoders._write_errors import OutputError
from fairseq.runtime.errors import UserError


def run_console_script(name: str, main_fn, argv=None):
    """Run an entry point; an error about the user's input (a UserError such as a CheckpointError, a bad value or
    missing file, an output that cannot be written) is printed once, as the single line `NAME: error: MESSAGE`
    on stderr (no traceback), and the process exits 1."""
    try:
        return main_fn(argv)
    except (ValueError, FileNotFoundError, UserError, FloatingPointError, OutputError) as e:
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        sys.stdout.flush()  # what was logged before the error comes before it
        print(f"{name}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(1)
