"""Every public class and function (and public method) of every part has a docstring of its own that names
its arguments; constants have attribute docstrings. The checker itself is tested on a made-up module."""

import importlib.util
import textwrap

from check_docstrings import missing, problems


def test_every_public_name_has_a_docstring_naming_its_arguments():
    assert missing() == []


def test_the_check_catches_each_kind_of_gap(tmp_path):
    (tmp_path / "fake_mod.py").write_text(
        textwrap.dedent('''
        import dataclasses
        import enum

        __all__ = ["GOOD", "BAD", "good", "half", "bare", "Auto", "Fields", "Kind", "Child"]
        GOOD = 1
        """Documented."""
        BAD = 2


        def good(x, y=1, *args, **kwargs):
            """Uses `x` and y."""


        def half(alpha, beta):
            """Only alpha."""


        def bare(z):
            pass


        @dataclasses.dataclass
        class Auto:
            a: int = 0


        @dataclasses.dataclass
        class Fields:
            """Has `a`."""
            a: int = 0
            b: int = 1

            def method(self, q):
                """No argument named."""


        class Kind(enum.Enum):
            """An enum: built from a value, not arguments."""
            A = 1


        @dataclasses.dataclass
        class Child(Fields):
            """Inherits `a` and `b`, adds `c`."""
            c: int = 2
    ''')
    )
    spec = importlib.util.spec_from_file_location("fake_mod", tmp_path / "fake_mod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert problems(module) == [
        "fake_mod.BAD: constant without an attribute docstring",
        "fake_mod.half: docstring does not name beta",
        "fake_mod.bare: no docstring",
        "fake_mod.Auto: no docstring",  # the dataclass's made-up signature does not count
        "fake_mod.Fields: docstring does not name b",
        "fake_mod.Fields.method: docstring does not name q",
    ]
