"""docs/design.md "Layers": offload's subpackages, lowest first (LAYERS); a module imports only its own layer and
those below it, nothing imports bench/tests or a bare `swap` / `scheduler` (a user's folder of that name would
shadow it), and no two modules import each other, directly or around a circle."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# dotted package -> its folder: the repository's swap/ and scheduler/ are installed as offload.swap and
# offload.scheduler (and linked there in offload/ for a source checkout)
PACKAGES = {"offload": "offload", "offload.scheduler": "scheduler", "offload.swap": "swap"}
# lowest first; a layer is the packages (or modules) named in its row; a module belongs to the longest name
# that holds it. The DeepSpeed reader sits with the plan: the plan's Config.from_deepspeed reads through it.
LAYERS = (
    ("offload.swap",),                                     # swap files, buffers, I/O backends
    ("offload.scheduler",),                                # streams, the residency policy, telemetry
    ("offload.kernels",),                                  # compiled CPU Adam and its cache
    ("offload.plan", "offload.integrations.deepspeed"),    # config, units, chunks, memory, placement
    ("offload.state",),                                    # tiers, residency, optimizer states, materialize
    ("offload.step",),                                     # runtime, hooks, activations, gradients, pipeline
    ("offload.checkpoint",),                               # the checkpoint format, save and load
    ("offload",),                                          # the engine, the commands, flags, integrations
)
OUTSIDE = {"bench", "tests", "swap", "scheduler"}  # never imported by the package (bare names: shadowed)


def layer(module: str) -> int:
    held = [(len(name), i) for i, row in enumerate(LAYERS) for name in row
            if module == name or module.startswith(name + ".")]
    return max(held)[1]


def imported_names(path: pathlib.Path, package: str = "") -> set[str]:
    """The dotted modules a file imports, relative imports resolved against `package` (the file's own)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - (node.level - 1)], *([base] if base else [])])
            subs = {f"{base}.{alias.name}" for alias in node.names} & KNOWN  # `from offload import swap`
            names.update(subs or {base})
    return names


KNOWN = set()  # filled below: every module of the packages


def violations(name: str, imported: set[str]) -> list[str]:
    own = layer(name)
    return sorted(m for m in imported if m.split(".")[0] in OUTSIDE
                  or (m.split(".")[0] == "offload" and layer(m) > own))


@pytest.mark.parametrize("row", LAYERS, ids=lambda row: row[0])
def test_imports_flow_down_only(row):
    files = module_files()
    mine = {name: f for name, f in files.items() if layer(name) == LAYERS.index(row)}
    assert mine, f"layer {row} has no Python files"
    offenders = {}
    for name, f in mine.items():
        pkg = name if f.name == "__init__.py" else name.rpartition(".")[0]
        bad = violations(name, imported_names(f, pkg))
        if bad:
            offenders[str(f.relative_to(ROOT))] = bad
    assert not offenders, f"layering broken (docs/design.md 'Layers'): {offenders}"


def test_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import offload.engine\nfrom offload.scheduler import plan\nfrom swap import x\nfrom . import y\n")
    names = imported_names(bad, "offload.swap")
    assert names == {"offload.engine", "offload.scheduler", "swap", "offload.swap"}
    assert violations("offload.swap.store", names) == ["offload.engine", "offload.scheduler", "swap"]
    assert violations("offload.engine", {"offload.swap.store", "offload.scheduler.policy"}) == []


def test_nothing_imports_a_bare_swap_or_scheduler():
    """bench/, tests/ and examples/ too: every import of our packages goes through offload."""
    offenders = {}
    for folder in ("bench", "tests", "examples", "offload", "swap", "scheduler"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            bad = sorted(m for m in imported_names(f) if m.split(".")[0] in {"swap", "scheduler"})
            if bad:
                offenders[str(f.relative_to(ROOT))] = bad
    assert not offenders, offenders


# --- no import cycles ------------------------------------------------------------------------------


def module_files(root: pathlib.Path = ROOT, packages: dict = PACKAGES) -> dict[str, pathlib.Path]:
    """Dotted module name -> file for every .py under the packages' folders (a package is its __init__.py);
    links inside a folder (offload/swap -> ../swap) are not followed: the folder itself is listed."""
    out = {}
    for package, folder in packages.items():
        base = root / folder
        for f in sorted(base.rglob("*.py")):
            rel = f.relative_to(base)
            if any((base / pathlib.Path(*rel.parts[:i])).is_symlink() for i in range(1, len(rel.parts))):
                continue
            parts = (*package.split("."), *rel.with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


KNOWN.update(module_files())


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
    assert "offload.plan.config" in graph and "offload.swap.store" in graph, sorted(graph)
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
    graph = import_graph(tmp_path, {"offload": "offload"})
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
    files = [p for n, p in module_files(ROOT, {"offload": "offload"}).items() if p.name != "engine.py"]  # the Engine itself
    assert not unknown_reaches(files, engine_api()), unknown_reaches(files, engine_api())


def test_reach_checker_sees_a_private_field(tmp_path):
    bad = tmp_path / "pkg" / "mod.py"
    bad.parent.mkdir()
    bad.write_text("def f(engine):\n    return engine._closed, engine.units, engine.staging_pool\n")
    assert unknown_reaches([bad], engine_api()) == ["pkg/mod.py:2 ._closed", "pkg/mod.py:2 .staging_pool"]
