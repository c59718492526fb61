"""Config files and `key=value` overrides read into plain data: YAML (numbers as YAML 1.2 reads them, keys given twice,
aliases and dates refused by line and key) or JSON. `TrainingArguments` and the composition root build on it."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any


@functools.cache
def _yaml_loader():
    """PyYAML's safe loader reading numbers as YAML 1.2 does: `1e-5` and `1e6` are floats (YAML 1.1, which
    PyYAML follows, wants a dot and a signed exponent, so they would be text that crashes deep in a run)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def construct_mapping(self, node, deep=False):
        """A key given twice in one mapping is an error naming its line (PyYAML keeps the last one silently)."""
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (first at line {seen[key] + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        return yaml.SafeLoader.construct_mapping(self, node, deep=deep)

    Loader.construct_mapping = construct_mapping  # type: ignore[method-assign]
    Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    number = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$|^[-+]?\.[0-9_]+[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", number, list("-+0123456789."))
    return Loader


def _unique_keys(path: Path):
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"{path}: key(s) {twice} given twice in one object; expected each key once")
        return dict(items)

    return pairs


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON mapping; malformed files are an error naming the line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None
    else:
        import yaml

        try:
            for event in yaml.parse(text):  # a config is a tree: an alias could make it explode in memory
                if isinstance(event, yaml.AliasEvent):
                    line = event.start_mark.line + 1 if event.start_mark else "?"
                    raise ValueError(
                        f"{path}:{line}: YAML alias *{event.anchor}; expected plain values (aliases are refused: "
                        "one line can expand to gigabytes)"
                    )
            data = yaml.load(text, Loader=_yaml_loader())  # a safe loader: no arbitrary Python objects
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            raise ValueError(
                f"{path}: malformed YAML"
                + (f" at line {mark.line + 1}" if mark else "")
                + f": {getattr(e, 'problem', e)}"
            ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    _plain_values(data, path)
    return data


def _plain_values(value: Any, path: Any, key: str = "") -> None:
    """Every value of a config is text, a number, a boolean, null, a list or a section: YAML's dates and times
    (`save_directory: 2024-01-01`) are refused naming the key and how to write it as text."""
    import datetime

    if isinstance(value, dict):
        for k, v in value.items():
            _plain_values(v, path, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _plain_values(v, path, f"{key}[{i}]")
    elif isinstance(value, datetime.date | datetime.datetime | datetime.time):
        raise ValueError(
            f"{path}: {key} = {value} is read by YAML as a {type(value).__name__}; expected text: quote it "
            f"({key.rsplit('.', 1)[-1]}: '{value}')"
        )


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`["max_training_steps=20", "model.hidden_size=64"]` applied onto `data` (dots reach into sections)."""
    import yaml

    data = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}; expected key=value")
        key, raw = item.split("=", 1)
        value = yaml.load(raw, Loader=_yaml_loader()) if raw else raw
        _plain_values(value, "the command line", key)
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p!r} is not a section")
        node[leaf] = value
    return data
