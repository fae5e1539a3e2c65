"""docs/design.md "Layers": imports flow down only (offload -> scheduler -> swap), nothing imports bench/tests."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
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
