"""`jaxloom.core.schema` — `@config`: one schema for every config; values converted by type, errors name
key, value and expectation."""

import dataclasses

import pytest

from jaxloom.core.schema import NonNegativeInt, PositiveFloat, PositiveInt, config


@config
class Example:
    steps: PositiveInt = 1
    rate: PositiveFloat = 0.5
    skip: NonNegativeInt = 0
    dims: tuple[int, ...] = (1,)
    name: str | None = None

    def __post_init__(self) -> None:
        if self.name == "forbidden":
            raise ValueError("name 'forbidden'; expected any other name")


def test_values_are_converted_by_their_types():
    e = Example(steps="3", rate="1e-5", dims=[2, 3])
    assert (e.steps, e.rate, e.dims) == (3, 1e-5, (2, 3))
    assert isinstance(e.dims, tuple) and hash(e) == hash(Example(steps=3, rate=1e-5, dims=(2, 3)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 3.5}, r"Example: steps = 3.5; expected a valid integer"),
        ({"steps": 0}, r"Example: steps = 0; expected a positive integer"),
        ({"steps": True}, r"Example: steps = True; expected a number, not true/false"),
        ({"rate": float("inf")}, r"rate = inf; expected a positive finite number"),
        ({"skip": -1}, r"skip = -1; expected a non-negative number"),
        ({"stepz": 2}, r"unknown key 'stepz' \(did you mean 'steps'\?\); expected some of \['dims', "),
        ({"name": "forbidden"}, r"^Example: name 'forbidden'; expected any other name$"),
    ],
)
def test_bad_values_are_one_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Example(**kwargs)


def test_replace_validates_again_and_configs_are_frozen():
    e = Example()
    with pytest.raises(ValueError, match="steps = -2"):
        dataclasses.replace(e, steps=-2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.steps = 4  # type: ignore[misc]
