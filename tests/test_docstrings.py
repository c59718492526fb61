"""Every public class and function (and public method) of every part has a docstring."""

from check_docstrings import missing


def test_every_public_name_has_a_docstring():
    assert missing() == []
