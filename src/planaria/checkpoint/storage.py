"""One root of checkpoints on any fsspec filesystem: local paths, file://, memory://, s3://, gs://.

Local disk is the only storage treated as POSIX: files are fsynced and a save is
made visible by renaming its directory. Everywhere else a closed object is
durable and the commit marker decides what is visible.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Mapping
from typing import IO, Any, cast

import fsspec
import fsspec.core
from fsspec.implementations.local import LocalFileSystem

__all__ = ["Storage"]


class Storage:
    """A checkpoint root: ``fs`` (an fsspec filesystem) and ``root`` (its path on ``fs``)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"a checkpoint root must be a non-empty string, got {url!r}")
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.fs: fsspec.AbstractFileSystem = fs
        self.local = isinstance(fs, LocalFileSystem)
        self.root: str = path.rstrip("/") or "/"

    def path(self, *parts: str) -> str:
        """The path of ``parts`` under the root (on ``fs``, without protocol)."""
        return "/".join([self.root.rstrip("/"), *parts]) if parts else self.root

    def url(self, path: str) -> str:
        """What to show a user for ``path``: a plain path on local disk, else with its protocol."""
        return path if self.local else cast(str, self.fs.unstrip_protocol(path))

    def listdir(self, path: str | None = None) -> list[str]:
        """Names (not paths) directly under ``path`` (default: the root); [] if it is missing."""
        path = path or self.root
        if self.local:
            try:
                return sorted(os.listdir(path))
            except (FileNotFoundError, NotADirectoryError):
                return []
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})

    def exists(self, path: str) -> bool:
        if self.local:
            return os.path.exists(path)
        self.fs.invalidate_cache(path.rsplit("/", 1)[0])
        return bool(self.fs.exists(path))

    def size(self, path: str) -> int:
        """Size of the file at ``path`` in bytes; ``FileNotFoundError`` if it is missing."""
        if self.local:
            return os.stat(path).st_size
        return int(self.fs.size(path))

    def makedirs(self, path: str) -> None:
        if self.local:
            os.makedirs(path, exist_ok=True)
        # object stores have no directories

    @contextlib.contextmanager
    def open_write(self, path: str, *, fsync: bool = True) -> Iterator[IO[bytes]]:
        """Opens ``path`` for writing; on local disk, fsyncs the file on close if ``fsync``."""
        if self.local:
            with open(path, "wb") as f:
                yield f
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
        else:
            with self.fs.open(path, "wb") as f:
                yield cast(IO[bytes], f)

    def open_read(self, path: str) -> io.RawIOBase | io.BufferedIOBase:
        """Opens ``path`` for reading (unbuffered on local disk)."""
        if self.local:
            return open(path, "rb", buffering=0)
        f = self.fs.open(path, "rb", block_size=8 << 20, cache_type="none")
        return cast(io.BufferedIOBase, f)  # fsspec files are io.IOBase with readinto

    def read_bytes(self, path: str) -> bytes:
        if self.local:
            with open(path, "rb") as f:
                return f.read()
        return cast(bytes, self.fs.cat_file(path))

    def write_bytes(self, path: str, data: bytes, *, fsync: bool = True) -> None:
        with self.open_write(path, fsync=fsync) as f:
            f.write(data)

    def replace_file(self, src: str, dst: str) -> None:
        """Moves file ``src`` over ``dst``: a reader sees the old ``dst`` or the new one,
        never part of one (local disk: a rename; an object store: a server-side copy, whole
        or not at all, then ``src`` deleted)."""
        if self.local:
            os.replace(src, dst)
        else:
            self.fs.mv(src, dst)

    def rename(self, src: str, dst: str) -> None:
        """Atomic rename of a directory; local disk only."""
        assert self.local, "rename is only used on local disk"
        os.rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        """Makes a rename or a new entry in directory ``path`` durable (local disk only)."""
        if not self.local:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        """Deletes a file; missing is fine."""
        with contextlib.suppress(FileNotFoundError):
            if self.local:
                os.remove(path)
            else:
                self.fs.rm_file(path)

    def remove_tree(self, path: str) -> None:
        """Deletes a directory (or prefix) and everything under it; missing is fine."""
        if self.local:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
            return
        self.fs.invalidate_cache(path)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def du(self, path: str) -> int:
        """Total bytes of the files under ``path``; 0 if it is missing."""
        if self.local:
            total = 0
            for dirpath, _, names in os.walk(path):
                for name in names:
                    with contextlib.suppress(OSError):
                        total += os.stat(os.path.join(dirpath, name)).st_size
            return total
        self.fs.invalidate_cache(path)
        try:
            return int(self.fs.du(path, total=True))
        except FileNotFoundError:
            return 0
