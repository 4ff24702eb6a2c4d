"""The package's structure, read from its source with `ast`: no import cycle, no private name taken from
another module, no module over 400 lines, no function over 60.

Each check is a function of a package's root directory that returns its problems, one line each
(`file:line: what`), so the self-tests below can run it on a small synthetic package and show it fails.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

PACKAGE = Path(__file__).resolve().parents[1] / "infopt_lab"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# infopt_lab/cli.py's functions that build the argparse parser: one add_argument call per option, so they grow
# with the command line. Only these may run past MAX_FUNCTION_LINES (and Triton kernels, see `_is_triton_kernel`).
CLI_PARSER_BUILDERS = {"build_parser"}


# -- reading a package -----------------------------------------------------------------------------
def modules(root: Path) -> dict[str, Path]:
    """Every module under `root` by dotted name; a package is its `__init__.py`, named after the package."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _label(root: Path, path: Path) -> str:
    return str(Path(root.name) / path.relative_to(root))


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _base(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a `from ... import` statement in module `name` (file `path`) takes its names from."""
    if node.level == 0:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


class Import(NamedTuple):
    """One imported name: what the import graph and the private-name check need of it."""

    line: int
    target: str              # the project module the statement imports: an edge of the import graph
    source: str | None       # `from source import name`; None for `import target`
    name: str | None         # the name taken from `source`
    bound: str               # the name the file binds
    module: str | None       # the project module `bound` names, or None when it names something else


def imports(known: dict[str, Path], name: str, path: Path, tree: ast.Module) -> Iterator[Import]:
    """Every import of a project module (`known`) in module `name`'s file, at any depth (inside functions too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    module = alias.name if alias.asname else alias.name.split(".")[0]
                    yield Import(node.lineno, alias.name, None, None, alias.asname or module, module)
        elif isinstance(node, ast.ImportFrom):
            base = _base(name, path, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                bound = alias.asname or alias.name
                if sub in known:                                # `from . import x`, x a submodule
                    yield Import(node.lineno, sub, base, alias.name, bound, sub)
                elif base in known:
                    yield Import(node.lineno, base, base, alias.name, bound, None)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# -- the checks --------------------------------------------------------------------------------------
def import_cycles(root: Path) -> list[str]:
    """Each cycle among the modules under `root`, with the import statements that close it."""
    known = modules(root)
    edges: dict[str, dict[str, tuple[Path, int]]] = {}
    for name, path in known.items():
        edges[name] = {}
        for imp in imports(known, name, path, _parse(path)):
            if imp.target != name:
                edges[name].setdefault(imp.target, (path, imp.line))
    problems = []
    for component in _strongly_connected(edges):
        if len(component) > 1:
            members = set(component)
            steps = [f"{_label(root, path)}:{line}: {a} imports {b}"
                     for a in sorted(members) for b, (path, line) in sorted(edges[a].items()) if b in members]
            problems.append(f"import cycle among {sorted(members)}:\n  " + "\n  ".join(steps))
    return problems


def _strongly_connected(edges: dict[str, dict[str, object]]) -> list[list[str]]:
    """Tarjan's algorithm: the strongly connected components of a directed graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def private_names_used(root: Path) -> list[str]:
    """Underscore names (not dunders) that one module takes from another: by `from x import _name`, or as
    `mod._name` where `mod` is bound to another project module in that file."""
    known = modules(root)
    problems = []
    for name, path in known.items():
        tree = _parse(path)
        bound = {}
        for imp in imports(known, name, path, tree):
            if imp.module is not None:
                bound[imp.bound] = imp.module
            if imp.source not in (None, name) and _private(imp.name):
                problems.append(f"{_label(root, path)}:{imp.line}: imports {imp.source}.{imp.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                module = _module_of(node.value, bound, known)
                if module is not None and module != name:
                    problems.append(f"{_label(root, path)}:{node.lineno}: uses {module}.{node.attr}")
    return sorted(set(problems))


def _module_of(node: ast.expr, bound: dict[str, str], known: dict[str, Path]) -> str | None:
    """The project module an expression names (`mod`, `pkg.sub`), or None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _module_of(node.value, bound, known)
        if parent is not None and f"{parent}.{node.attr}" in known:
            return f"{parent}.{node.attr}"
    return None


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> list[str]:
    """Modules under `root` with more than `limit` lines."""
    problems = []
    for path in modules(root).values():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            problems.append(f"{_label(root, path)}:1: {n} lines (at most {limit})")
    return problems


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions (nested ones too) over `limit` lines, but for cli.py's parser builders and Triton kernels."""
    problems = []
    for path in modules(root).values():
        for node in ast.walk(_parse(path)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            n = node.end_lineno - node.lineno + 1
            exempt = _is_triton_kernel(node) or (path == root / "cli.py" and node.name in CLI_PARSER_BUILDERS)
            if n > limit and not exempt:
                problems.append(f"{_label(root, path)}:{node.lineno}: {node.name} has {n} lines (at most {limit})")
    return problems


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with `triton.jit`, `jit`, or either called with arguments."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Name) and target.id == "jit":
            return True
        if isinstance(target, ast.Attribute) and target.attr == "jit" \
                and isinstance(target.value, ast.Name) and target.value.id == "triton":
            return True
    return False


# -- the package ---------------------------------------------------------------------------------------
def test_no_import_cycle_counting_imports_inside_functions():
    problems = import_cycles(PACKAGE)
    assert not problems, "\n".join(problems)


def test_no_module_uses_another_modules_private_names():
    problems = private_names_used(PACKAGE)
    assert not problems, "\n".join(problems)


def test_no_module_over_400_lines():
    problems = long_modules(PACKAGE)
    assert not problems, "\n".join(problems)


def test_no_function_over_60_lines():
    problems = long_functions(PACKAGE)
    assert not problems, "\n".join(problems)


def test_the_cli_parser_builders_exist():
    """The allow-list names real functions, so an exemption cannot outlive its function."""
    defined = {n.name for n in ast.walk(_parse(PACKAGE / "cli.py")) if isinstance(n, ast.FunctionDef)}
    assert CLI_PARSER_BUILDERS <= defined, CLI_PARSER_BUILDERS - defined


# -- the checks on synthetic packages --------------------------------------------------------------
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_cycle_through_imports_inside_functions_is_found(tmp_path):
    root = _package(tmp_path, {"a.py": "def f():\n    from .b import g\n",
                               "b.py": "import os\n\n\ndef g():\n    from . import a\n",
                               "c.py": "from .a import f\n"})
    (problem,) = import_cycles(root)
    assert "['pkg.a', 'pkg.b']" in problem
    assert "pkg/a.py:2: pkg.a imports pkg.b" in problem and "pkg/b.py:5: pkg.b imports pkg.a" in problem


def test_a_cycle_through_a_package_init_is_found(tmp_path):
    root = _package(tmp_path, {"__init__.py": "from .a import f\n", "a.py": "def f():\n    import pkg\n",
                               "sub/__init__.py": "from .x import y\n", "sub/x.py": "from .. import sub\ny = 1\n"})
    problems = import_cycles(root)
    assert len(problems) == 2
    assert any("pkg/a.py:2: pkg.a imports pkg" in p and "pkg/__init__.py:1: pkg imports pkg.a" in p for p in problems)
    assert any("pkg/sub/x.py:1: pkg.sub.x imports pkg.sub" in p for p in problems)


def test_imports_without_a_cycle_pass(tmp_path):
    root = _package(tmp_path, {"__init__.py": "from . import a, b\n", "a.py": "from .b import g\n",
                               "b.py": "import os\n\n\ndef g():\n    return os\n"})
    assert import_cycles(root) == []


def test_private_names_of_another_module_are_flagged(tmp_path):
    root = _package(tmp_path, {
        "a.py": "_x = 1\n__version__ = 2\n\n\ndef _own():\n    return _x\n",
        "b.py": "from .a import _x, __version__\n",
        "c.py": "from . import a\nimport pkg.a as m\nimport pkg.sub.d\n\n\ndef f():\n    from .a import _own as o\n"
                "    return a._x, m._own, a.__doc__, pkg.sub.d._y, o\n",
        "sub/__init__.py": "", "sub/d.py": "_y = 1\n\n\ndef g():\n    from .. import a\n    return a._x\n",
        "e.py": "from .a import _x\n_z = _x\n",
    })
    assert private_names_used(root) == sorted([
        "pkg/b.py:1: imports pkg.a._x", "pkg/c.py:7: imports pkg.a._own", "pkg/c.py:8: uses pkg.a._x",
        "pkg/c.py:8: uses pkg.a._own", "pkg/c.py:8: uses pkg.sub.d._y", "pkg/e.py:1: imports pkg.a._x",
        "pkg/sub/d.py:6: uses pkg.a._x"])


def test_long_modules_are_flagged(tmp_path):
    root = _package(tmp_path, {"short.py": "x = 1\n" * 400, "long.py": "x = 1\n" * 401})
    assert long_modules(root) == ["pkg/long.py:1: 401 lines (at most 400)"]


def test_long_functions_are_flagged_but_parser_builders_and_kernels_are_not(tmp_path):
    body, nested = "    x = 1\n" * 59, "        x = 1\n" * 59
    root = _package(tmp_path, {
        "a.py": f"def fits():\n{body}\n\ndef outer():\n    def inner():\n{nested}        return x\n    return inner\n",
        "cli.py": f"def build_parser():\n{body}    return x\n\n\ndef main():\n{body}    return x\n",
        "k.py": f"import triton\n\n\n@triton.jit\ndef kernel():\n{body}    return x\n\n\n"
                f"@triton.autotune(configs=[])\n@triton.jit(debug=True)\ndef tuned():\n{body}    return x\n",
    })
    assert sorted(long_functions(root)) == ["pkg/a.py:63: outer has 63 lines (at most 60)",
                                            "pkg/a.py:64: inner has 61 lines (at most 60)",
                                            "pkg/cli.py:64: main has 61 lines (at most 60)"]
