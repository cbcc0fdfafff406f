"""The --save-dir of a training run: checked at start-up, locked against a second run, cleaned of temporaries.

- Writability is probed at start-up (a small file is written, synced and removed) on every rank that will
  write there, so a missing permission, a read-only or full file system, or a path through a file is found
  in the first second rather than at the first save, after the work is done.
- One run at a time: rank 0 holds an advisory lock (flock) on `<save-dir>/.fairseq-train.lock` for the
  whole run; the file names the holder (pid, host, start time). The kernel drops the lock when the holder
  exits, however it exits, so a killed or preempted run never leaves a stale lock behind.
- Temporaries of a save that was killed (`.NAME.*.tmp` files, `NAME.tmp` sharded directories) are removed
  once the lock is held (no other writer can be using them then), before the probe: on a full disk they
  may be what holds the space.
"""

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from typing import Optional

from fairseq.checkpoint.io import CheckpointSaveError, save_error

logger = logging.getLogger(__name__)

LOCK_FILE = ".fairseq-train.lock"


class SaveDirInUse(CheckpointSaveError):
    pass


def check_writable(save_dir: str) -> None:
    """Raise CheckpointSaveError (naming the path and errno) unless `save_dir` can hold a new file."""
    probe = os.path.join(save_dir, f".write-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(save_dir, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            data = memoryview(b"fairseq write probe\n" * 64)
            while data:  # a write can stop short at a limit; the next one then reports the errno
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise save_error(save_dir, err, previous_intact=False, what="--save-dir is not writable:") from None
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass


class SaveDirLock:
    """An advisory lock on a --save-dir held for the life of a run (see the module docstring)."""

    def __init__(self, save_dir: str):
        self.path = os.path.join(save_dir, LOCK_FILE)
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise save_error(
                os.path.dirname(self.path), err, previous_intact=False, what="--save-dir is not writable:"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SaveDirInUse(
                    f"--save-dir {os.path.dirname(self.path)} is in use by another training run "
                    f"({self._holder()}); two runs writing one directory overwrite each other's checkpoints. "
                    "Wait for it to finish, stop it, or choose another --save-dir"
                ) from None
            # A file system without flock (some network mounts): run unlocked rather than not at all.
            logger.warning(f"cannot lock {self.path} ({err.strerror}); not protected against a second run")
            return
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd

    def _holder(self) -> str:
        try:
            with open(self.path) as f:
                holder = json.load(f)
            return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (removing it would race a new holder)
            self._fd = None


def remove_stale_temporaries(save_dir: str) -> None:
    """Remove what killed saves left behind. Call only while holding the lock."""
    if not os.path.isdir(save_dir):
        return
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.startswith(".") and name.endswith(".tmp") and os.path.isfile(path):
            os.remove(path)
        elif name.startswith("checkpoint") and name.endswith(".tmp") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            continue
        logger.info(f"removed {path}, left by an interrupted save")
