"""A filesystem for tests: real local files underneath, an OSError on chosen calls.

``flaky://<path>`` with storage options ``fail_on`` (the kinds of call counted:
``"read"``, ``"write"``, ``"meta"``, on paths containing ``match``), ``fail_calls``
(the 1-based numbers of the counted calls that fail) and ``token`` (a fresh counter
per token). It is not a
:class:`LocalFileSystem`, so :class:`planaria.checkpoint.storage.Storage` treats it
as an object store.
"""

from __future__ import annotations

import errno
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

__all__ = ["FlakyFileSystem", "flaky_options"]


class FlakyFileSystem(AbstractFileSystem):
    protocol = "flaky"
    calls: ClassVar[dict[str, int]] = {}

    def __init__(self, fail_on: tuple[str, ...] = (), fail_calls: tuple[int, ...] = (),
                 token: str = "", match: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inner = LocalFileSystem(auto_mkdir=True)
        self.fail_on = tuple(fail_on)
        self.fail_calls = set(fail_calls)
        self.token = token
        self.match = match

    def _tick(self, kind: str, path: str) -> None:
        if kind not in self.fail_on or self.match not in path:
            return
        n = self.calls[self.token] = self.calls.get(self.token, 0) + 1
        if n in self.fail_calls:
            raise OSError(errno.EIO, f"injected I/O error (call {n}, {kind})", path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self._tick("write" if "w" in mode else "read", path)
        kwargs.pop("cache_type", None)
        kwargs.pop("cache_options", None)
        kwargs.pop("autocommit", None)
        return self.inner._open(path, mode, **kwargs)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        self._tick("read", path)
        return bytes(self.inner.cat_file(path, start=start, end=end))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._tick("meta", path)
        return self.inner.ls(path, detail=detail)

    def info(self, path: str, **kwargs: Any) -> Any:
        self._tick("meta", path)
        return self.inner.info(path)

    def rm_file(self, path: str) -> None:
        self.inner.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self.inner.rm(path, recursive=recursive, maxdepth=maxdepth)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.inner.makedirs(path, exist_ok=exist_ok)


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)


def flaky_options(token: str, fail_on: tuple[str, ...], fail_calls: tuple[int, ...],
                  match: str = "") -> dict[str, Any]:
    """Storage options for a ``flaky://`` root: counted calls numbered ``fail_calls`` fail."""
    return {"fail_on": fail_on, "fail_calls": fail_calls, "token": token, "match": match}
