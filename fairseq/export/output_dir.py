"""The output directory of the export and of the import: what may be written there, and writing it whole.

Nothing the user wrote is ever deleted. An output directory is written when it does not exist or is empty; one
that a previous run of the same tool wrote (its manifest, `fairseq_manifest.json`, names the tool and the files
it wrote, and the directory holds nothing else) is replaced with --overwrite; anything else is refused, as is an
output that is an input, holds one or lies inside one. The directory is assembled in a hidden directory beside
it and renamed into place when complete, so a refusal or a failed write leaves any earlier directory as it was
and nothing half-written.
"""

import json
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Set

from fairseq.checkpoint.io import CheckpointSaveError, os_error_message

MANIFEST = "fairseq_manifest.json"


def check_output(out_dir: str, overwrite: bool, tool: str, inputs: Iterable[Optional[str]] = ()) -> None:
    """Raise ValueError (one line) unless `tool` (e.g. "export_hf") may write `out_dir`: not one of `inputs`
    (files or directories it reads; None entries are skipped), not inside or above one, and either absent,
    empty, or `tool`'s earlier output with `overwrite`."""
    _check_apart_from_inputs(out_dir, inputs)
    if not os.path.lexists(out_dir):
        return
    if os.path.islink(out_dir):
        raise ValueError(
            f"output {out_dir} is a symbolic link, which scripts/{tool}.py never replaces; give the "
            "directory it points to, or another output"
        )
    if not os.path.isdir(out_dir):
        raise ValueError(
            f"output {out_dir} exists and is not a directory, which scripts/{tool}.py never replaces; "
            "choose another output"
        )
    entries = os.listdir(out_dir)
    if not entries:
        return
    written = _written_by(out_dir, tool)
    if written is None:
        raise ValueError(
            f"output {out_dir} already exists and holds files scripts/{tool}.py did not write (it has no "
            f"{MANIFEST} of {tool}); choose a new or empty directory"
        )
    foreign = sorted(
        name
        for name in entries
        if name != MANIFEST and not (name in written and stat.S_ISREG(os.lstat(os.path.join(out_dir, name)).st_mode))
    )
    if foreign:
        raise ValueError(
            f"output {out_dir} holds {foreign[0]}, which scripts/{tool}.py did not write (its {MANIFEST} "
            "lists what it wrote); move it out or choose another output"
        )
    if not overwrite:
        raise ValueError(
            f"output {out_dir} holds an earlier output of scripts/{tool}.py; pass --overwrite to "
            "replace it, or choose another output"
        )


def _check_apart_from_inputs(out_dir: str, inputs: Iterable[Optional[str]]) -> None:
    out = os.path.realpath(out_dir)
    for given in inputs:
        if not given:
            continue
        path = os.path.realpath(given)
        if path == out:
            where = "is the input"
        elif path.startswith(out.rstrip(os.sep) + os.sep):
            where = "holds the input"
        elif out.startswith(path.rstrip(os.sep) + os.sep):
            where = "is inside the input"
        else:
            continue
        raise ValueError(
            f"output {out_dir} {where} {given}: writing it would replace what is read; choose an "
            "output apart from the inputs"
        )


def _written_by(out_dir: str, tool: str) -> Optional[Set[str]]:
    """The file names `tool`'s manifest in `out_dir` lists; None without a readable manifest of `tool`."""
    try:
        with open(os.path.join(out_dir, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) and manifest.get("written_by") == tool else None
    if not isinstance(files, list) or not all(isinstance(n, str) and n == os.path.basename(n) for n in files):
        return None
    return set(files)


@contextmanager
def assembled(out_dir: str, what: str, tool: str, flag: str) -> Iterator[str]:
    """Yields the hidden directory to write into; when the block ends without an error, `tool`'s manifest is
    added and the directory takes `out_dir`'s place (an earlier output of `tool`, checked again, is removed file
    by file). An OSError (an unwritable, read-only or full file system) becomes one line: `what` (e.g. "cannot
    write the export"), the path, the errno and the fix naming `flag`, the command's name for `out_dir`."""
    try:
        parent = os.path.dirname(os.path.abspath(out_dir))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.", dir=parent)
    except OSError as err:
        raise _one_line(out_dir, err, what, flag) from None
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the output is an ordinary directory
        yield tmp
        written = sorted(os.listdir(tmp))
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump({"written_by": tool, "files": written}, f, indent=1)
            f.write("\n")
        check_output(out_dir, overwrite=True, tool=tool)  # what is there now is still the tool's alone
        _replace(tmp, out_dir)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _one_line(out_dir, err, what, flag) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: str, out_dir: str) -> None:
    """Put `tmp` at `out_dir`; an earlier `out_dir` (empty, or the tool's files alone: check_output) is moved
    aside first and put back if that fails, then its files are removed one by one."""
    if not os.path.isdir(out_dir):
        os.replace(tmp, out_dir)
        return
    aside = tmp + ".old"
    os.rename(out_dir, aside)
    try:
        os.replace(tmp, out_dir)
    except OSError:
        os.rename(aside, out_dir)
        raise
    for name in os.listdir(aside):
        os.remove(os.path.join(aside, name))
    os.rmdir(aside)


def _one_line(out_dir: str, err: OSError, what: str, flag: str):
    return CheckpointSaveError(os_error_message(out_dir, err, what, flag=flag))
