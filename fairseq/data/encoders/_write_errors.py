"""One line for an output that cannot be written: the path, the errno by name and the fix.

Only the standard library: the data-preparation scripts load this file on its own (beside `_script_io`, without
importing torch), and every command (checkpoints, --destdir, --log-file, --results-path, export, hydra's run
directory) words the failure the same way through `os_error_message` or `writing`.
"""

import contextlib
import errno
from typing import Iterator

_HINTS = {  # {flag}: the option naming the directory written to
    errno.ENOSPC: "free space on that file system or point {flag} at another one",
    errno.EDQUOT: "free space within your disk quota or point {flag} at another file system",
    errno.EFBIG: "the file is larger than this process may write (ulimit -f) or the file system allows",
    errno.EACCES: "make the directory writable for this user or choose another {flag}",
    errno.EPERM: "make the directory writable for this user or choose another {flag}",
    errno.EROFS: "the file system is read-only: choose another {flag}",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another {flag}",
    errno.EEXIST: "a file is where the directory should be: choose another {flag}",
    errno.EISDIR: "a directory is where the file should be: choose another {flag}",
}


class OutputError(OSError):
    """An output that could not be written, worded as one line (`os_error_message`): printed without a
    traceback by the commands' error handlers."""

    def __str__(self) -> str:
        return self.args[0]


def os_error_message(
    path: str, err: OSError, what: str = "cannot write", flag: str = "--save-dir", kept: str = ""
) -> str:
    """One line for a failed write: the path, the errno by name, what to do."""
    code = errno.errorcode.get(err.errno, str(err.errno)) if err.errno is not None else "error"
    hint = _HINTS.get(err.errno, "check the file system").format(flag=flag)
    return f"{what} {path}: {err.strerror or err} ({code}){kept}. Fix: {hint}"


@contextlib.contextmanager
def writing(path: str, flag: str, what: str = "cannot write") -> Iterator[None]:
    """Within the block, an OSError (creating `path`, its directory or a file in it; writing) becomes one
    OutputError naming `path` and `flag`, e.g. `with writing(log_file, "--log-file"): open(log_file, "a")`."""
    try:
        yield
    except OutputError:
        raise
    except OSError as err:
        raise OutputError(os_error_message(path, err, what, flag)) from None
