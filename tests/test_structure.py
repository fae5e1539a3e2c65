"""The tests' own structure: no test module imports another (a test module's import runs its module-level
skips and fixtures, and ties two suites together); what several share lives in a helper module of tests/
named for what it holds (engine_util, ranks_util, parity_util, hf_util, ...). Imports in function bodies
count, and so do those in the code a test runs in a child process (a string)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
IN_CODE = re.compile(r"(?:from|import)\s+tests\.(test_\w+)|from\s+tests\s+import\s+([\w, ]+)")


def imported_test_modules(path: pathlib.Path) -> set[str]:
    """The test modules (tests.test_*) that the file imports, in its statements or in a string of code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for dotted, listed in IN_CODE.findall(node.value):
                names.update([f"tests.{dotted}"] if dotted else (f"tests.{n.strip()}" for n in listed.split(",")))
    return {n.split(".")[1] for n in names if re.fullmatch(r"tests\.test_\w+", n)}


def test_no_test_module_imports_another():
    offenders = {}
    for f in sorted((ROOT / "tests").glob("test_*.py")):
        other = imported_test_modules(f) - {f.stem}
        if other:
            offenders[f.name] = sorted(other)
    assert not offenders, f"move what they share into a helper module of tests/: {offenders}"


def test_the_checker_sees_every_form_of_import(tmp_path):
    f = tmp_path / "test_x.py"
    code = ("from PKG import test_a, hf_archs\nimport PKG.test_b\nfrom PKG.ranks_util import run_ranks\n"
            "def f():\n    from PKG.test_c import helper\n"
            "CODE = 'import json; from PKG.test_d import g; from PKG.engine_util import MLP'\n"
            "from PKG.test_x import self_import\n")
    f.write_text(code.replace("PKG", "tests"))  # PKG: this file's own strings name no test module
    assert imported_test_modules(f) == {"test_a", "test_b", "test_c", "test_d", "test_x"}
