"""The package's shape, checked from its source (no processes): no import circle among
planaria's modules at run time, function-level imports included (an import under
``TYPE_CHECKING`` is for the type checker only and is left out)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "planaria").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    return {id(n) for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the planaria modules it imports (``from planaria import x``: ``planaria.x``
    where that is a module, else the package)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_of_planaria_imports_itself_back_at_run_time():
    circles = _circles(_imports(_modules()))
    assert circles == [], f"import circles (function-level imports included): {circles}"


# What a package may not import: the worker and the wire never the controller (what both
# sides share lives in planaria.wire); the wire nothing but the lowest layers.
FORBIDDEN = {
    "planaria.worker": ("planaria.control", "planaria.checkpoint.coordinator", "planaria.cli"),
    "planaria.wire": ("planaria.control", "planaria.worker", "planaria.checkpoint",
                      "planaria.cli", "planaria.observe"),
}


def test_the_worker_and_the_wire_do_not_import_the_controller():
    graph = _imports(_modules())
    bad = sorted((name, dep) for name, deps in graph.items() for dep in deps
                 for pkg, banned in FORBIDDEN.items()
                 if name.startswith(pkg + ".") and dep.startswith(banned))
    assert bad == [], f"imports across the layers (move the shared half to wire/): {bad}"


# ---- size and privacy ------------------------------------------------------------------------

MAX_MODULE_LINES = 500
MAX_JOB_LINES = 300


# Private names of the libraries planaria builds on, read where no public API serves (torch's
# module buffers, Ray's node, ``os._exit``): not planaria's own, whoever else spells them.
LIBRARY_PRIVATES = {"_buffers", "_non_persistent_buffers_set", "_BatchNorm", "_exit",
                    "_current_frames", "_private", "_raylet", "_global_node"}


def _private_names_defined(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions, classes and module variables, and
    the attributes it assigns (``self._x = ...``, ``obj._x = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _foreign_private_reads() -> set[tuple[str, str]]:
    trees = {name: ast.parse(path.read_text()) for name, path in _modules().items()}
    own = {name: _private_names_defined(tree) for name, tree in trees.items()}
    planarias = set().union(*own.values()) - LIBRARY_PRIVATES
    found = set()
    for name, tree in trees.items():
        for node in ast.walk(tree):
            on_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ("self", "cls")
            if (isinstance(node, ast.Attribute) and node.attr in planarias
                    and node.attr not in own[name] and not on_self):
                found.add((name, node.attr))
    return found


def _job_lines() -> int:
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "Job" and node.end_lineno:
                return node.end_lineno - node.lineno + 1
    raise AssertionError("no class Job in planaria")


def test_no_module_is_over_the_line_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    over = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them): {over}"


def test_the_job_facade_stays_small():
    assert _job_lines() <= MAX_JOB_LINES


def test_no_module_reads_another_modules_private_names():
    found = _foreign_private_reads()
    assert not found, f"reads of another module's private names (make them public): {sorted(found)}"


def test_the_privacy_checker_finds_a_foreign_read(tmp_path):
    reader = ast.parse("def f(job):\n    return job._gather()\n")
    owner = ast.parse("class Job:\n    def _gather(self):\n        pass\n")
    assert "_gather" in _private_names_defined(owner)
    assert "_gather" not in _private_names_defined(reader)
