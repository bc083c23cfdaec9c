"""What the project's command-line tools share."""

from __future__ import annotations

import argparse


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Each option's default in its --help line (as vLLM's and trtllm-serve's help show them), unless its help already
    says it or it has none to say."""
    for action in parser._actions:
        default = action.default
        if (action.option_strings and default not in (None, False, argparse.SUPPRESS, "")
                and "default" not in (action.help or "") and not isinstance(action, argparse._HelpAction)):
            action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"
    return parser
