"""YAML configuration files read strictly: a key given twice in one mapping is refused, because PyYAML keeps the
last value without a word and a user who edits the first one would run with a setting they did not choose; a value
they refuse is quoted cut short (`shown`)."""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()  # mappings already checked: flattening puts merged keys into them

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Refuse a key given twice before `<<` merges bring in keys its own may override (PyYAML may flatten a
        mapping used as a merge source before constructing it, so the check cannot wait until then)."""
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=False)
                try:
                    repeated = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: SafeLoader's construct_mapping refuses it with its position
                    break
                if repeated:
                    raise ConstructorError("while constructing a mapping", node.start_mark,
                                           f"found duplicate key {reprlib.repr(key)}", key_node.start_mark)
        super().flatten_mapping(node)


def read_yaml(path: Path) -> Any:
    """The document in `path`; raises OSError when it cannot be read, yaml.YAMLError when it is not YAML or repeats a
    key in a mapping (the message has the key and its line), ValueError for an integer of more digits than Python
    converts."""
    return yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)  # _UniqueKeyLoader is a SafeLoader


def shown(value: Any, limit: int = 40) -> str:
    """A refused setting's value as an error quotes it, cut short: a string may be of any length, and YAML aliases
    make a few bytes of file a structure of billions of items, which repr would expand."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"
    cut = reprlib.Repr()
    cut.maxlevel, cut.maxlist, cut.maxdict, cut.maxstring, cut.maxother, cut.maxlong = 1, 4, 4, limit, limit, limit
    return cut.repr(value)
