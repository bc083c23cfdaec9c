"""What the project's command-line tools share."""

from __future__ import annotations

import argparse
import signal
import threading


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Each option's default in its --help line (as vLLM's and trtllm-serve's help show them), unless its help already
    says it or it has none to say."""
    for action in parser._actions:
        default = action.default
        if (action.option_strings and default not in (None, False, argparse.SUPPRESS, "")
                and "default" not in (action.help or "") and not isinstance(action, argparse._HelpAction)):
            action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def interrupt_on_sigterm() -> None:
    """SIGTERM (kill, docker stop, a scheduler's time limit) raises KeyboardInterrupt in the main thread, so a tool
    cleans up as it does on Ctrl-C."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
