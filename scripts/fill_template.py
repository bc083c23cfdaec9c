#!/usr/bin/env python3
"""Fill `${key}` placeholders of a Triton config.pbtxt template, like TensorRT-LLM's
tools/fill_template.py, so the same deployment scripts work on our model repository.

    python scripts/fill_template.py -i triton_repo/tensorrt_llm/config.pbtxt \
        "engine_dir:/engines/x,triton_max_batch_size:64,decoupled_mode:true"

Values containing ',' or ':' escape them with '\\'. Placeholders not named are left as they
are (string.Template.safe_substitute), so a template can be filled in several passes; a key the
file does not contain is an error (a typo would otherwise be silently ignored).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from string import Template

# Upstream fills these two when not given, so dynamic_batching blocks stay valid.
DEFAULTS = {"max_queue_size": "0", "max_queue_delay_microseconds": "0"}


def split_escaped(text: str, delimiter: str, maxsplit: int = -1, unescape: bool = True) -> list[str]:
    """Split on `delimiter` at most `maxsplit` times (-1: no limit); `\\x` is a literal x (kept
    escaped in the parts with unescape=False, for a second split)."""
    parts: list[str] = []
    current: list[str] = []
    escape = False
    for ch in text:
        if escape:
            current.append(ch if unescape else "\\" + ch)
            escape = False
        elif ch == "\\":
            escape = True
        elif ch == delimiter and maxsplit != len(parts):
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def parse_substitutions(text: str) -> dict[str, str]:
    """"k1:v1,k2:v2" -> {k1: v1, k2: v2}; a value may hold further ':' (URLs); "" gives {}."""
    subs: dict[str, str] = {}
    for item in split_escaped(text, ",", unescape=False):
        if not item.strip():
            continue
        parts = split_escaped(item, ":", maxsplit=1)
        if len(parts) != 2 or not parts[0].strip():
            raise ValueError(f"substitution {item!r}: expected key:value")
        subs[parts[0].strip()] = parts[1]
    return subs


def fill(template_text: str, substitutions: dict[str, str], source: str = "template") -> str:
    """Return the template with `substitutions` (plus DEFAULTS) applied."""
    tmpl = Template(template_text)
    names = {m.group("named") or m.group("braced") for m in tmpl.pattern.finditer(template_text)} - {None}
    missing = sorted(set(substitutions) - names)
    if missing:
        raise KeyError(f"{source}: no placeholder ${{{missing[0]}}} (keys not found: {', '.join(missing)})")
    return tmpl.safe_substitute({**DEFAULTS, **substitutions})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file_path", type=Path, help="config.pbtxt template")
    parser.add_argument("substitutions", help="key:value,key:value,...")
    parser.add_argument("-i", "--in_place", action="store_true", help="rewrite the file instead of printing")
    args = parser.parse_args(argv)
    try:
        text = fill(args.file_path.read_text(), parse_substitutions(args.substitutions), str(args.file_path))
    except (KeyError, ValueError, OSError) as e:
        print(f"fill_template: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    if args.in_place:
        args.file_path.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
