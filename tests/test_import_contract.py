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


# ---- inside a part: modules form a DAG too, and only the command line imports the command line ----------
def module_imports(part: str, root: Path | None = None) -> dict[str, set[str]]:
    """`{module: {modules of the same part it imports}}` (relative or absolute, at module level or inside a
    function), module names relative to `jaxloom.<part>`; `__init__` is left out (it only re-exports)."""
    src = (root or parts.PACKAGES) / part / "src" / "jaxloom" / part
    names = {p.relative_to(src).with_suffix("").as_posix().replace("/", "."): p for p in sorted(src.rglob("*.py"))}
    names = {n: p for n, p in names.items() if not n.endswith("__init__")}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name.rsplit(".", 1)[0] if "." in name else ""
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    mod = ".".join([*base, *([node.module] if node.module else [])])
                elif node.module and node.module.startswith(f"jaxloom.{part}"):
                    mod = node.module.removeprefix(f"jaxloom.{part}").lstrip(".")
                else:
                    continue
                targets = [mod, *(f"{mod}.{a.name}".lstrip(".") for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [
                    a.name.removeprefix(f"jaxloom.{part}.") for a in node.names if a.name.startswith(f"jaxloom.{part}.")
                ]
            out |= {t for t in targets if t in names and t != name}
        graph[name] = out
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other in a loop (strongly connected groups of more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                loops.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return loops


@pytest.mark.parametrize("part", parts.PARTS)
def test_no_import_loop_inside_a_part(part):
    assert import_loops(module_imports(part)) == []


@pytest.mark.parametrize("part", parts.PARTS)
def test_only_the_command_line_imports_the_command_line_module(part):
    for module, deps in module_imports(part).items():
        if module.split(".")[-1] not in ("cli", "__main__"):
            assert "cli" not in deps, f"jaxloom.{part}.{module} imports the command line module jaxloom.{part}.cli"
    for other in parts.PARTS:  # no other part's library module reaches a part's CLI either
        for path in sorted((parts.PACKAGES / other / "src").rglob("*.py")):
            if path.stem == "cli":
                continue
            text = path.read_text()
            assert f"jaxloom.{part}.cli" not in text, f"{path} imports jaxloom.{part}.cli"


def test_the_loop_check_catches_a_loop(tmp_path):
    """Two modules of one part that import each other (one inside a function) are a loop."""
    src = tmp_path / "data" / "src" / "jaxloom" / "data"
    src.mkdir(parents=True)
    (src / "a.py").write_text("from .b import x\n")
    (src / "b.py").write_text("x = 1\ndef f():\n    from jaxloom.data.a import y\n")
    (src / "c.py").write_text("from . import a\n")
    assert import_loops(module_imports("data", tmp_path)) == [["a", "b"]]
