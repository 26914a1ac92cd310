"""Read-only attributes a facade takes from its parts."""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

__all__ = ["Delegated"]

T = TypeVar("T")


class Delegated(Generic[T]):
    """A facade's attribute that is one of its part's: in a class body,
    ``members = Delegated[list[WorkerHandle]]("membership")`` reads
    ``self.membership.members`` (the same name, read only)."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Delegated[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: Any, owner: type | None = None) -> T | Delegated[T]:
        if obj is None:  # on the class: the descriptor itself (introspection, docs)
            return self
        value: T = getattr(getattr(obj, self.part), self.name)
        return value
