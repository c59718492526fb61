"""The part DAG enforced on the code, not only on pyproject: every `jaxloom.<part>` a part's sources
import (at module level or inside a function, absolute or via `importlib`) is a part it declares and
that comes earlier in the dependency order; and every part it declares at run time is imported."""

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import parts  # noqa: E402


def imported_parts(part: str) -> dict[str, list[str]]:
    """`{other part: ["file:line", ...]}` for every import of another part in `part`'s sources."""
    found: dict[str, list[str]] = {}
    src = parts.PACKAGES / part / "src" / "jaxloom" / part
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "jaxloom"]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names = [str(node.args[0].value)]
            for name in names:
                bits = name.split(".")
                if bits[0] == "jaxloom" and len(bits) > 1 and bits[1] in parts.PARTS and bits[1] != part:
                    found.setdefault(bits[1], []).append(f"{path.relative_to(parts.ROOT)}:{node.lineno}")
    return found


@pytest.mark.parametrize("part", parts.PARTS)
def test_a_part_imports_only_earlier_parts_it_declares(part):
    order = {p: i for i, p in enumerate(parts.PARTS)}
    declared = set(parts.siblings(part))
    for other, where in imported_parts(part).items():
        assert order[other] < order[part], f"{part} imports the later part jaxloom.{other} at {where}"
        assert other in declared, f"{part} imports jaxloom.{other} (at {where}) without declaring jaxloom-{other}"


@pytest.mark.parametrize("part", parts.PARTS)
def test_a_part_declares_only_parts_it_imports(part):
    unused = set(parts.siblings(part)) - set(imported_parts(part))
    assert not unused, (
        f"{part} declares {sorted(unused)} at run time but never imports them (a test-only need "
        f"belongs in its `test` extra)"
    )


def test_the_contract_catches_a_back_import(tmp_path, monkeypatch):
    """A later part imported by an earlier one (here: mesh importing the trainer inside a function) fails."""
    fake = tmp_path / "packages" / "mesh" / "src" / "jaxloom" / "mesh"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from jaxloom.trainer import cli\n")
    (tmp_path / "packages" / "mesh" / "pyproject.toml").write_text(
        '[project]\nname = "jaxloom-mesh"\ndependencies = ["jax"]\n'
    )
    monkeypatch.setattr(parts, "PACKAGES", tmp_path / "packages")
    monkeypatch.setattr(parts, "ROOT", tmp_path)
    assert imported_parts("mesh") == {"trainer": ["packages/mesh/src/jaxloom/mesh/bad.py:2"]}
    with pytest.raises(AssertionError, match="imports the later part jaxloom.trainer"):
        test_a_part_imports_only_earlier_parts_it_declares("mesh")
