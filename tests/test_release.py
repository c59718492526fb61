"""The promises of the monorepo's layout and versions."""

import re

import parts
import pytest
from packaging.specifiers import SpecifierSet


def test_meta_package_pins_match_the_parts():
    assert parts.pin_problems() == []


def test_a_wrong_pin_is_caught(monkeypatch):
    real = parts.version
    monkeypatch.setattr(parts, "version", lambda p: "9.9.9" if p == "mesh" else real(p))
    assert parts.pin_problems() == [
        f"the meta-package pins jaxloom-mesh=={real('mesh')}, but the part's version is 9.9.9"
    ]


@pytest.mark.parametrize("part", [*parts.PARTS, parts.META])
def test_part_layout_and_changelog(part):
    pkg = parts.PACKAGES / part
    for f in ("pyproject.toml", "README.md", "CHANGELOG.md"):
        assert (pkg / f).is_file(), f"{part} lacks {f}"
    if part != parts.META:  # only the meta-package may own jaxloom/__init__.py
        assert not (pkg / "src" / "jaxloom" / "__init__.py").exists()
        assert (pkg / "src" / "jaxloom" / part / "__init__.py").is_file()
    top = re.search(r"^## (\S+)", (pkg / "CHANGELOG.md").read_text(), re.M)
    assert top and top.group(1) == parts.version(part), f"{part}: CHANGELOG's newest entry is not {parts.version(part)}"
    assert parts.pyproject(part)["build-system"]["build-backend"] == "hatchling.build"


@pytest.mark.parametrize("part", [*parts.PARTS, parts.META])
def test_dependencies_are_ranges_and_siblings_resolve_locally(part):
    for name, spec in parts.requirements(part):
        if name.startswith("jaxloom-"):
            sibling = name.removeprefix("jaxloom-")
            assert sibling in parts.PARTS, f"{part} depends on unknown part {name}"
            local = parts.version(sibling)
            assert local in SpecifierSet(spec), f"{part} needs {name}{spec}, local is {local}"
        else:
            assert "==" not in spec and "===" not in spec, f"{part} pins third-party {name}{spec}: use a range"
        if part == parts.META:
            assert name.startswith("jaxloom-") and spec.startswith("=="), f"meta: {name}{spec} is not an exact pin"


def test_sibling_graph_is_a_dag_in_dependency_order():
    order = {p: i for i, p in enumerate(parts.PARTS)}
    for p in parts.PARTS:
        for s in parts.siblings(p):
            assert order[s] < order[p], f"{p} depends on {s}, which comes later"


def test_the_readme_table_shows_each_part_at_its_version():
    """The root README's table of parts names every part with the version its package has (no drift)."""
    import re

    text = (parts.ROOT / "README.md").read_text()
    for part in (*parts.PARTS, parts.META):
        name = "jaxloom" if part == parts.META else f"jaxloom-{part}"
        row = re.search(rf"^\| \[`{re.escape(name)}`\]\(packages/{part}\) \| [^|]+ \| (\S+) ", text, re.M)
        assert row, f"README.md has no row for {name}"
        assert row.group(1) == parts.version(part), (
            f"README.md shows {name} {row.group(1)}; the package is {parts.version(part)}"
        )
