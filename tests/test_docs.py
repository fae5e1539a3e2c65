"""The docs are a front door that holds: README.md is short with its status box on the first screen, and
every relative link in README.md, docs/*.md, bench/RESULTS.md and docker/README.md resolves to a file and,
for an #anchor into a markdown file, to one of its headings (GitHub's slugs)."""

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "RESULTS.md", ROOT / "docker" / "README.md",
               *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked out (links there are not links)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation other than - and _
    dropped, each space a hyphen (github-slugger)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)              # code spans render as their text
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)   # links render as their text
    text = re.sub(r"[*_]{1,3}(\S[^*_]*?)[*_]{1,3}", r"\1", text)  # emphasis markers
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: pathlib.Path) -> list[str]:
    bad = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):   # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no file {_rel(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {_rel(dest)}")
    return bad


def test_the_docs_exist():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"design.md", "config.md", "deepspeed.md", "huggingface.md", "checkpoints.md", "zero.md",
            "failures.md"} <= names, names


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert path.exists()
    assert broken_links(path) == []


def test_the_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading, with punctuation!\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#a-code-heading-with-punctuation) [ok](other.md#twice-1)\n"
                    "[ok](#local) [web](https://example.com/x) `[not a link](nowhere.md)`\n\n"
                    "```\n[not a link either](nowhere.md)\n```\n\n## Local\n"
                    "[bad](missing.md) [bad](other.md#no-such-heading) [bad](#nowhere)\n")
    bad = broken_links(page)
    assert len(bad) == 3, bad
    assert "missing.md" in bad[0] and "#no-such-heading" in bad[1] and "#nowhere" in bad[2]


def test_slugs_follow_github():
    assert slug("I/O errors, close() and signals") == "io-errors-close-and-signals"
    assert slug("`make demo`") == "make-demo"
    assert slug("Chunks and budgets") == "chunks-and-budgets"
    assert slug("One-step delayed parameter update") == "one-step-delayed-parameter-update"
    assert slug("Training with `offload train`") == "training-with-offload-train"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"
    starts = [i for i, line in enumerate(lines) if line.startswith("> **Status**")]
    assert starts and starts[0] < 40, "the status box (a line starting '> **Status**') belongs on the first screen"
    box = []
    for line in lines[starts[0]:]:
        if not line.startswith(">"):
            break
        box.append(line.lstrip("> "))
    text = " ".join(box)
    assert re.search(r"on a GPU only `bench/gpu_check.py` has run", text), text
    assert re.search(r"Not run on a GPU: NCCL, several GPUs", text), text
    assert "make test" in "\n".join(lines) and "make demo" in "\n".join(lines)


# a note's block: a line that begins with "[Note: X]" (after "#" or "//"), alone or followed by its text; a line
# that begins with a reference goes on with "in", ";", "," or "continued"
NOTE_BLOCK = re.compile(r"^\s*(?:#|//)?\s*(\[Note: [^\]]+\])(?:\s*$|\s+(?!in\b|continued\b)\w)", re.M)


def notes_in_the_code() -> dict[str, set[str]]:
    """file (relative to the repository) -> the [Note: ...] blocks it holds."""
    found = {}
    for folder in ("offload", "swap", "scheduler"):
        for where, _, files in os.walk(ROOT / folder):  # not into offload/swap and offload/scheduler: links
            for p in (pathlib.Path(where, f) for f in files if f.endswith((".py", ".cpp", ".h"))):
                blocks = set(NOTE_BLOCK.findall(p.read_text()))
                if blocks:
                    found[str(p.relative_to(ROOT))] = blocks
    return found


def test_the_notes_index_and_the_notes_in_the_code_are_the_same_both_ways():
    """docs/design.md's "Notes in the code" table lists every [Note: ...] block in the code, in the file that
    holds it, and nothing else."""
    design = (ROOT / "docs" / "design.md").read_text()
    table = design.split("## Notes in the code", 1)[1]
    rows = re.findall(r"^\| ([\w/.]+\.(?:py|cpp|h)) \| (.+) \|$", table, re.M)
    listed = {f: set(re.findall(r"\[Note: [^\]]+\]", notes)) for f, notes in rows}
    assert len(listed) == len(rows) > 20, rows  # one row a file
    assert listed == notes_in_the_code()


def test_no_comment_dates_a_run():
    """Dates and figures of runs live in bench/RESULTS.md; a comment names the section."""
    dated = [f"{p.relative_to(ROOT)}:{i}" for folder in ("offload", "swap", "scheduler")
             for where, _, files in os.walk(ROOT / folder) for p in (pathlib.Path(where, f) for f in files)
             if p.suffix in (".py", ".cpp", ".h")
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert dated == []


def test_a_reference_to_a_note_is_not_taken_for_its_block():
    text = ("# [Note: a] its text\n    [Note: b]\n# [Note: c] in offload/x.py says\n# [Note: d]; then\n"
            "// [Note: e] continued: more\n    \"\"\"[Note: f] a docstring's reference\n")
    assert NOTE_BLOCK.findall(text) == ["[Note: a]", "[Note: b]"]


def test_no_citation_of_a_file_outside_the_repository():
    """The design record is docs/design.md; the code once cited a DESIGN.md the repository never had."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for d in ("offload", "scheduler", "swap", "bench", "tests", "examples")
            for p in sorted((ROOT / d).rglob("*.py")) if p.name != "test_docs.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if "DESIGN.md" in line]
    assert hits == []
