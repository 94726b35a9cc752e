"""The documentation stays true to the code: docs/reference/* is what docs/gen.py makes of the code today, every
relative link in README.md and docs/ reaches a file (and a heading, when it names one), and the README stays a
page an operator reads in minutes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_gen", DOCS / "gen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_gen"] = module
    spec.loader.exec_module(module)
    return module


gen = _gen()


@pytest.mark.parametrize("name", sorted(gen.PAGES))
def test_each_reference_page_is_what_the_code_generates(name: str) -> None:
    path = gen.REFERENCE / name
    want = gen.PAGES[name]()
    assert path.exists(), f"docs/reference/{name} is missing: run `{gen.COMMAND}`"
    assert path.read_text() == want, (f"docs/reference/{name} is stale (the code changed since it was generated): "
                                      f"run `{gen.COMMAND}` and commit the page")


def test_the_pages_are_generated_deterministically() -> None:
    assert gen.pages() == gen.pages()


def test_a_changed_flag_help_makes_the_cli_page_stale(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What a flag's help edited without `make docs` does: the comparison names the page."""
    for name, text in gen.pages().items():
        (tmp_path / name).write_text(text)
    assert gen.stale(tmp_path) == []
    parser = gen.cli.parser

    def edited() -> object:
        ap = parser()
        run = gen._subparsers(ap)["run"]  # noqa: SLF001
        next(a for a in run._actions if "--sync-period" in a.option_strings).help = "edited"  # noqa: SLF001
        return ap

    monkeypatch.setattr(gen.cli, "parser", edited)
    assert gen.stale(tmp_path) == [str(tmp_path / "cli.md")]


def test_every_config_field_is_described() -> None:
    assert gen.undocumented_fields() == [], ("config fields docs/gen.py cannot describe: map them to their flag in "
                                             "FIELD_FLAGS (or say what they do in FIELD_NOTES), then `make docs`")


def test_every_flag_of_run_is_on_the_cli_page() -> None:
    page = gen.cli_page()
    run = gen._subparsers(gen.cli.parser())["run"]  # noqa: SLF001
    for action in gen._actions(run):  # noqa: SLF001
        assert f"`{action.option_strings[0]}`" in page
