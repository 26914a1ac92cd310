"""Field docs in ``help()``: a class's attribute docstrings appended to its ``__doc__``.

planaria's config dataclasses document each field with a string under it (the form
IDEs and the API reference read). ``help()`` shows only the class docstring, so
:func:`document_fields` appends a *Fields* section built from those strings, once, when
the class is created: the class's source is parsed with :mod:`ast` (one parse per module,
cached). Without the source (a build that ships only bytecode) the docstring stays as it is.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from typing import TypeVar

__all__ = ["document_fields", "fields_section"]

T = TypeVar("T", bound=type)


@functools.cache
def _module_tree(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as source:
        return ast.parse(source.read(), filename=path)


def _class_node(tree: ast.Module, qualname: str) -> ast.ClassDef | None:
    body: list[ast.stmt] = tree.body
    node: ast.ClassDef | None = None
    for name in qualname.split("."):
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == name), None)
        if node is None:
            return None
        body = node.body
    return node


def _entries(node: ast.ClassDef) -> list[tuple[str, str]]:
    """(heading, doc) of each annotated field followed by a string, in source order."""
    entries: list[tuple[str, str]] = []
    for stmt, after in zip(node.body, node.body[1:], strict=False):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            continue
        heading = f"{stmt.target.id}: {ast.unparse(stmt.annotation)}"
        if stmt.value is not None:
            heading += f" = {ast.unparse(stmt.value)}"
        entries.append((heading, inspect.cleandoc(after.value.value)))
    return entries


def fields_section(cls: type) -> str:
    """The *Fields* section of ``cls``: each documented field's name, type, default and
    doc; ``""`` when the source cannot be read or no field is documented."""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return ""
    try:
        node = _class_node(_module_tree(path), cls.__qualname__)
    except (OSError, SyntaxError):
        return ""
    entries = _entries(node) if node is not None else []
    if not entries:
        return ""
    lines = ["Fields", "------"]
    for heading, doc in entries:
        lines.append(heading)
        lines.extend(f"    {line}" if line else "" for line in doc.splitlines())
    return "\n".join(lines)


def document_fields(cls: T) -> T:
    """Class decorator: appends :func:`fields_section` to ``cls.__doc__`` (``help(cls)``
    then shows every field's doc). Returns ``cls`` itself."""
    section = fields_section(cls)
    if section:
        doc = inspect.cleandoc(cls.__doc__ or "")
        cls.__doc__ = f"{doc}\n\n{section}\n" if doc else f"{section}\n"
    return cls
