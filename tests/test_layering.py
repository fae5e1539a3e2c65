"""docs/design.md "Layers": imports flow down only (offload -> scheduler -> swap), nothing imports bench/tests,
and no two modules of offload/, scheduler/, swap/ import each other, directly or around a circle."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("offload", "scheduler", "swap")
FORBIDDEN = {
    "swap": {"scheduler", "offload", "bench", "tests"},
    "scheduler": {"offload", "bench", "tests"},
    "offload": {"bench", "tests"},
}


def imported_top_levels(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_flow_down_only(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"package {package} has no Python files"
    offenders = {
        str(f.relative_to(ROOT)): sorted(imported_top_levels(f) & FORBIDDEN[package]) for f in files
    }
    offenders = {f: bad for f, bad in offenders.items() if bad}
    assert not offenders, f"layering broken (docs/design.md 'Layers'): {offenders}"


def test_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import offload.engine\nfrom scheduler import plan\n")
    assert imported_top_levels(bad) == {"offload", "scheduler"}


# --- no import cycles ------------------------------------------------------------------------------


def module_files(root: pathlib.Path, packages=PACKAGES) -> dict[str, pathlib.Path]:
    """Dotted module name -> file for every .py under the packages (a package is its __init__.py)."""
    out = {}
    for package in packages:
        for f in sorted((root / package).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def module_imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """The modules of `modules` that `name` imports anywhere in its file (function bodies included).

    `import a.b` and `from a.b import c` are edges to a.b (or to a.b.c when c is itself a module); the
    parents' __init__ that Python also runs on the way are not counted, or every module would form a
    circle with its package's __init__."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in out if m in modules and m != name}


def import_graph(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    modules = module_files(root, packages)
    return {name: module_imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycles():
    graph = import_graph()
    assert "offload.config" in graph and "swap.store" in graph, sorted(graph)
    found = cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in found]
    assert not found, f"modules importing each other (docs/design.md 'Layers'): {detail}"


def test_cycle_checker_finds_a_function_level_circle(tmp_path):
    pkg = tmp_path / "offload"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from offload.a import x\n")
    (pkg / "a.py").write_text("from offload import b\nx = 1\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import y\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def g():\n    import offload.a\n")
    (pkg / "d.py").write_text("import offload.a\n")
    graph = import_graph(tmp_path, ("offload",))
    assert graph["offload"] == {"offload.a"} and graph["offload.b"] == {"offload.sub.c"}
    assert cycles(graph) == [["offload.a", "offload.b", "offload.sub.c"]]


# --- no module reaches into the Engine ---------------------------------------------------------------------

ENGINE_NAMES = {"engine", "eng"}
PROTOCOL_MARKERS = {"_is_accelerate_prepared"}  # Accelerate's own flag on what it must not wrap again


def engine_reaches(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, attribute) of every `engine.X`, `eng.X` or `self.engine.X` in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id in ENGINE_NAMES) or (
                isinstance(v, ast.Attribute) and v.attr == "engine" and isinstance(v.value, ast.Name)
                and v.value.id == "self"):
            out.append((node.lineno, node.attr))
    return out


def unknown_reaches(files, allowed: set[str]) -> list[str]:
    return [f"{p.relative_to(p.parents[1])}:{line} .{attr}" for p in files for line, attr in engine_reaches(p)
            if attr not in allowed]


def engine_api() -> set[str]:
    from offload.engine import Engine

    return {n for n in dir(Engine) if not n.startswith("_")} | set(Engine.PUBLIC_FIELDS) | PROTOCOL_MARKERS


def test_no_module_reaches_an_engine_field_outside_its_public_api():
    files = [p for p in module_files(ROOT, ("offload",)).values() if p.name != "engine.py"]  # swap's engine is I/O
    assert not unknown_reaches(files, engine_api()), unknown_reaches(files, engine_api())


def test_reach_checker_sees_a_private_field(tmp_path):
    bad = tmp_path / "pkg" / "mod.py"
    bad.parent.mkdir()
    bad.write_text("def f(engine):\n    return engine._closed, engine.units, engine.staging_pool\n")
    assert unknown_reaches([bad], engine_api()) == ["pkg/mod.py:2 ._closed", "pkg/mod.py:2 .staging_pool"]
