"""Upstream's `fairseq.file_io.PathManager`: file operations that scripts and plug-ins call by this name.

As upstream: with iopath installed (`pip install iopath`), every call goes to iopath's PathManager, so
registered handlers (S3, manifold, ...) work; without it, local files through os/shutil.

    from fairseq.file_io import PathManager
    with PathManager.open("checkpoints/notes.txt", "w") as f: ...
"""

import os
import shutil
from typing import List, Optional

try:
    from iopath.common.file_io import g_pathmgr as IOPathManager
except ImportError:
    IOPathManager = None


class PathManager:
    """Static methods with upstream's names and arguments."""

    @staticmethod
    def open(
        path: str,
        mode: str = "r",
        buffering: int = -1,
        encoding: Optional[str] = None,
        errors: Optional[str] = None,
        newline: Optional[str] = None,
    ):
        if IOPathManager is not None:
            return IOPathManager.open(
                path=path, mode=mode, buffering=buffering, encoding=encoding, errors=errors, newline=newline
            )
        return open(path, mode=mode, buffering=buffering, encoding=encoding, errors=errors, newline=newline)

    @staticmethod
    def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
        if IOPathManager is not None:
            return IOPathManager.copy(src_path=src_path, dst_path=dst_path, overwrite=overwrite)
        if not overwrite and os.path.exists(dst_path):
            raise FileExistsError(f"PathManager.copy: {dst_path} exists; pass overwrite=True to replace it")
        return shutil.copyfile(src_path, dst_path) is not None

    @staticmethod
    def get_local_path(path: str, **kwargs) -> str:
        if IOPathManager is not None:
            return IOPathManager.get_local_path(path, **kwargs)
        return path

    @staticmethod
    def exists(path: str) -> bool:
        return IOPathManager.exists(path) if IOPathManager is not None else os.path.exists(path)

    @staticmethod
    def isfile(path: str) -> bool:
        return IOPathManager.isfile(path) if IOPathManager is not None else os.path.isfile(path)

    @staticmethod
    def isdir(path: str) -> bool:
        return IOPathManager.isdir(path) if IOPathManager is not None else os.path.isdir(path)

    @staticmethod
    def ls(path: str) -> List[str]:
        return IOPathManager.ls(path) if IOPathManager is not None else os.listdir(path)

    @staticmethod
    def mkdirs(path: str) -> None:
        if IOPathManager is not None:
            return IOPathManager.mkdirs(path)
        os.makedirs(path, exist_ok=True)

    @staticmethod
    def rm(path: str) -> None:
        if IOPathManager is not None:
            return IOPathManager.rm(path)
        os.remove(path)

    @staticmethod
    def chmod(path: str, mode: int) -> None:
        if not PathManager.path_requires_pathmanager(path):
            os.chmod(path, mode)

    @staticmethod
    def register_handler(handler) -> None:
        if IOPathManager is None:
            raise ImportError("PathManager.register_handler needs iopath (pip install iopath), as upstream's does")
        IOPathManager.register_handler(handler=handler)

    @staticmethod
    def copy_from_local(local_path: str, dst_path: str, overwrite: bool = False, **kwargs) -> None:
        if IOPathManager is not None:
            return IOPathManager.copy_from_local(
                local_path=local_path, dst_path=dst_path, overwrite=overwrite, **kwargs
            )
        shutil.copyfile(local_path, dst_path)

    @staticmethod
    def path_requires_pathmanager(path: str) -> bool:
        """Whether `path` belongs to a registered handler (so os functions cannot reach it)."""
        if IOPathManager is None:
            return False
        return any(path.startswith(prefix) and prefix != "" for prefix in IOPathManager._path_handlers)

    @staticmethod
    def supports_rename(path: str) -> bool:
        return not PathManager.path_requires_pathmanager(path)

    @staticmethod
    def rename(src: str, dst: str) -> None:
        os.rename(src, dst)

    @staticmethod
    def opena(
        path: str,
        mode: str = "r",
        buffering: int = -1,
        encoding: Optional[str] = None,
        errors: Optional[str] = None,
        newline: Optional[str] = None,
    ):
        """Upstream's asynchronous open (iopath's); without iopath, a plain open."""
        if IOPathManager is not None:
            return IOPathManager.opena(
                path=path, mode=mode, buffering=buffering, encoding=encoding, errors=errors, newline=newline
            )
        return PathManager.open(path, mode, buffering, encoding, errors, newline)

    @staticmethod
    def async_close() -> bool:
        return IOPathManager.async_close() if IOPathManager is not None else True
