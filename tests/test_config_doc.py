"""The config reference (docs/config.md) is the text offload.config_doc generates from the Config dataclasses."""

import dataclasses
import pathlib

import pytest

from offload import config_doc
from offload.plan.config import Config

DOC = pathlib.Path(__file__).resolve().parent.parent / config_doc.DOC


def _section(text: str) -> str:
    return text.split(config_doc.BEGIN, 1)[1].split(config_doc.END, 1)[0].strip("\n")


def test_config_reference_matches_the_code():
    assert _section(DOC.read_text()) == config_doc.markdown(), (
        f"{config_doc.DOC}'s config reference drifted from offload/plan/config.py; regenerate it with "
        f"`{config_doc.REGENERATE}`")


def test_every_key_is_documented_with_its_default():
    rows = {key: (type_, default, text) for key, type_, default, text in config_doc.rows()}
    assert all(text for _, _, text in rows.values()), [k for k, (_, _, t) in rows.items() if not t]
    flat = {}

    def walk(obj, prefix=""):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            flat[prefix + f.name] = v
            if dataclasses.is_dataclass(v):
                walk(v, prefix + f.name + ".")

    walk(Config())
    assert set(rows) == set(flat)
    assert rows["optimizer.lr"] == ("float", "0.001", rows["optimizer.lr"][2])
    assert rows["nvme_path"][:2] == ("list[str] | str | None", "null")
    assert rows["aio"][0] == "section" and "`aio.block_bytes` | int | `8388608`" in config_doc.markdown()


def test_a_new_field_changes_the_table(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Extra(Config):
        new_knob: int = 7  # a knob added later

    assert ("new_knob", "int", "7", "a knob added later") in config_doc.rows(Extra)


def test_write_and_check(tmp_path, capsys):
    readme = tmp_path / "config.md"
    readme.write_text(f"# x\n\n{config_doc.BEGIN}\nstale\n{config_doc.END}\nafter\n")
    assert config_doc.main(["--check", str(readme)]) == 1
    assert config_doc.REGENERATE in capsys.readouterr().err
    assert config_doc.main(["--write", str(readme)]) == 0
    text = readme.read_text()
    assert _section(text) == config_doc.markdown() and text.endswith(f"{config_doc.END}\nafter\n")
    assert config_doc.main(["--check", str(readme)]) == 0
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        config_doc.main(["--write", str(readme)])
