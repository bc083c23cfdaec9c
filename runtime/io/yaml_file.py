"""YAML configuration files read strictly: a key given twice in one mapping is refused, because PyYAML keeps the
last value without a word and a user who edits the first one would run with a setting they did not choose."""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *base` then an explicit key overrides the base's: not a repeat
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: SafeLoader's own construct_mapping refuses it with its position
                break
            if repeated:
                raise ConstructorError("while constructing a mapping", node.start_mark,
                                       f"found duplicate key {reprlib.repr(key)}", key_node.start_mark)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> Any:
    """The document in `path`; raises OSError when it cannot be read, yaml.YAMLError when it is not YAML or repeats a
    key in a mapping (the message has the key and its line), ValueError for an integer of more digits than Python
    converts."""
    return yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)  # _UniqueKeyLoader is a SafeLoader
