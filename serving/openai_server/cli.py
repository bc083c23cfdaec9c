"""dsv3-serve MODEL_OR_ENGINE: the OpenAI-compatible server (loopback by default).

  dsv3-serve models/deepseek-v3-mini                     # http://127.0.0.1:8000/v1
  dsv3-serve engines/deepseek-v3-mini --num_draft_tokens 3 --port 8080

MODEL_OR_ENGINE is a checkpoint directory or an engine built by build_engine (one built with
--backend trtllm runs on TensorRT-LLM). Stops on Ctrl-C / SIGTERM after the requests in flight.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
from pathlib import Path

import uvicorn

from runtime.core.draft_policy import SPECULATION_MODES
from runtime.executors.base import ExecutorConfig, ExecutorProtocol
from runtime.executors.lifetime import MAX_TORCH_THREADS, stop_signals_to
from runtime.executors.process import EngineProcessError, open_server_executor
from runtime.executors.ranks import RankFailure
from runtime.executors.trtllm_api import TensorRTLLMUnavailable
from runtime.cli import interrupt_on_sigterm, show_defaults
from serving.openai_server.app import api_key_problem, create_app
from serving.openai_server.chat import ChatTemplateFault, check_template
from serving.watchdog import STALL_TIMEOUT_S, Watchdog, stop_server
from serving.openai_server.tool_calls import TOOL_CALL_PARSERS

log = logging.getLogger("serving.openai_server")

EXECUTOR_STOP_S = 5.0  # how long a failed executor's step under way gets to end before its ranks are signalled


class Server(uvicorn.Server):
    """Stops on SIGINT / SIGTERM without re-raising them afterwards (uvicorn does, to exit by the signal, which
    would end the process before the executor is shut down): a graceful stop exits 0."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return stop_signals_to(self.handle_exit)


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {port}")
    return port


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dsv3-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="checkpoint or engine directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--api_key", default=os.environ.get("DSV3_API_KEY"),
                   help="require `Authorization: Bearer API_KEY` on /v1, /tokenize and /detokenize (default: "
                        "$DSV3_API_KEY, which keeps the key off the process list; neither: no key)")
    p.add_argument("--served_model_name", help="the model's name in the API (default: the directory's name)")
    p.add_argument("--chat_template", type=Path,
                   help="a Jinja chat template file to render chat messages with, instead of the checkpoint's "
                        "(vLLM's --chat-template; e.g. one that renders tools)")
    p.add_argument("--tool_call_parser", choices=sorted(TOOL_CALL_PARSERS),
                   help="read tool calls in chat output in this format (vLLM's --tool-call-parser names: DeepSeek-V3's "
                        "or V3.1's); without it, requests with tools are refused unless tool_choice is \"none\"")
    p.add_argument("--num_draft_tokens", type=int, help="MTP draft length (default: 3 where the model has an "
                   "MTP layer, at most the engine's max_draft_len; 0: plain decoding)")
    p.add_argument("--speculation", choices=[m for m in SPECULATION_MODES if m != "off"],  # off: --num_draft_tokens 0
                   default=ExecutorConfig.speculation,
                   help="fixed: num_draft_tokens every step; adaptive (the default): up to that many, by batch size and "
                        "acceptance")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--dtype", help="compute dtype (default: the engine's choice for the device)")
    p.add_argument("--max_batch_size", type=int)
    p.add_argument("--max_seq_len", type=int)
    p.add_argument("--kv_cache_tokens", type=int)
    p.add_argument("--free_memory_fraction", type=float, default=ExecutorConfig.free_memory_fraction,
                   help="share of the memory free after loading that the KV cache may take")
    p.add_argument("--max_queued_requests", type=int,
                   help="requests allowed to wait for a batch slot; more are refused with 503 for the client to "
                        "retry (default: no bound)")
    p.add_argument("--torch_threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--engine_process", action=argparse.BooleanOptionalAction,
                   help="run the executor in a process of its own, so the server's request handling never holds "
                        "the GIL its step loop needs (default: on for CUDA devices, off on CPU, where the second "
                        "process takes cores from the forward)")
    p.add_argument("--log_level", default="info", choices=("debug", "info", "warning", "error"))
    return show_defaults(p).parse_args(argv)


def address_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (None: it can now), as uvicorn binds it (SO_REUSEADDR)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:  # socket.gaierror too
        return f"cannot listen there: {e.strerror or e}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.api_key is not None and (problem := api_key_problem(args.api_key)):
        print(f"dsv3-serve: {problem}", file=sys.stderr)
        return 2
    if args.torch_threads is not None and not 1 <= args.torch_threads <= MAX_TORCH_THREADS:
        print(f"dsv3-serve: --torch_threads must be in [1, {MAX_TORCH_THREADS}], got {args.torch_threads}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level == "info":  # one line per request: the server's, not also the executor's
        logging.getLogger("runtime.executors.requests").setLevel(logging.WARNING)
    try:
        config = ExecutorConfig(
            num_draft_tokens=args.num_draft_tokens,
            speculation=args.speculation, device=args.device,
            dtype=args.dtype, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
            kv_cache_tokens=args.kv_cache_tokens, free_memory_fraction=args.free_memory_fraction,
            max_queued_requests=args.max_queued_requests)
    except ValueError as e:
        print(f"dsv3-serve: {e}", file=sys.stderr)
        return 2
    chat_template = None
    if args.chat_template is not None:  # before the model loads
        try:
            chat_template = args.chat_template.read_text(encoding="utf-8")
            check_template(chat_template)
        except (OSError, UnicodeDecodeError, ChatTemplateFault) as e:
            print(f"dsv3-serve: --chat_template {args.chat_template}: {e}", file=sys.stderr)
            return 2
    if problem := address_problem(args.host, args.port):  # before the model loads (seconds to minutes), not after
        print(f"dsv3-serve: --host {args.host} --port {args.port}: {problem}", file=sys.stderr)
        return 2
    interrupt_on_sigterm()  # until the server takes the signals over: loading takes seconds to minutes
    try:
        executor = open_server_executor(args.model, config, args.engine_process, args.torch_threads)
    except (ValueError, FileNotFoundError, EngineProcessError, TensorRTLLMUnavailable, RankFailure) as e:
        print(f"dsv3-serve: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dsv3-serve: interrupted while loading the model", file=sys.stderr)
        return 130
    name = args.served_model_name or args.model.resolve().name
    try:
        log.info("serving %s as %r at http://%s:%d/v1%s", args.model, name, args.host, args.port,
                 " (API key required)" if args.api_key else "")
        app = create_app(executor, name, args.api_key, args.tool_call_parser, chat_template)
        # an executor that stopped serving (a rank died, its step loop stalled) takes the server down, as vLLM's
        # engine does: a supervisor restarts it, where a server answering 503 for ever would not be
        watchdog = Watchdog({"engine": lambda: executor.health(STALL_TIMEOUT_S)},
                            lambda reason: stop_after_executor(executor, reason))
        try:
            # h11 parses HTTP: it bounds a request's head (h11_max_incomplete_event_size), where httptools let a
            # header line that never ended grow without bound, burning the event loop's CPU; the app logs each
            # request itself
            Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, http="h11",
                                  access_log=False)).run()
        finally:
            watchdog.stop()
    finally:
        executor.shutdown()
    if watchdog.failure is not None:
        print(f"dsv3-serve: stopped: {watchdog.failure}", file=sys.stderr)
        return 1
    return 0


def stop_after_executor(executor: ExecutorProtocol, reason: str) -> None:
    """The watchdog's failure: stop the executor first, which ends the requests in flight (their clients get an
    answer, so the server's graceful stop does not wait on them) and its ranks (a stalled rank is killed, not left
    behind), then the server."""
    try:
        executor.shutdown(timeout=EXECUTOR_STOP_S)
    finally:  # whatever the executor does, the server stops
        stop_server(os.getpid(), reason)


if __name__ == "__main__":
    sys.exit(main())
