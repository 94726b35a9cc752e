"""The documentation stays true to the code: docs/reference/* is what docs/gen.py makes of the code today, every
relative link in README.md and docs/ reaches a file (and a heading, when it names one), and the README stays a
page an operator reads in minutes."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RUN_ID = re.compile(r"\b20\d{6}T\d{6}Z\b")


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


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lowercased, punctuation but - and _ dropped, spaces as -."""
    out = set()
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        out.add(slug)
    return out


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        dest = (page.parent / target).resolve() if target else page
        if not dest.exists():
            broken.append(f"{link}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{link}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)}: broken links"


def test_the_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_run_ids_stand_only_in_benchmark_captions() -> None:
    """The README names one run, only in its benchmark section's captions (the table's and the plot's); of docs/,
    only benchmarks.md names runs (dated narratives belong in bench/results/<run>.md)."""
    text = README.read_text()
    start = text.index("\n## Benchmarks")
    end = text.index("\n## ", start + 1)
    assert not RUN_ID.search(text[:start] + text[end:]), "a run id outside the README's Benchmarks section"
    section = text[start:end]
    captions = [line for line in section.splitlines() if RUN_ID.search(line)]
    assert len(set(RUN_ID.findall(section))) == 1 and len(captions) <= 2
    assert all(line.startswith(("Run ", "![")) for line in captions)
    for page in sorted(DOCS.rglob("*.md")):
        if page.name != "benchmarks.md":
            assert not RUN_ID.search(page.read_text()), f"{page.relative_to(ROOT)} names a run"
