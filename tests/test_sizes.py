"""The house's sizes (docs/design.md "Layers"): no module of the package above 500 lines, no class above 20
methods, no module docstring above 15 lines (the long reasons are [Note: ...] blocks, indexed in
docs/design.md). Each limit is a reader's: a file read in one sitting, a class with one job."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES, MAX_METHODS, MAX_DOCSTRING_LINES = 500, 20, 15


def package_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The package's Python files: offload/ (not through its links to swap/ and scheduler/), swap/, scheduler/."""
    files = []
    for folder in ("offload", "swap", "scheduler"):
        files += [p for p in sorted((root / folder).rglob("*.py"))
                  if not any(parent.is_symlink() for parent in p.relative_to(root).parents
                             if parent != pathlib.Path(".") and (root / parent).is_symlink())]
    return files


def oversized(files: list[pathlib.Path]) -> list[str]:
    """'path: what' for every module, class or docstring over its limit."""
    out = []
    for p in files:
        text = p.read_text()
        name = str(p.relative_to(ROOT)) if ROOT in p.parents else p.name
        if len(text.splitlines()) > MAX_LINES:
            out.append(f"{name}: {len(text.splitlines())} lines")
        tree = ast.parse(text, filename=str(p))
        doc = ast.get_docstring(tree, clean=False) or ""
        if len(doc.splitlines()) > MAX_DOCSTRING_LINES:
            out.append(f"{name}: a docstring of {len(doc.splitlines())} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                if methods > MAX_METHODS:
                    out.append(f"{name}: class {node.name} has {methods} methods")
    return out


def test_no_module_class_or_docstring_is_over_its_size():
    files = package_files()
    assert any(p.name == "store.py" for p in files) and not any("offload/swap" in str(p) for p in files)
    assert oversized(files) == []


def test_the_size_check_sees_each_limit(tmp_path):
    methods = "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_METHODS + 1))
    doc = '"""' + "line\n" * (MAX_DOCSTRING_LINES + 1) + '"""\n'
    big = tmp_path / "big.py"
    big.write_text(doc + "class C:\n" + methods + "x = 1\n" * MAX_LINES)
    assert oversized([big]) == [f"big.py: {MAX_DOCSTRING_LINES + 3 + 2 * (MAX_METHODS + 1) + MAX_LINES} lines",
                                f"big.py: a docstring of {MAX_DOCSTRING_LINES + 1} lines",
                                f"big.py: class C has {MAX_METHODS + 1} methods"]
    small = tmp_path / "small.py"
    small.write_text('"""One line."""\n\nclass C:\n    def m(self):\n        pass\n')
    assert oversized([small]) == []
