"""The shipped configs are also at the repository root (`configs/`), where a user of a checkout finds them:
the two copies are the same files, byte for byte."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "packages" / "trainer" / "src" / "jaxloom" / "trainer" / "configs"


def test_root_configs_equal_the_shipped_ones():
    shipped = {p.name: p.read_bytes() for p in SHIPPED.glob("*.yaml")}
    root = {p.name: p.read_bytes() for p in (ROOT / "configs").glob("*.yaml")}
    assert shipped and root == shipped, "copy packages/trainer/src/jaxloom/trainer/configs/*.yaml to configs/"
