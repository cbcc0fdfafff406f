"""The output directory of the export and of the import: refused when it holds something (unless overwriting),
assembled in a hidden directory beside it and renamed into place when complete, so a refusal or a failed write
leaves any earlier directory as it was and nothing half-written."""

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator


def check_output(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)) and not overwrite:
        raise ValueError(f"output {out_dir} already exists and is not empty; pass --overwrite to replace it")


@contextmanager
def assembled(out_dir: str, what: str) -> Iterator[str]:
    """Yields the hidden directory to write into; renamed to `out_dir` when the block ends without an error.
    An OSError (an unwritable, read-only or full file system) becomes one line: `what` (e.g. "cannot write the
    export"), the path, the errno and the fix."""
    try:
        parent = os.path.dirname(os.path.abspath(out_dir))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.", dir=parent)
    except OSError as err:
        raise _one_line(out_dir, err, what) from None
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the output is an ordinary directory
        yield tmp
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        elif os.path.exists(out_dir):
            os.remove(out_dir)
        os.replace(tmp, out_dir)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _one_line(out_dir, err, what) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _one_line(out_dir: str, err: OSError, what: str):
    from fairseq.checkpoint.io import CheckpointSaveError, os_error_message

    return CheckpointSaveError(os_error_message(out_dir, err, what, flag="OUTPUT"))
