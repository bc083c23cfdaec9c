"""Serving through the real tritonserver (nvidia-pytriton's binary) on loopback ports.

One server per module on a tiny random DeepSeek-V3 + MTP checkpoint; clients are tritonclient
over HTTP (generate, generate_stream SSE) and gRPC streaming, plus raw sockets for a client
that disconnects. Greedy outputs are compared with an in-process runtime.Session on the same
checkpoint. The tiny tokenizer splits CJK and emoji across tokens and random weights emit such
pieces, so streamed chunks are checked to be whole UTF-8 that adds up to the full text.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from runtime.core.sampling_params import SamplingParams  # noqa: E402
from runtime.executors.session import Session  # noqa: E402
from runtime.io.engine_format import read_limits  # noqa: E402
from runtime.executors.lifetime import PID_NAMESPACE, free_ports, live_descendants  # noqa: E402
from serving.triton.engine_limits import server_dir  # noqa: E402
from serving.triton.fill_template import fill, parse_substitutions  # noqa: E402
from serving.triton.launcher import (PYTHON_SHM_REGION_BYTES, SHM_DIR, build_command, find_install,  # noqa: E402
                                     named_crash_frames, python_stubs, remove_stale_leftovers)
from triton_util import (EOS, PROMPTS, TEMPLATE_REPO, TOKENS, TritonServer, add_model,  # noqa: E402
                         assert_no_stub_crash, fill_model_repo, repo_values, start_server)

MAX_SEQ_LEN = 1024  # the tiny checkpoint's max_position_embeddings (make_tiny_checkpoint)
PERF_METRICS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "kv_cache_alloc_new_blocks",
                "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns",
                "first_token_time_ns", "last_token_time_ns")
ADMIN_KEY = "test-admin-key"  # the module's server serves its admin APIs only to requests with this header
DTYPES = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32",
          np.dtype(bool): "BOOL", np.dtype(np.uint64): "UINT64"}


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    work = tmp_path_factory.mktemp("triton_server")
    repo = fill_model_repo(work / "repo", repo_values(checkpoint))
    # the BLS also works as a plain (non-decoupled) model, for clients of unary ModelInfer
    add_model(repo, TEMPLATE_REPO / "tensorrt_llm_bls", repo_values(checkpoint, decoupled_mode="false"),
              name="tensorrt_llm_bls_sync")
    add_model(repo, TEMPLATE_REPO / "tensorrt_llm_bls", repo_values(checkpoint, accumulate_tokens="true"),
              name="tensorrt_llm_bls_accumulate")
    # filled as upstream's commands fill it: no tokenizer settings of its own
    add_model(repo, TEMPLATE_REPO / "tensorrt_llm_bls", {k: v for k, v in repo_values(checkpoint).items()
                                                         if k not in ("tokenizer_dir", "max_input_tokens", "vocab_size")},
              name="tensorrt_llm_bls_upstream")
    t0 = time.monotonic()
    srv = start_server(repo, log_file=work / "server.log", ready_timeout_s=240, exit_timeout_s=3,
                       admin_api_key=ADMIN_KEY)
    print(f"tritonserver ready in {time.monotonic() - t0:.1f} s; log {work / 'server.log'}")
    try:
        yield srv
    finally:
        srv.stop()
    assert_no_stub_crash(srv)


# ---- clients ----------------------------------------------------------------------------------
def input_arrays(**values: Any) -> dict[str, np.ndarray]:
    """Numpy-able values as Triton input arrays, each with a leading batch dim of 1."""
    arrays = {}
    for name, value in values.items():
        arr = np.asarray(value)
        if arr.dtype.kind in "US":
            arr = np.vectorize(lambda s: s.encode() if isinstance(s, str) else s, otypes=[object])(arr)
        arr = arr.reshape(1, -1) if arr.ndim < 2 else arr
        arrays[name] = arr.astype({"i": np.int32, "f": np.float32}.get(arr.dtype.kind, arr.dtype))
    return arrays


def grpc_inputs(**values: Any) -> list:
    """tritonclient gRPC inputs from numpy-able values (input_arrays)."""
    inputs = []
    for name, arr in input_arrays(**values).items():
        i = grpcclient.InferInput(name, list(arr.shape), DTYPES[arr.dtype])
        i.set_data_from_numpy(arr)
        inputs.append(i)
    return inputs


@dataclass
class Streamed:
    chunks: list[bytes] = field(default_factory=list)  # text_output per response (raw bytes)
    ids: list[int] = field(default_factory=list)  # output_ids, for tensorrt_llm
    stats: dict[str, float] = field(default_factory=dict)  # last response's perf metrics and token counts
    error: str | None = None
    status: str | None = None  # the error's gRPC status
    finish_reason: str | None = None  # the last response's, where the request asked for it
    times: list[float] = field(default_factory=list)  # arrival time of each response

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8")


def grpc_stream(server: TritonServer, model: str, request_id: str = "", timeout: float = 60,
                on_first: Any = None, **values: Any) -> Streamed:
    """Run one request over gRPC streaming. `on_first(client)` runs after the first response with
    data; if it returns True, reading stops there."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error, time.monotonic())))
    out = Streamed()
    try:
        client.async_stream_infer(model, grpc_inputs(**values), request_id=request_id,
                                  enable_empty_final_response=True)
        while True:
            result, error, at = responses.get(timeout=timeout)
            if error is not None:
                out.error = error.message()
                return out
            text, ids = result.as_numpy("text_output"), result.as_numpy("output_ids")
            if text is not None or ids is not None:
                out.times.append(at)
                out.chunks += [] if text is None else list(text.reshape(-1))
                out.ids += [] if ids is None else ids.reshape(-1).tolist()
            for k in (*PERF_METRICS, "num_input_tokens", "num_output_tokens"):
                if result.as_numpy(k) is not None:
                    out.stats[k] = result.as_numpy(k).item()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out
            if on_first is not None and len(out.times) == 1 and on_first(client):
                return out
    finally:
        client.stop_stream()
        client.close()


def http_generate(server: TritonServer, model: str, endpoint: str = "generate", **body: Any) -> tuple[int, Any]:
    """POST to the generate extension; returns (status, parsed JSON) or, for generate_stream,
    (status, [raw bytes of each SSE event's JSON])."""
    data = json.dumps(body, default=lambda v: v.item()).encode()  # numpy scalars as JSON numbers
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/{endpoint}", data,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    if endpoint == "generate" or not raw.startswith(b"data: "):  # the stream's refusal before it starts is JSON
        return status, json.loads(raw) if endpoint == "generate" or status != 200 else []
    return status, [line[len(b"data: "):] for line in raw.split(b"\n") if line.startswith(b"data: ")]


def metrics(server: TritonServer) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def settled_metrics(server: TritonServer, family: str) -> dict[str, float]:
    """The samples of a metric family once two reads 0.2 s apart agree: a request is counted just after its final
    response is sent."""
    def read() -> dict[str, float]:
        return {k: v for k, v in metrics(server).items() if k.startswith(family)}

    values = read()
    for _ in range(50):
        time.sleep(0.2)
        values, previous = read(), values
        if values == previous:
            return values
    raise AssertionError(f"{family} kept changing")


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, v in values.items():
        if key.split("{")[0] == name and all(f'{k}="{val}"' in key for k, val in labels.items()):
            total += v
    return total


def wait_for(condition: Any, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def assert_healthy(server: TritonServer) -> None:
    """Ready, and a normal request still works."""
    assert server.is_ready()
    out = grpc_stream(server, "ensemble", text_input="hello", max_tokens=4)
    assert out.error is None and out.chunks


# ---- fill_template and launcher (no server) ----------------------------------------------------
def test_fill_template_escapes_and_leaves_other_placeholders(tmp_path: Path) -> None:
    subs = parse_substitutions(r"engine_dir:/e/x,stop:a\,b,url:http://h:1/p,colon:\:z")
    assert subs == {"engine_dir": "/e/x", "stop": "a,b", "url": "http://h:1/p", "colon": ":z"}
    text = fill('p: "${engine_dir}" q: "${other}" s: ${stop} d: ${max_queue_size}', {"engine_dir": "/e", "stop": "a,b"})
    assert text == 'p: "/e" q: "${other}" s: a,b d: 0'
    config = tmp_path / "config.pbtxt"
    config.write_text("x: ${a}\n")
    script = Path(sys.executable).with_name("fill_template")
    subprocess.run([script, "-i", config, "a:1\\,2"], check=True)
    assert config.read_text() == "x: 1,2\n"
    bad = subprocess.run([script, config, "typo:1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "typo" in bad.stderr
    # upstream's documented commands pass keys our templates do not have: accepted, reported
    config.write_text("x: ${a}\n")
    upstream = subprocess.run([script, "-i", config, "a:2,batching_strategy:inflight_fused_batching,"
                               "logits_datatype:TYPE_FP32,max_queue_size:0"], capture_output=True, text=True)
    assert upstream.returncode == 0, upstream.stderr
    assert config.read_text() == "x: 2\n"
    assert upstream.stderr == (f"fill_template: {config}: ignored (not used by this repository): batching_strategy, "
                               "logits_datatype, max_queue_size\n")
    # -i on a link fills the file it points to, as upstream's (it replaced the link with a file of its own)
    config.write_text("x: ${a}\n")
    link = tmp_path / "link.pbtxt"
    link.symlink_to(config)
    subprocess.run([script, "-i", link, "a:3"], check=True)
    assert link.is_symlink() and config.read_text() == "x: 3\n"


def test_fill_template_fills_non_decoupled_models(tmp_path: Path) -> None:
    """tensorrt_llm and the BLS may be non-decoupled (upstream's decoupled_mode:false, for unary ModelInfer
    clients); upstream's tokenizer_type / num_nodes are accepted and noted."""
    script = Path(sys.executable).with_name("fill_template")
    config = tmp_path / "config.pbtxt"
    config.write_text((TEMPLATE_REPO / "tensorrt_llm" / "config.pbtxt").read_text())
    ok = subprocess.run([script, "-i", config, "decoupled_mode:False,triton_max_batch_size:8"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "decoupled: False" in config.read_text(), ok.stderr
    config.write_text((TEMPLATE_REPO / "tensorrt_llm_bls" / "config.pbtxt").read_text())
    ok = subprocess.run([script, "-i", config, "decoupled_mode:False,tokenizer_dir:/t,"
                         "tokenizer_type:auto,num_nodes:1"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "decoupled: False" in config.read_text() and 'string_value: "/t"' in config.read_text()
    assert ok.stderr == f"fill_template: {config}: ignored (not used by this repository): num_nodes, tokenizer_type\n"


def test_fill_template_in_place_is_atomic_and_names_a_non_utf8_file(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("fill_template")
    config = tmp_path / "config.pbtxt"
    config.write_text("x: ${a}\n")
    config.chmod(0o640)
    inode = config.stat().st_ino
    subprocess.run([script, "-i", config, "a:1"], check=True)
    assert config.read_text() == "x: 1\n"
    assert config.stat().st_ino != inode  # replaced by a new file, not rewritten in place
    assert oct(config.stat().st_mode & 0o777) == oct(0o640)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.pbtxt"]  # no temporary file left
    config.write_bytes(b"x: ${a}\n\xff\n")
    bad = subprocess.run([script, "-i", config, "a:1"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr == f"fill_template: {config}: not UTF-8 text (byte 8: invalid start byte)\n"


def test_every_template_placeholder_is_filled_by_the_test_values(tmp_path: Path, shipped_model_dir: Path) -> None:
    repo = fill_model_repo(tmp_path / "repo", repo_values(shipped_model_dir))
    left = {p for c in repo.glob("*/config.pbtxt") for p in re.findall(r"\$\{(\w+)\}", c.read_text())}
    # these stay as placeholders on purpose: their models read an unfilled one as "use the default"
    assert left <= {"add_special_tokens", "skip_special_tokens", "max_tokens_in_paged_kv_cache", "num_draft_tokens",
                    "kv_cache_free_gpu_mem_fraction", "watchdog_timeout_s", "enable_kv_cache_reuse",
                    "executor_max_batch_size", "executor_max_seq_len", "device", "torch_threads", "engine_process",
                    "exclude_input_in_output", "accumulate_tokens"}


LAUNCHER_ERRORS = {
    "port_zero": (["--http_port", "0"], "--http_port 0: a port must be in 1..65535"),
    "port_too_large": (["--metrics_port", "65536"], "--metrics_port 65536: a port must be in 1..65535"),
    "duplicate_ports": (["--http_port", "9000", "--grpc_port", "9000"],
                        "--grpc_port 9000 is also the --http_port; the three ports must differ"),
    "negative_ready_timeout": (["--ready_timeout", "-1"], "--ready_timeout -1.0: must be >= 0 seconds"),
    "negative_exit_timeout": (["--exit_timeout", "-5"], "--exit_timeout -5: must be >= 0 seconds"),
    "world_size_zero": (["--world_size", "0"], "--world_size 0: must be an integer >= 1"),
    "log_file_is_a_directory": (["--log_file", "{tmp}"], "--log_file {tmp}: is a directory; give a file path"),
    "log_file_not_writable": (["--log_file", "{tmp}/no/such/dir/server.log"],
                              "--log_file {tmp}/no/such/dir/server.log: cannot write to it (No such file or directory)"),
}


@pytest.mark.parametrize("case", list(LAUNCHER_ERRORS), ids=list(LAUNCHER_ERRORS))
def test_launcher_refuses_bad_arguments(tmp_path: Path, case: str) -> None:
    args, message = LAUNCHER_ERRORS[case]
    cmd = [Path(sys.executable).with_name("launch_triton_server"), "--model_repo", tmp_path,
           *(a.format(tmp=tmp_path) for a in args)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stderr) == (2, f"launch_triton_server: {message.format(tmp=tmp_path)}\n")


ECHO_MODEL = '''
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
'''
ECHO_CONFIG = '''name: "echo"
backend: "python"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''


def launch_echo_server(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """The launcher CLI serving the echo model; returns the process once ready, and the HTTP port."""
    (tmp_path / "repo" / "echo" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (tmp_path / "repo" / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    http, grpc, metrics_port = free_ports(3)
    proc = subprocess.Popen([Path(sys.executable).with_name("launch_triton_server"), "--model_repo",
                             tmp_path / "repo", "--http_port", str(http), "--grpc_port", str(grpc),
                             "--metrics_port", str(metrics_port), "--log_file", tmp_path / "server.log"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "ready" not in line:
        proc.kill()
        raise AssertionError(proc.communicate()[1] or line)
    return proc, http


def test_launcher_stops_the_server_when_a_stub_dies(tmp_path: Path) -> None:
    """Triton 2.51 does not restart a Python backend stub that died (a crash, the OOM killer): its model failed
    every request while /v2/health/ready said 200. The launcher notices, says which, and stops the server with
    status 1 so that a supervisor restarts it."""
    proc, _ = launch_echo_server(tmp_path)
    try:
        stubs = python_stubs(proc.pid)
        assert list(stubs.values()) == ["echo_0_0"], stubs
        os.kill(next(iter(stubs)), signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        stub_pid = next(iter(stubs))
        assert (f"launch_triton_server: the Python backend stub of echo_0_0 (pid {stub_pid}) died; Triton does not "
                "restart it, so its model would fail every request: stopping tritonserver") in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


WATCHED_MODEL = ECHO_MODEL.replace("class TritonPythonModel:", """import os, threading, time
from serving.watchdog import stop_server
class TritonPythonModel:
    def finalize(self):
        time.sleep(5)  # as an engine's executor and ranks stop
""").replace("    def execute(self, requests):\n", """    def execute(self, requests):
        threading.Thread(target=stop_server, args=(os.getppid(), "watched: executor: rank 1 exited"), daemon=True).start()
""")


def test_launcher_names_the_model_whose_watchdog_stopped_the_server(tmp_path: Path) -> None:
    """A model's watchdog (the engine's, when one of its ranks died) stops tritonserver; the other models' stubs exit
    while it unloads, and the launcher, 2 s after seeing them gone, blamed them ("the Python backend stub of echo_0_0
    (pid ...) died"). It names the watchdog's reason, and exits 1."""
    (tmp_path / "repo" / "watched" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "watched" / "config.pbtxt").write_text(ECHO_CONFIG.replace('"echo"', '"watched"'))
    (tmp_path / "repo" / "watched" / "1" / "model.py").write_text(WATCHED_MODEL)
    proc, http = launch_echo_server(tmp_path)
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/watched/generate",
                                                           json.dumps({"IN": "hi"}).encode()), timeout=10) as r:
            assert json.loads(r.read())["OUT"] == "hi"
        assert proc.wait(timeout=60) == 1
        errors = proc.stderr.read()
        assert ("launch_triton_server: a model's watchdog stopped tritonserver (exit status 0): watched: executor: "
                "rank 1 exited\n") in errors, errors
        assert "stub" not in errors, errors
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_launcher_waits_for_a_server_a_signal_asked_to_stop(tmp_path: Path) -> None:
    """A SIGTERM sent to tritonserver itself (not through the launcher) whose models take more than 2 s to unload: the
    echo model's stub exited first, and the launcher blamed it ("the Python backend stub of echo_0_0 (pid ...) died")
    and exited 1. Its endpoints closed, the server is stopping as asked: the launcher waits for it and exits with its
    status."""
    (tmp_path / "repo" / "slow" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "slow" / "config.pbtxt").write_text(ECHO_CONFIG.replace('"echo"', '"slow"'))
    (tmp_path / "repo" / "slow" / "1" / "model.py").write_text(ECHO_MODEL.replace("class TritonPythonModel:", """import time
class TritonPythonModel:
    def finalize(self):
        time.sleep(6)  # as an engine's executor and ranks stop
"""))
    proc, _ = launch_echo_server(tmp_path)
    try:
        stubs = python_stubs(proc.pid)
        [server_pid] = [p for p in live_descendants(proc.pid) if p not in stubs]
        os.kill(server_pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert proc.stderr.read() == ("launch_triton_server: tritonserver is stopping (its endpoints closed, as on a "
                                      "SIGTERM or SIGINT sent to it); waiting for it to unload its models\n"
                                      "tritonserver exited with status 0\n")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_server_slow_to_take_a_connection_is_not_taken_for_stopping() -> None:
    """With a stub dead, the launcher judges the server stopping on a signal sent to it when its HTTP port is closed: a
    connect that timed out (a busy server, its backlog full) counted as closed, and the launcher said "tritonserver is
    stopping (its endpoints closed, as on a SIGTERM or SIGINT sent to it)" though no signal was sent and waited. Only a
    refused connection counts."""
    import serving.triton.launcher as launcher

    with socket.socket() as busy, contextlib.ExitStack() as queued:
        busy.bind(("127.0.0.1", 0))
        busy.listen(0)  # never accepted: its backlog fills at once
        server = launcher.TritonServer(None, "127.0.0.1", busy.getsockname()[1], 0, 0, None, Path(), "")
        for _ in range(16):
            try:
                queued.enter_context(socket.create_connection(("127.0.0.1", server.http_port), timeout=0.2))
            except TimeoutError:  # full: the next connect is not taken either
                break
        else:
            pytest.fail("the backlog did not fill")
        assert not server.endpoints_closed()
    assert server.endpoints_closed()  # the port closed: refused


def test_launcher_refuses_a_repository_without_models(tmp_path: Path, shipped_model_dir: Path) -> None:
    """Given the engine directory by mistake, or an empty one, tritonserver served nothing and said it was ready (a
    load balancer would send it traffic): refused, naming the flag."""
    from serving.triton.launcher import start_server

    with pytest.raises(FileNotFoundError, match=re.escape(f"--model_repo {shipped_model_dir}: no model in it (no "
                                                          "<model>/config.pbtxt); make one with make_model_repo")):
        start_server(shipped_model_dir)
    (tmp_path / "engine.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="make one with make_model_repo from this engine$"):
        start_server(tmp_path)


def test_launcher_kills_a_server_stuck_after_its_watchdog_stopped_it(monkeypatch, capsys) -> None:
    """The watchdog's SIGKILL escalation lives in a stub, which exits as the server shuts down: a tritonserver stuck in
    its own shutdown was waited on for ever. The launcher stops it KILL_AFTER_S after the watchdog did."""
    import serving.triton.launcher as launcher

    class Stuck:
        def __init__(self) -> None:
            self.process = types.SimpleNamespace(poll=lambda: None, returncode=None)
            self.stopped = False

        def make_regions_private(self) -> None:
            pass

        def stop_reason(self) -> str:
            return "engine: executor: rank 1 exited"

        def dead_stubs(self) -> dict:
            return {}

        def stop(self, *args) -> None:
            self.stopped = True

    monkeypatch.setattr(launcher, "SUPERVISE_PERIOD_S", 0.01)
    monkeypatch.setattr(launcher, "KILL_AFTER_S", 0.2)
    server = Stuck()
    assert launcher.supervise(server) == 1 and server.stopped
    assert capsys.readouterr().err == ("launch_triton_server: a model's watchdog stopped tritonserver (still running 0.2 s "
                                       "later: killed): engine: executor: rank 1 exited\n")


def test_leftovers_of_a_killed_launcher_are_removed_by_the_next(tmp_path: Path) -> None:
    """A launcher killed before its stop() leaves its Python backend regions in /dev/shm (memory) and its work
    directory; the next launcher removes them, since their launcher pid has no process, and keeps a live one's and
    those of another pid namespace (a container sharing /dev/shm), whose pids say nothing here."""
    proc, _ = launch_echo_server(tmp_path)
    stubs = python_stubs(proc.pid)
    server_pid = next(p for p in live_descendants(proc.pid) if p not in stubs)
    proc.kill()
    proc.wait()
    for pid in [*stubs, server_pid]:  # the server goes with its launcher; its stubs may linger
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    regions = sorted(SHM_DIR.glob(f"dsv3_{PID_NAMESPACE}_{proc.pid}_*"))
    workdirs = sorted(Path(tempfile.gettempdir()).glob(f"dsv3-triton-{PID_NAMESPACE}-{proc.pid}-*"))
    assert regions and workdirs, "the killed launcher left nothing behind: the test proves nothing"
    kept = [SHM_DIR / f"dsv3_{PID_NAMESPACE}_{os.getpid()}_999_test-region",  # this live process's
            SHM_DIR / f"dsv3_{PID_NAMESPACE + 1}_{proc.pid}_999_test-region"]  # a dead pid, of another namespace
    for path in kept:
        path.write_bytes(b"x")
    try:
        removed = remove_stale_leftovers()
        assert set(regions + workdirs) <= set(removed)
        assert not any(p.exists() for p in regions + workdirs)
        assert all(p.exists() and p not in removed for p in kept)
    finally:
        for path in kept:
            path.unlink(missing_ok=True)


# From a soak's server log (Triton 2.51 from the wheel, 2026-11-26): a SIGSEGV in the gRPC stream frontend's response
# callback, and the backtrace Triton's handler logged (paths shortened).
CRASH_LOG = """W1126 16:00:26.840618 3418 pinned_memory_manager.cc:170] "failed to allocate pinned system memory"
Signal (11) received.
 0# 0x000055B8D832952D in /venv/pytriton/tritonserver/bin/tritonserver
 1# 0x00007FCFEFE5A050 in /lib/x86_64-linux-gnu/libc.so.6
 2# 0x000055B8D839A7B9 in /venv/pytriton/tritonserver/bin/tritonserver
 3# 0x00007FCFF0848390 in /venv/nvidia_pytriton.libs/libtritonserver-717102f0.so
 4# TRITONBACKEND_ResponseSend in /venv/nvidia_pytriton.libs/libtritonserver-717102f0.so

I1126 16:02:31.436862 3579 pb_stub.cc:2145]  Non-graceful termination detected.
"""


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_crash_backtraces_name_tritonservers_own_frames() -> None:
    """Triton logs a crash's frames in its own binary as bare addresses; the wheel's tritonserver keeps its symbols,
    so the launcher (and the soak's report) name them: here the frontend callback the server crashed in."""
    frames = named_crash_frames(CRASH_LOG, find_install().tritonserver)
    assert frames == [
        "0# triton::server::(anonymous namespace)::ErrorSignalHandler(int)+0xbd",
        "1# 0x00007FCFEFE5A050 in /lib/x86_64-linux-gnu/libc.so.6",
        "2# triton::server::grpc::ModelStreamInferHandler::StreamInferResponseComplete(TRITONSERVER_InferenceResponse*, "
        "unsigned int, void*)+0x39",
        "3# 0x00007FCFF0848390 in /venv/nvidia_pytriton.libs/libtritonserver-717102f0.so",
        "4# TRITONBACKEND_ResponseSend in /venv/nvidia_pytriton.libs/libtritonserver-717102f0.so"]
    assert named_crash_frames("Signal (2) received.\nSignal (2) received.\n", find_install().tritonserver) == []


def test_launcher_cli_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc, http = launch_echo_server(tmp_path)
    try:
        body = json.dumps({"IN": "hi"}).encode()
        with urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{http}/v2/models/echo/generate", body), timeout=10) as r:
            assert json.loads(r.read())["OUT"] == "hi"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", http), timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the server ------------------------------------------------------------------------------
def test_all_models_ready_on_loopback(server: TritonServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_server_ready()
    for model in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls",
                  "tensorrt_llm_bls_sync"):
        assert client.is_model_ready(model), model
    assert server.host == "127.0.0.1"
    assert client.get_model_config("tensorrt_llm").config.model_transaction_policy.decoupled


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_http_generate_matches_session(server: TritonServer, expected: dict, model: str) -> None:
    """The text, and with return_perf_metrics the request's MTP drafting stats (as upstream's perf metrics,
    left out of responses that do not ask for them)."""
    for prompt in PROMPTS[:4]:
        status, body = http_generate(server, model, text_input=prompt, max_tokens=TOKENS,
                                     exclude_input_in_output=True, return_perf_metrics=True)
        assert status == 200, body
        want = expected[prompt]
        assert body["text_output"] == want.text
        assert body["total_draft_tokens"] == want.stats.num_draft_tokens > 0
        assert body["total_accepted_draft_tokens"] == want.stats.num_accepted_draft_tokens
        assert body["acceptance_rate"] == pytest.approx(want.stats.acceptance_rate, abs=1e-6)
    status, body = http_generate(server, model, text_input=PROMPTS[0], max_tokens=TOKENS, exclude_input_in_output=True)
    assert status == 200 and body["text_output"] == expected[PROMPTS[0]].text
    assert not {"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"} & set(body), body


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls", "tensorrt_llm"])
def test_num_draft_tokens_caps_the_requests_mtp_drafts(server: TritonServer, session: Session, model: str) -> None:
    """num_draft_tokens (upstream's BLS input; the ensemble and tensorrt_llm declare it too) is the request's
    SamplingParams.num_draft_tokens (the server drafts 3): greedy, 0 and 2 give the same tokens, the session's, and
    the perf metrics count what the session's request with that cap drafted: nothing for 0, some for 2."""
    prompt = PROMPTS[4]
    ids = session.tokenizer.encode(prompt)
    got: dict[int, Streamed] = {}
    for k in (0, 2):
        if model == "tensorrt_llm":
            out = grpc_stream(server, model, input_ids=np.array([ids], np.int32),
                              input_lengths=np.array([[len(ids)]], np.int32),
                              request_output_len=np.array([[TOKENS]], np.int32), streaming=np.array([[True]]),
                              return_perf_metrics=True, num_draft_tokens=k)
        else:
            out = grpc_stream(server, model, text_input=prompt, max_tokens=TOKENS, stream=True,
                              return_perf_metrics=True, num_draft_tokens=k)
        assert out.error is None, out.error
        want = session.generate([prompt], SamplingParams(max_tokens=TOKENS, num_draft_tokens=k))[0]
        assert (out.ids if model == "tensorrt_llm" else out.text) == (want.token_ids if model == "tensorrt_llm"
                                                                      else want.text)
        assert out.stats["total_draft_tokens"] == want.stats.num_draft_tokens
        assert out.stats["total_accepted_draft_tokens"] == want.stats.num_accepted_draft_tokens
        got[k] = out
    assert (got[0].ids, got[0].text) == (got[2].ids, got[2].text)
    assert got[0].stats["total_draft_tokens"] == 0 < got[2].stats["total_draft_tokens"]
    if model == "tensorrt_llm_bls":  # the draft model's logits stay refused
        out = grpc_stream(server, model, text_input=prompt, max_tokens=4, num_draft_tokens=2, use_draft_logits=True)
        assert out.error == "use_draft_logits=True is not supported by this runtime (supported: false)", out.error


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_perf_metrics_and_token_counts_as_upstream(server: TritonServer, session: Session, model: str) -> None:
    """end_to_end_grpc_client.py --return-perf-metrics reads upstream's KV-cache and timing outputs from
    every response; times are perf_counter_ns (CLOCK_MONOTONIC, this process's clock too), so they fall
    between sending the request and receiving its last response."""
    prompt = PROMPTS[4]
    t0 = time.perf_counter_ns()
    out = grpc_stream(server, model, text_input=prompt, max_tokens=TOKENS, stream=True, end_id=-1,
                      return_perf_metrics=True, return_num_input_tokens=True, return_num_output_tokens=True)
    t1 = time.perf_counter_ns()
    assert out.error is None and set(out.stats) == {*PERF_METRICS, "num_input_tokens", "num_output_tokens"}
    s = out.stats
    assert t0 <= s["arrival_time_ns"] <= s["first_scheduled_time_ns"] <= s["first_token_time_ns"] \
        <= s["last_token_time_ns"] <= t1
    assert s["last_token_time_ns"] > s["first_token_time_ns"]  # streamed over several steps
    n_in = len(session.tokenizer.encode(prompt))
    assert (s["num_input_tokens"], s["num_output_tokens"]) == (n_in, TOKENS)
    # the 16-token blocks (a checkpoint's default) the request's tokens fill, those not reused new
    assert s["kv_cache_alloc_total_blocks"] == -(-(n_in + TOKENS) // 16)
    assert s["kv_cache_alloc_new_blocks"] == s["kv_cache_alloc_total_blocks"] - s["kv_cache_reused_blocks"]
    # a prompt of several blocks, sent twice: the second reuses its full blocks (the last token always computed)
    long = " ".join(PROMPTS[:8])
    first, again = (grpc_stream(server, model, text_input=long, max_tokens=TOKENS, end_id=-1, return_perf_metrics=True)
                    for _ in range(2))
    assert first.error is None and again.error is None
    assert again.stats["kv_cache_reused_blocks"] == (len(session.tokenizer.encode(long)) - 1) // 16 > 0
    # each asked for separately, and nothing without asking
    only = grpc_stream(server, model, text_input=prompt, max_tokens=4, return_num_output_tokens=True)
    assert only.error is None and only.stats == {"num_output_tokens": 4}
    plain = grpc_stream(server, model, text_input=prompt, max_tokens=4)
    assert plain.error is None and plain.stats == {}


def test_top_p_zero_means_not_set(server: TritonServer, expected: dict) -> None:
    """TensorRT-LLM's Triton model reads runtime_top_p <= 0 as unset; clients rely on that."""
    prompt = PROMPTS[2]
    status, body = http_generate(server, "ensemble", text_input=prompt, max_tokens=TOKENS, top_p=0.0,
                                 exclude_input_in_output=True)
    assert status == 200, body
    assert body["text_output"] == expected[prompt].text


def test_temperature_alone_decodes_greedily(server: TritonServer, expected: dict) -> None:
    """As TensorRT-LLM: top_k 0 or unset with top_p unset or <= 0 is greedy whatever the temperature
    (end_to_end_grpc_client.py sends temperature 1.0 by default and expects greedy text)."""
    prompt = PROMPTS[0]
    for _ in range(2):
        out = grpc_stream(server, "ensemble", text_input=prompt, max_tokens=TOKENS, temperature=1.0,
                          exclude_input_in_output=True)
        assert out.error is None and out.text == expected[prompt].text
    status, body = http_generate(server, "tensorrt_llm_bls", text_input=prompt, max_tokens=TOKENS, temperature=1.0,
                                 top_k=0, top_p=0.0, exclude_input_in_output=True)
    assert status == 200 and body["text_output"] == expected[prompt].text, body


@pytest.mark.parametrize("knob", [dict(top_p=0.9), dict(top_k=40), dict(top_k=40, temperature=1.0)],
                         ids=["top_p", "top_k", "top_k_and_temperature"])
def test_top_k_or_top_p_samples(server: TritonServer, expected: dict, knob: dict) -> None:
    """A top_k or top_p samples (at temperature 1.0 when none is given, upstream's default), seeded."""
    prompt = PROMPTS[0]
    texts = set()
    for model in ("ensemble", "tensorrt_llm_bls"):
        status, body = http_generate(server, model, text_input=prompt, max_tokens=TOKENS, seed=11,
                                     exclude_input_in_output=True, **knob)
        assert status == 200, body
        texts.add(body["text_output"])
    assert len(texts) == 1  # the same seed samples the same text
    assert texts.pop() != expected[prompt].text


def test_random_seed_is_the_seed(server: TritonServer) -> None:
    """Upstream's older name random_seed works over gRPC and HTTP generate (which drops unknown keys:
    an undeclared random_seed would sample unseeded)."""
    sampled = dict(text_input=PROMPTS[0], max_tokens=TOKENS, top_k=40, exclude_input_in_output=True)
    status, body = http_generate(server, "ensemble", seed=7, **sampled)
    assert status == 200, body
    want = body["text_output"]
    for model in ("ensemble", "tensorrt_llm_bls"):
        status, body = http_generate(server, model, random_seed=7, **sampled)
        assert status == 200 and body["text_output"] == want, (model, body)
        out = grpc_stream(server, model, random_seed=np.uint64(7), **sampled)
        assert out.error is None and out.text == want, (model, out.error)
    status, body = http_generate(server, "ensemble", random_seed=8, **sampled)
    assert status == 200 and body["text_output"] != want
    # every UINT64 seed is taken, modulo 2^63 (the runtime's seeds; it refused those past int64)
    for model in ("ensemble", "tensorrt_llm_bls"):
        out = grpc_stream(server, model, seed=np.uint64(2**63 + 7), **sampled)
        assert out.error is None and out.text == want, (model, out.error)
        out = grpc_stream(server, model, seed=np.uint64(7), random_seed=np.uint64(2**63 + 7), **sampled)
        assert out.error is None and out.text == want, (model, out.error)  # one seed under both names
    assert http_generate(server, "ensemble", seed=2**64 - 1, **sampled)[0] == 200


def test_min_tokens_at_max_tokens_bans_the_end_id(server: TritonServer, session: Session, expected: dict) -> None:
    """genai-perf's --output-tokens-mean-deterministic sends min_length = max_tokens: every request then generates
    max_tokens tokens, the end id (and eos) banned until then, as TensorRT-LLM's min length bans its end id; the
    text is the Session's with the same min_tokens."""
    prompt = next(p for p in PROMPTS if len(expected[p].token_ids) == TOKENS)
    ids = expected[prompt].token_ids
    i = next(i for i in range(2, TOKENS) if ids[i] not in ids[:i])
    request = dict(text_input=prompt, max_tokens=TOKENS, end_id=ids[i], exclude_input_in_output=True)
    out = grpc_stream(server, "ensemble", **request)
    assert out.error is None and out.text != expected[prompt].text  # the end id ends it
    want = session.generate([prompt], SamplingParams(max_tokens=TOKENS, stop_token_ids=(ids[i],), ignore_eos=True,
                                                     min_tokens=TOKENS))[0]
    assert len(want.token_ids) == TOKENS
    out = grpc_stream(server, "ensemble", min_length=TOKENS, **request)
    assert out.error is None and out.text == want.text
    for model, extra in (("ensemble", dict(min_tokens=TOKENS + 5)), ("tensorrt_llm_bls", dict(min_length=TOKENS))):
        status, body = http_generate(server, model, **request, **extra)
        assert status == 200 and body["text_output"] == want.text, (model, body)


def test_min_tokens_below_max_tokens_is_the_sessions(server: TritonServer, session: Session, expected: dict) -> None:
    """min_tokens (and the older min_length) between 1 and max_tokens hold back the end id until that many tokens,
    as the Session's SamplingParams.min_tokens does (they were refused before)."""
    prompt = next(p for p in PROMPTS if len(expected[p].token_ids) == TOKENS)
    ids = expected[prompt].token_ids
    i = next(i for i in range(2, TOKENS - 8) if ids[i] not in ids[:i])
    want = session.generate([prompt], SamplingParams(max_tokens=TOKENS, stop_token_ids=(ids[i],), ignore_eos=True,
                                                     min_tokens=i + 4))[0]
    assert len(want.token_ids) >= i + 4  # the end id no longer ends it at i
    request = dict(text_input=prompt, max_tokens=TOKENS, end_id=ids[i], exclude_input_in_output=True)
    for model, name in (("ensemble", "min_tokens"), ("tensorrt_llm_bls", "min_length")):
        status, body = http_generate(server, model, **request, **{name: i + 4})
        assert status == 200 and body["text_output"] == want.text, (model, body)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("streaming", [False, True])
def test_return_log_probs_are_the_sessions(server: TritonServer, session: Session, model: str, streaming: bool) -> None:
    """Upstream's --return-log-probs: cum_log_probs [1, 1] (the output's so far) and output_log_probs
    [1, 1, tokens] (of the response's generated tokens) hold the Session's logprobs of the same request."""
    from tritonclient.utils import InferenceServerException

    prompt = PROMPTS[4]
    want = session.generate([prompt], SamplingParams(max_tokens=TOKENS, logprobs=0))[0]
    results = upstream_grpc_client(server, model, ["text_output", "cum_log_probs", "output_log_probs"],
                                   text_input=[[prompt]], max_tokens=TOKENS, stream=streaming,
                                   exclude_input_in_output=True, return_log_probs=True)
    assert results and not any(isinstance(r, InferenceServerException) for r in results), results
    assert (len(results) > 1) == streaming
    for r in results:
        assert r.as_numpy("cum_log_probs").shape == (1, 1) and r.as_numpy("output_log_probs").shape[:2] == (1, 1)
    got = [float(v) for r in results for v in r.as_numpy("output_log_probs").reshape(-1)]
    assert got == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert results[-1].as_numpy("cum_log_probs")[0][0] == pytest.approx(want.cumulative_logprob, abs=1e-3)
    assert "".join(r.as_numpy("text_output")[0].decode() for r in results) == want.text


def test_penalties_are_the_sessions(server: TritonServer, session: Session) -> None:
    """repetition_penalty, presence_penalty and frequency_penalty reach the executor (only their neutral values
    were taken before it implemented them)."""
    prompt = PROMPTS[2]
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)
    want = session.generate([prompt], SamplingParams(max_tokens=TOKENS, **penalties))[0]
    assert want.text != session.generate([prompt], SamplingParams(max_tokens=TOKENS))[0].text
    for model in ("ensemble", "tensorrt_llm_bls"):
        status, body = http_generate(server, model, text_input=prompt, max_tokens=TOKENS, exclude_input_in_output=True,
                                     **penalties)
        assert status == 200 and body["text_output"] == want.text, (model, body)
    status, body = http_generate(server, "ensemble", text_input=prompt, max_tokens=4, presence_penalty=3.0)
    assert status == 400 and "presence_penalty" in body["error"], body


def test_http_generate_includes_the_prompt_unless_excluded(server: TritonServer, expected: dict) -> None:
    prompt = PROMPTS[1]
    status, body = http_generate(server, "ensemble", text_input=prompt, max_tokens=TOKENS)
    assert status == 200
    assert body["text_output"] == prompt + expected[prompt].text  # upstream's default


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_http_generate_stream_sends_utf8_deltas(server: TritonServer, expected: dict, model: str) -> None:
    for prompt in PROMPTS[:4]:
        status, events = http_generate(server, model, "generate_stream", text_input=prompt, max_tokens=TOKENS,
                                       stream=True, exclude_input_in_output=True)
        assert status == 200
        assert len(events) > 1
        texts = [json.loads(e.decode("utf-8"))["text_output"] for e in events]  # strict UTF-8
        assert "".join(texts) == expected[prompt].text


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("stop_words", [None, [["\x00never\x00"]]], ids=["no_stop_words", "stop_words"])
def test_grpc_streaming_chunks_are_whole_characters(server: TritonServer, session: Session, expected: dict,
                                                    model: str, stop_words: Any) -> None:
    """Every chunk is whole UTF-8, and a request with stop words streams too (it must not wait
    for the end because the runtime holds back text that could start a stop string)."""
    tok = session.tokenizer
    split_chars = 0
    extra = {} if stop_words is None else {"stop_words": stop_words}
    for prompt in PROMPTS:
        want = expected[prompt]
        # does this output contain a token that is only part of a character?
        split_chars += sum(1 for t in want.token_ids if _incomplete_utf8(tok.byte_table[t]))
        out = grpc_stream(server, model, text_input=prompt, max_tokens=TOKENS, stream=True,
                          exclude_input_in_output=True, **extra)
        assert out.error is None
        for chunk in out.chunks:
            chunk.decode("utf-8")  # strict: every chunk is whole UTF-8 on its own
        assert out.text == want.text
        assert len(out.chunks) > TOKENS // 4
    assert split_chars > 0, "no output split a character: the test would not see a broken chunk"


def _incomplete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data" or e.start == 0


def test_bls_accumulate_tokens_streams_the_whole_text_so_far(server: TritonServer, expected: dict) -> None:
    prompt = PROMPTS[1]
    out = grpc_stream(server, "tensorrt_llm_bls_accumulate", text_input=prompt, max_tokens=TOKENS, stream=True,
                      exclude_input_in_output=True)
    assert out.error is None and len(out.chunks) > TOKENS // 4
    texts = [c.decode("utf-8") for c in out.chunks]
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == expected[prompt].text
    status, body = http_generate(server, "tensorrt_llm_bls_accumulate", text_input=prompt, max_tokens=TOKENS,
                                 exclude_input_in_output=True)  # not streamed: one response, as without it
    assert status == 200 and body["text_output"] == expected[prompt].text


def test_bls_filled_as_upstream_takes_the_tokenizer_of_preprocessing(server: TritonServer, expected: dict) -> None:
    """Upstream's fill commands give the BLS no tokenizer_dir; it then tokenizes as preprocessing and
    detokenizes as postprocessing are configured (their config.pbtxt), and streams the same text."""
    prompt = PROMPTS[0]
    out = grpc_stream(server, "tensorrt_llm_bls_upstream", text_input=prompt, max_tokens=TOKENS, stream=True,
                      exclude_input_in_output=True)
    assert out.error is None and out.text == expected[prompt].text


def test_grpc_non_streaming_is_one_response(server: TritonServer, expected: dict) -> None:
    prompt = PROMPTS[2]
    out = grpc_stream(server, "ensemble", text_input=prompt, max_tokens=TOKENS, stream=False,
                      exclude_input_in_output=True)
    assert out.error is None and len(out.chunks) == 1
    assert out.text == expected[prompt].text


def upstream_grpc_client(server: TritonServer, model: str, outputs: list[str], **values: Any) -> list[Any]:
    """What inflight_batcher_llm/client/end_to_end_grpc_client.py (tensorrtllm_backend c2e65b8) does: one gRPC
    stream, the request with the outputs it asks for, stop_stream, then the results (or errors) it collected."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error if error is not None else result))
    client.async_stream_infer(model, grpc_inputs(**values), outputs=[grpcclient.InferRequestedOutput(n) for n in outputs])
    client.stop_stream()
    client.close()
    return [results.get() for _ in range(results.qsize())]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("streaming", [False, True])
def test_upstream_grpc_client_reads_text_output(server: TritonServer, expected: dict, model: str,
                                                streaming: bool) -> None:
    """text_output is flat [batch * beams], as upstream's: its client reads `output[0].decode("utf-8")` (it failed
    on the [1, 1] this repository returned), and each perf metric as `[0][0]`."""
    from tritonclient.utils import InferenceServerException

    prompt = PROMPTS[1]
    results = upstream_grpc_client(server, model, ["text_output", *PERF_METRICS], text_input=[[prompt]],
                                   max_tokens=TOKENS, stream=streaming, exclude_input_in_output=True,
                                   return_perf_metrics=True, temperature=1.0)
    assert results and not any(isinstance(r, InferenceServerException) for r in results), results
    text = ""
    for result in results:
        output = result.as_numpy("text_output")
        assert output.shape == (1,), output.shape
        text += output[0].decode("utf-8")
        assert result.as_numpy("total_draft_tokens")[0][0] >= 0
    assert text == expected[prompt].text


UPSTREAM_CLIENT_FLAGS = {  # end_to_end_grpc_client.py's flags: the inputs it sends and outputs it asks for
    "--return-context-logits": (dict(return_context_logits=True), ["context_logits"], "return_context_logits",
                                "supported: false"),
    "--return-generation-logits": (dict(return_generation_logits=True), ["generation_logits"],
                                   "return_generation_logits", "supported: false"),
    "--beam-width 2": (dict(beam_width=2), [], "beam_width=2", "supported: 1"),
    "--lora-task-id": (dict(lora_task_id=np.array([[3]], np.uint64)), [], "lora_task_id", "supported: not given"),
    "decoder_text_input": (dict(decoder_text_input=[[b"hi"]]), [], "decoder_text_input", "supported: not given"),
}


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("flag", list(UPSTREAM_CLIENT_FLAGS))
def test_upstream_client_flags_are_refused_naming_the_input(server: TritonServer, model: str, flag: str) -> None:
    """Every input and output of upstream's models is declared, so a client that asks for what this runtime does
    not do hears which input and what is supported, from our model (Triton refused undeclared ones first:
    "unexpected inference output 'sequence_index'"), as INVALID_ARG; the server carries on."""
    import grpc
    from tritonclient.utils import InferenceServerException

    values, outputs, name, supported = UPSTREAM_CLIENT_FLAGS[flag]
    results = upstream_grpc_client(server, model, ["text_output", *outputs], text_input=[["hello"]], max_tokens=4,
                                   stream=True, **values)
    assert len(results) == 1 and isinstance(results[0], InferenceServerException), results
    assert name in str(results[0]) and supported in str(results[0]), str(results[0])
    # a stream's error carries no status code: the same request, unary, is INVALID_ARGUMENT
    with pytest.raises(InferenceServerException) as e:
        grpcclient.InferenceServerClient(server.grpc_url).infer(
            "tensorrt_llm_bls_sync", grpc_inputs(text_input=[["hello"]], max_tokens=4, **values))
    assert e.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT) and name in str(e.value), str(e.value)
    assert_healthy(server)


SAMPLED = dict(max_tokens=TOKENS, top_k=40, temperature=1.0)


def sequences(results: list[Any], output: str) -> dict[int, list]:
    """Each sequence's responses by sequence_index (absent: 0), as upstream's client reads them."""
    from tritonclient.utils import InferenceServerException

    assert results and not any(isinstance(r, InferenceServerException) for r in results), results
    by_index: dict[int, list] = {}
    for r in results:
        index = r.as_numpy("sequence_index")
        by_index.setdefault(0 if index is None else int(index[0][0]), []).append(r.as_numpy(output))
    return by_index


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls", "tensorrt_llm_bls_accumulate"])
@pytest.mark.parametrize("streaming", [False, True])
def test_num_return_sequences_are_the_single_requests_seeded_seed_plus_i(server: TritonServer, model: str,
                                                                         streaming: bool) -> None:
    """num_return_sequences N samples N sequences, sequence i as a single request seeded seed + i (the executor's
    n), each response carrying one sequence and its sequence_index as upstream's (end_to_end_grpc_client.py -n
    reads them by it): streamed, a response per chunk of each; not streamed, one per sequence. Every KV block
    comes back."""
    prompt = dict(text_input=[[PROMPTS[0]]], exclude_input_in_output=True, **SAMPLED)
    want = [http_generate(server, "ensemble", **dict(prompt, text_input=PROMPTS[0]), seed=5 + i)[1]["text_output"]
            for i in range(3)]
    assert len(set(want)) == 3, want
    results = upstream_grpc_client(server, model, ["text_output", "sequence_index"], **prompt, seed=np.uint64(5),
                                   num_return_sequences=3, stream=streaming)
    by_index = sequences(results, "text_output")
    if model == "tensorrt_llm_bls_accumulate" and streaming:  # each response: the sequence's whole text so far
        assert [chunks[-1][0].decode() for _, chunks in sorted(by_index.items())] == want
    else:
        assert [b"".join(c[0] for c in chunks).decode() for _, chunks in sorted(by_index.items())] == want
    if streaming:
        assert all(len(chunks) > 1 for chunks in by_index.values())
    else:
        assert [len(chunks) for chunks in by_index.values()] == [1, 1, 1]
    assert wait_for(lambda: _kv_free(server))


@pytest.mark.parametrize("streaming", [False, True])
def test_tensorrt_llm_num_return_sequences_are_the_single_requests(server: TritonServer, session: Session,
                                                                   streaming: bool) -> None:
    """tensorrt_llm direct: output_ids of each sequence, as the single requests seeded seed + i give them."""
    ids = session.tokenizer.encode(PROMPTS[2])
    request = dict(input_ids=np.array([ids], np.int32), input_lengths=np.array([[len(ids)]], np.int32),
                   request_output_len=np.array([[TOKENS]], np.int32), runtime_top_k=np.array([[40]], np.int32),
                   temperature=np.array([[1.0]], np.float32), streaming=np.array([[streaming]]),
                   exclude_input_in_output=np.array([[True]]))
    def ids_by_sequence(**values: Any) -> list[list[int]]:
        results = upstream_grpc_client(server, "tensorrt_llm", ["output_ids", "sequence_index"], **request, **values)
        return [[t for chunk in chunks for t in chunk.reshape(-1).tolist()]
                for _, chunks in sorted(sequences(results, "output_ids").items())]

    want = [ids_by_sequence(seed=np.array([[9 + i]], np.uint64))[0] for i in range(2)]
    assert want[0] != want[1]
    before = settled_metrics(server, "nv_llm_output_token_len")  # the requests before counted
    assert ids_by_sequence(seed=np.array([[9]], np.uint64), num_return_sequences=np.array([[2]], np.int32)) == want
    # one request in the output-length histogram, with the tokens of both sequences
    after = settled_metrics(server, "nv_llm_output_token_len")
    assert metric(after, "nv_llm_output_token_len_count") == metric(before, "nv_llm_output_token_len_count") + 1
    assert metric(after, "nv_llm_output_token_len_sum") \
        == metric(before, "nv_llm_output_token_len_sum") + len(want[0]) + len(want[1])
    assert wait_for(lambda: _kv_free(server))


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_num_return_sequences_over_http_take_generate_stream(server: TritonServer, model: str) -> None:
    """Over HTTP, several sequences are several responses: generate_stream sends one event per sequence (not
    streamed) with its sequence_index; Triton 2.51's generate takes exactly one response and says so, with HTTP
    status 200."""
    values = dict(text_input=PROMPTS[0], exclude_input_in_output=True, num_return_sequences=2, seed=5, **SAMPLED)
    status, events = http_generate(server, model, "generate_stream", **values)
    assert status == 200 and sorted(json.loads(e)["sequence_index"] for e in events) == [0, 1], events
    assert http_generate(server, model, **values) == (200, {
        "error": "generate expects model to produce exactly 1 response, use generate stream for model that generates "
                 "various number of responses"})
    assert wait_for(lambda: _kv_free(server))
    assert_healthy(server)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_greedy_num_return_sequences_is_refused_naming_it(server: TritonServer, model: str) -> None:
    """Every greedy sequence would be the same (upstream's client sends no top_k: its -n 2 decodes greedily)."""
    [error] = upstream_grpc_client(server, model, ["text_output", "sequence_index"], text_input=[["hello"]],
                                   max_tokens=4, stream=True, num_return_sequences=2, temperature=1.0)
    assert ("num_return_sequences must be 1 when decoding greedily, got 2: every sequence would be the same (greedy "
            "unless runtime_top_k (top_k) or runtime_top_p (top_p) is above 0, as TensorRT-LLM reads them, and "
            "temperature above 0)") in str(error), error
    assert_healthy(server)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_upstream_client_guided_decoding(server: TritonServer, model: str) -> None:
    """--guided-decoding-guide-type / --guided-decoding-guide reach tensorrt_llm through the ensemble and the BLS:
    the output is in the regex's language; an invalid regex is refused naming the input and the position."""
    from tritonclient.utils import InferenceServerException

    regex = r"[a-z]{1,8}( [a-z]{1,8}){1,2}\."
    guided = dict(text_input=[["hello"]], max_tokens=32, stream=True, exclude_input_in_output=True,
                  guided_decoding_guide_type=[[b"regex"]])
    results = upstream_grpc_client(server, model, ["text_output"], **guided, guided_decoding_guide=[[regex.encode()]])
    assert results and not any(isinstance(r, InferenceServerException) for r in results), results
    text = "".join(r.as_numpy("text_output")[0].decode() for r in results)
    assert re.fullmatch(regex, text), text
    [error] = upstream_grpc_client(server, model, ["text_output"], **guided, guided_decoding_guide=[[b"a{2"]])
    assert "guided_decoding_guide is invalid at position 1: unclosed counted repetition" in str(error), error
    assert_healthy(server)


def test_a_large_guide_compiles_while_other_requests_are_admitted(server: TritonServer) -> None:
    """Checking and compiling a guide takes seconds for a large schema; done on the engine model's execute thread, it
    held every other client's admission. A plain request sent while a large guide compiles is now served first."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
              "required": [f"p{i}" for i in range(5000)]}
    done: dict[str, float] = {}

    def guided() -> None:
        http_generate(server, "ensemble", text_input="x", max_tokens=1, guided_decoding_guide_type="json_schema",
                      guided_decoding_guide=json.dumps(schema))
        done["guided"] = time.monotonic()

    thread = threading.Thread(target=guided)
    thread.start()
    time.sleep(0.3)  # the guide is being checked and compiled
    status, _ = http_generate(server, "ensemble", text_input="hello", max_tokens=4)
    done["plain"] = time.monotonic()
    thread.join(120)
    assert status == 200 and done["plain"] < done["guided"], done
    assert_healthy(server)


def test_upstream_batch_inputs_are_refused_naming_the_input(server: TritonServer) -> None:
    """--batch-inputs: two prompts in one request (asking for batch_index) get our error, not Triton's."""
    from tritonclient.utils import InferenceServerException

    results = upstream_grpc_client(server, "ensemble", ["text_output", "batch_index"], text_input=[["a"], ["b"]],
                                   max_tokens=np.array([[4], [4]], np.int32), stream=np.array([[True], [True]]))
    assert len(results) == 1 and isinstance(results[0], InferenceServerException), results
    assert "one prompt per request" in str(results[0]), str(results[0])
    assert_healthy(server)


def test_non_decoupled_bls_answers_unary_infer(server: TritonServer, expected: dict) -> None:
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    prompt = PROMPTS[0]
    result = client.infer("tensorrt_llm_bls_sync", grpc_inputs(text_input=prompt, max_tokens=TOKENS,
                                                               exclude_input_in_output=True))
    assert result.as_numpy("text_output")[0].decode() == expected[prompt].text  # upstream's clients' read
    with pytest.raises(InferenceServerException, match="stream"):
        client.infer("tensorrt_llm_bls_sync", grpc_inputs(text_input=prompt, max_tokens=4, stream=True))


def test_tensorrt_llm_direct_streams_the_session_tokens(server: TritonServer, session: Session,
                                                        expected: dict) -> None:
    prompt = PROMPTS[3]
    ids = session.tokenizer.encode(prompt)
    out = grpc_stream(server, "tensorrt_llm", input_ids=np.array([ids], np.int32),
                      input_lengths=np.array([[len(ids)]], np.int32), request_output_len=np.array([[TOKENS]], np.int32),
                      streaming=np.array([[True]]))
    assert out.error is None
    assert out.ids == expected[prompt].token_ids


def test_concurrent_streaming_clients_share_the_batch(server: TritonServer, expected: dict) -> None:
    results: dict[str, Streamed] = {}

    def run(prompt: str) -> None:
        results[prompt] = grpc_stream(server, "ensemble", text_input=prompt, max_tokens=TOKENS, stream=True,
                                      exclude_input_in_output=True)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == len(PROMPTS) == 16
    for prompt, out in results.items():
        assert out.error is None, (prompt, out.error)
        assert out.text == expected[prompt].text, prompt
    # in-flight batching: while one stream is running, others are too
    spans = [(r.times[0], r.times[-1]) for r in results.values()]
    overlapping = max(sum(1 for a, b in spans if a <= t <= b) for t, _ in spans)
    assert overlapping >= 4


def test_stop_words_end_the_output(server: TritonServer, session: Session, expected: dict) -> None:
    prompt, full = next((p, expected[p].text) for p in PROMPTS
                        if len(expected[p].text) > 12 and "\ufffd" not in expected[p].text[4:10])
    stop = full[4:7]
    start = full.index(stop)
    out = grpc_stream(server, "ensemble", text_input=prompt, max_tokens=TOKENS, stop_words=[[stop]],
                      exclude_input_in_output=True)
    assert out.error is None
    # generation ends with the token that completes the stop word (as TensorRT-LLM, it is kept)
    ids = expected[prompt].token_ids
    n = next(i for i in range(1, len(ids) + 1) if stop in session.tokenizer.decode(ids[:i]))
    assert out.text == session.tokenizer.decode(ids[:n])
    assert out.text.index(stop) == start


def test_embedding_bias_is_the_sessions_logit_bias(server: TritonServer, session: Session, expected: dict) -> None:
    """Upstream's embedding bias: words and weights through the ensemble and the BLS (each word's weight added to
    each of its tokens, as upstream's preprocessing does), and tensorrt_llm's embedding_bias tensor (a float per
    vocabulary token), give the Session's output with that logit_bias; it differs from the output without one."""
    tok = session.tokenizer
    prompt = PROMPTS[0]
    first, second = expected[prompt].token_ids[:2]
    words = [tok.decode([first]), tok.decode([second]) + tok.decode([second])]
    weights = [-100.0, 3.5]
    bias: dict[int, float] = {}
    for word, weight in zip(words, weights):
        for t in tok.encode(word, add_bos=False):
            bias[t] = bias.get(t, 0.0) + weight
    want = session.generate([prompt], SamplingParams(max_tokens=TOKENS, logit_bias=bias))[0]
    assert want.text != expected[prompt].text and first not in want.token_ids
    for model in ("ensemble", "tensorrt_llm_bls"):
        results = upstream_grpc_client(server, model, ["text_output"], text_input=[[prompt]], max_tokens=TOKENS,
                                       stream=True, exclude_input_in_output=True, embedding_bias_words=[words],
                                       embedding_bias_weights=[weights])
        assert "".join(r.as_numpy("text_output")[0].decode() for r in results) == want.text, (model, results)
    ids = tok.encode(prompt)
    dense = np.zeros((1, tok.vocab_size), np.float32)
    dense[0, list(bias)] = list(bias.values())
    out = grpc_stream(server, "tensorrt_llm", input_ids=np.array([ids], np.int32),
                      input_lengths=np.array([[len(ids)]], np.int32), request_output_len=np.array([[TOKENS]], np.int32),
                      embedding_bias=dense, exclude_input_in_output=np.array([[True]]))
    assert out.error is None and out.ids == want.token_ids
    # empty words (what upstream's clients send for "none") are no bias
    out = grpc_stream(server, "ensemble", text_input=prompt, max_tokens=TOKENS, embedding_bias_words=[[""]],
                      embedding_bias_weights=[[0.0]], exclude_input_in_output=True)
    assert out.error is None and out.text == expected[prompt].text


def test_bad_words_are_never_generated(server: TritonServer, session: Session, expected: dict) -> None:
    tok = session.tokenizer
    for prompt in PROMPTS:
        first = expected[prompt].token_ids[0]
        word = tok.decode([first])
        if word and tok.encode(word, add_bos=False) == [first]:
            break
    else:
        pytest.skip("no greedy output starts with a token that is a word on its own")
    out = grpc_stream(server, "ensemble", text_input=prompt, max_tokens=TOKENS, bad_words=[[word]],
                      exclude_input_in_output=True)
    assert out.error is None
    assert out.text != expected[prompt].text
    ids = tok.encode(prompt)  # the engine's own word list: [1, 2, W] (ids, end offsets)
    out = grpc_stream(server, "tensorrt_llm", input_ids=np.array([ids], np.int32),
                      input_lengths=np.array([[len(ids)]], np.int32), request_output_len=np.array([[TOKENS]], np.int32),
                      bad_words_list=np.array([[[first], [1]]], np.int32), exclude_input_in_output=np.array([[True]]))
    assert out.error is None and len(out.ids) == TOKENS and first not in out.ids


# ---- cancellation ----------------------------------------------------------------------------
# Seconds of generation, so a cancellation always lands mid-way; end_id -1: no end token.
LONG = dict(text_input="hello", max_tokens=MAX_SEQ_LEN - 8, end_id=-1, stream=True)


def _cancelled(server: TritonServer) -> float:
    return metric(metrics(server), "nv_trt_llm_requests_total", finish_reason="cancelled")


def _kv_free(server: TritonServer) -> bool:
    return metric(metrics(server), "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used") == 0


@pytest.mark.parametrize("model", ["tensorrt_llm_bls", "tensorrt_llm"])
def test_grpc_stream_cancel_frees_kv_blocks(server: TritonServer, session: Session, model: str) -> None:
    before = _cancelled(server)
    values = LONG if model == "tensorrt_llm_bls" else dict(
        input_ids=np.array([session.tokenizer.encode("hello")], np.int32),
        request_output_len=np.array([[MAX_SEQ_LEN - 8]], np.int32), end_id=np.array([[-1]], np.int32),
        streaming=np.array([[True]]))
    out = grpc_stream(server, model, on_first=lambda c: c.stop_stream(cancel_requests=True) or True, **values)
    assert out.error is None
    assert wait_for(lambda: _cancelled(server) == before + 1 and _kv_free(server))
    assert_healthy(server)


def test_bls_cancel_hits_only_its_own_request(server: TritonServer) -> None:
    """Two BLS clients may use the same request id; cancelling one must not end the other."""
    before = _cancelled(server)
    finished = metric(metrics(server), "nv_trt_llm_requests_total", finish_reason="length")
    other: dict[str, Streamed] = {}
    thread = threading.Thread(target=lambda: other.update(out=grpc_stream(
        server, "tensorrt_llm_bls", request_id="same-id", **dict(LONG, max_tokens=MAX_SEQ_LEN // 2))))
    thread.start()
    try:
        assert wait_for(lambda: metric(metrics(server), "nv_trt_llm_request_metrics", request_type="active") >= 1)
        out = grpc_stream(server, "tensorrt_llm_bls", request_id="same-id",
                          on_first=lambda c: c.stop_stream(cancel_requests=True) or True, **LONG)
        assert out.error is None
    finally:
        thread.join(120)
    assert wait_for(lambda: _cancelled(server) == before + 1 and _kv_free(server))
    assert other["out"].error is None
    assert metric(metrics(server), "nv_trt_llm_requests_total", finish_reason="length") == finished + 1, \
        "the other request did not run to max_tokens"
    assert _cancelled(server) == before + 1
    assert_healthy(server)


def test_http_disconnect_cancels_the_request(server: TritonServer) -> None:
    before = _cancelled(server)
    body = json.dumps(LONG).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/tensorrt_llm_bls/generate_stream HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data: " not in received:  # the headers may come in a segment of their own
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
    assert wait_for(lambda: _cancelled(server) == before + 1 and _kv_free(server))
    assert_healthy(server)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_stop_request_cancels_a_stream_by_its_id(server: TritonServer, model: str) -> None:
    """TensorRT-LLM's way to cancel through the ensemble or the BLS: a `stop` request to tensorrt_llm with the same id
    (the BLS's engine request carries the id with a suffix: the stop was answered and stopped nothing)."""
    before = _cancelled(server)

    def stop(_client: Any) -> bool:
        reply = grpc_stream(server, "tensorrt_llm", request_id="job-7", input_ids=np.zeros((1, 1), np.int32),
                            input_lengths=np.zeros((1, 1), np.int32), request_output_len=np.zeros((1, 1), np.int32),
                            stop=np.ones((1, 1), bool))
        assert reply.error is None
        return False  # keep reading the client's stream to its end

    out = grpc_stream(server, model, request_id="job-7", on_first=stop, **LONG)
    assert out.error is None
    assert wait_for(lambda: _cancelled(server) == before + 1 and _kv_free(server))
    assert len(out.chunks) < MAX_SEQ_LEN - 8


def test_cancelled_ensemble_stream_leaves_the_server_healthy(server: TritonServer) -> None:
    """Triton 2.51 neither passes an ensemble client's cancellation on to the running engine
    request nor releases the cancelled ensemble request (see triton_repo/README.md): the request
    runs to its end, after which its KV blocks are free again, and the server keeps serving."""
    grpc_stream(server, "ensemble", on_first=lambda c: c.stop_stream(cancel_requests=True) or True,
                **dict(LONG, max_tokens=100))
    assert wait_for(lambda: _kv_free(server))
    assert_healthy(server)


# ---- bad requests ----------------------------------------------------------------------------
GOOD = dict(text_input="hello", max_tokens=8)
BAD_REQUESTS = {
    "missing_text_input": (dict(max_tokens=8), "text_input"),
    "max_tokens_zero": (dict(GOOD, max_tokens=0), "max_tokens"),
    "max_tokens_negative": (dict(GOOD, max_tokens=-3), "max_tokens"),
    "max_tokens_too_large": (dict(GOOD, max_tokens=100_000), "max_tokens"),
    "temperature_negative": (dict(GOOD, temperature=-0.5), "temperature"),
    "top_p_above_one": (dict(GOOD, top_p=1.5), "top_p"),
    "text_input_not_utf8": (dict(GOOD, text_input=[[b"\xff\xfe bad"]]), "text_input"),
    "prompt_over_limit": (dict(GOOD, text_input="hello world " * MAX_SEQ_LEN), "input_ids (text_input) has "),
    "length_penalty_infinite": (dict(GOOD, length_penalty=1e39),  # FP32 infinity, also through JSON
                                "must be a finite number, got inf"),
    "bad_word_of_several_tokens": (dict(GOOD, bad_words=[["hello world"]]), "bad_words"),
    "beam_search": (dict(GOOD, beam_width=2), "beam_width"),
    "min_tokens_negative": (dict(GOOD, min_tokens=-1), "min_tokens must be an integer in [0, 2147483647], got -1"),
    "min_length_and_min_tokens_differ": (dict(GOOD, min_tokens=5, min_length=6),
                                         "min_tokens=5 and min_length=6 differ"),
    "seed_and_random_seed_differ": (dict(GOOD, seed=np.uint64(1), random_seed=np.uint64(2)),
                                    "seed=1 and random_seed=2 differ (random_seed is the older name of seed); "
                                    "give one of them"),
    "embedding_bias_words_without_weights": (dict(GOOD, embedding_bias_words=[["fox"]]),
                                             "embedding_bias_words and embedding_bias_weights go together, one weight "
                                             "per word; got shapes [1, 1] and None"),
    "embedding_bias_weight_too_large": (dict(GOOD, embedding_bias_words=[["fox"]], embedding_bias_weights=[[500.0]]),
                                        "embedding_bias (embedding_bias_words, embedding_bias_weights): token "),
}


def test_a_stream_of_requests_the_engine_refuses_leaves_the_server_up(server: TritonServer) -> None:
    """Requests that pass conversion and are refused by the executor (max_tokens past the KV cache), many at once:
    the responder asked `is_cancelled` of a stream whose refusal had just been sent, and Triton 2.51 had freed
    its response factory: tritonserver died by SIGSEGV within a minute of such traffic (soak_test --kinds)."""
    def refuse(_: int) -> int:
        return http_generate(server, "ensemble", **dict(GOOD, max_tokens=100_000))[0]

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(refuse, range(1200)))
    assert set(statuses) == {400}
    assert server.process.poll() is None
    assert_healthy(server)


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_request_names_the_parameter(server: TritonServer, case: str) -> None:
    values, name = BAD_REQUESTS[case]
    if case == "text_input_not_utf8":  # bytes JSON cannot carry: gRPC only
        out = grpc_stream(server, "ensemble", **values)
        assert out.error is not None and name in out.error, out.error
    else:
        out = grpc_stream(server, "ensemble", **values)
        assert out.error is not None and name in out.error, out.error
        status, body = http_generate(server, "tensorrt_llm_bls", **values)
        assert status == 400 and name in body["error"], body
    assert_healthy(server)


ENGINE_REFUSALS = {  # requests only tensorrt_llm refused before -> its message, formatted with the tokenizer's values
    "temperature_negative": (dict(GOOD, temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
    "repetition_penalty_zero": (dict(GOOD, repetition_penalty=0.0),
                                "repetition_penalty must be a finite number in [0.01, 100.0], got 0.0"),
    "repetition_penalty_negative": (dict(GOOD, repetition_penalty=-1.0),  # said ">= 0.0" while 0 was refused
                                    "repetition_penalty must be a finite number in [0.01, 100.0], got -1.0"),
    "seed_and_random_seed_differ": (dict(GOOD, seed=np.uint64(1), random_seed=np.uint64(2)),
                                    "seed=1 and random_seed=2 differ (random_seed is the older name of seed); "
                                    "give one of them"),
    "min_tokens_and_min_length_differ": (dict(GOOD, min_tokens=5, min_length=6),
                                         "min_tokens=5 and min_length=6 differ (min_length is the older name of "
                                         "min_tokens); give one of them"),
    "end_id_past_vocab": (dict(GOOD, end_id=10**7), "end_id must be an integer in [-1, {v1}], got 10000000"),
    "bad_word_of_several_tokens": (dict(GOOD, bad_words=[["hello world"]]),
                                   "bad_words: 'hello world' is {hello_world} tokens; only single-token bad words are "
                                   "supported"),
    "max_tokens_past_context": (dict(GOOD, max_tokens=100_000),
                                "request_output_len (max_tokens) 100000 with a {hello}-token prompt exceeds "
                                f"max_seq_len {MAX_SEQ_LEN}; "
                                "at most {room}"),
    "prompt_over_max_seq_len": (dict(GOOD, text_input="hello world " * MAX_SEQ_LEN),
                                f"input_ids (text_input) has {{long}} tokens; max_seq_len is {MAX_SEQ_LEN}"),
    "guided_with_min_tokens": (dict(GOOD, min_tokens=2, guided_decoding_guide_type="json"),
                               "guided_decoding cannot be combined with ignore_eos or min_tokens: the grammar decides "
                               "where the output ends (with eos)"),
    "guide_invalid": (dict(GOOD, guided_decoding_guide_type="regex", guided_decoding_guide="a{2"),
                      "guided_decoding_guide is invalid at position 1: unclosed counted repetition"),
    "guided_with_eos_banned": (dict(GOOD, guided_decoding_guide_type="json", bad_words=[[EOS]]),
                               "guided_decoding ends the output with eos; bad_token_ids must not ban it"),
    "num_draft_tokens_past_the_draft_length": (dict(GOOD, num_draft_tokens=4),
                                               "num_draft_tokens 4 exceeds this executor's draft length 3"),
}


def engine_refusal(session: Session, case: str) -> tuple[dict, str]:
    values, message = ENGINE_REFUSALS[case]
    tok = session.tokenizer
    hello = len(tok.encode("hello"))
    return values, message.format(v1=tok.vocab_size - 1, hello=hello, room=MAX_SEQ_LEN - hello,
                                  hello_world=len(tok.encode("hello world", add_bos=False)),
                                  long=len(tok.encode("hello world " * MAX_SEQ_LEN)))


def executions(server: TritonServer, model: str) -> int:
    """How many requests `model` has been given (Triton's statistics: refused ones included)."""
    status, text = http_call(server, f"/v2/models/{model}/stats")
    assert status == 200, text
    stats = json.loads(text)["model_stats"][0]["inference_stats"]
    return stats["success"]["count"] + stats["fail"]["count"]


@pytest.mark.parametrize("case", list(ENGINE_REFUSALS), ids=list(ENGINE_REFUSALS))
def test_bls_refuses_what_tensorrt_llm_would_before_calling_it(server: TritonServer, session: Session,
                                                              case: str) -> None:
    """The BLS passed these on to tensorrt_llm and its refusal back with the code Triton 2.51's BLS API reports for
    it, which depends on the allocator (HTTP 500 under jemalloc): it now refuses them itself, with tensorrt_llm's
    message, and tensorrt_llm is not called. The ensemble, which calls tensorrt_llm, gets the same message."""
    values, message = engine_refusal(session, case)
    before = executions(server, "tensorrt_llm")
    status, body = http_generate(server, "tensorrt_llm_bls", **values)
    assert (status, body) == (400, {"error": message})
    assert http_generate(server, "ensemble", **values) == (400, {"error": f"in ensemble 'ensemble', {message}"})
    # Triton counts a request after its response: the ensemble's call is counted, the BLS made none
    assert wait_for(lambda: executions(server, "tensorrt_llm") > before)
    time.sleep(0.2)
    assert executions(server, "tensorrt_llm") == before + 1
    assert_healthy(server)


def test_bls_refusals_are_400_under_jemalloc(checkpoint: Path, session: Session, tmp_path: Path) -> None:
    """Under jemalloc, every refusal the BLS passed on from tensorrt_llm was HTTP 500 (16 of 16 per kind in the soak
    test's probe, docs/reliability.md): the BLS refuses them itself now, so they are 400 whatever the allocator; a
    request that does not fit a KV cache smaller than max_seq_len too."""
    import ctypes.util

    jemalloc = ctypes.util.find_library("jemalloc")
    if jemalloc is None:
        pytest.skip("libjemalloc is not installed")
    # a KV cache smaller than one max_seq_len sequence: the executor refuses what does not fit it
    repo = fill_model_repo(tmp_path / "repo", repo_values(checkpoint, max_tokens_in_paged_kv_cache="256"))
    srv = start_server(repo, log_file=tmp_path / "server.log", ready_timeout_s=240, exit_timeout_s=3,
                       env={**os.environ, "LD_PRELOAD": jemalloc})
    try:
        for case in ENGINE_REFUSALS:
            values, message = engine_refusal(session, case)
            assert http_generate(srv, "tensorrt_llm_bls", **values) == (400, {"error": message}), case
        assert wait_for(lambda: metric(metrics(srv), "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max"))
        m = metrics(srv)
        block = int(metric(m, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per"))
        blocks = int(metric(m, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max"))
        hello = len(session.tokenizer.encode("hello"))
        message = (f"max_tokens 500 with a {hello}-token prompt needs {-(-(hello + 499) // block)} KV blocks; the cache "
                   f"has {blocks} of {block} tokens")
        assert http_generate(srv, "tensorrt_llm_bls", **dict(GOOD, max_tokens=500)) == (400, {"error": message})
        assert http_generate(srv, "ensemble", **dict(GOOD, max_tokens=500)) == \
            (400, {"error": f"in ensemble 'ensemble', {message}"})
        assert_healthy(srv)
        srv.process.kill()  # no model finalizes: the engine's limits stay published until the launcher stops it
        srv.process.wait()
        assert (server_dir(srv.process.pid) / "tensorrt_llm.json").is_file()
    finally:
        srv.stop()
    assert not server_dir(srv.process.pid).exists()


# ---- the shipped model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped_server(shipped_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    work = tmp_path_factory.mktemp("triton_shipped")
    repo = fill_model_repo(work / "repo", repo_values(shipped_model_dir))
    srv = start_server(repo, log_file=work / "server.log", ready_timeout_s=240, exit_timeout_s=3)
    try:
        yield srv
    finally:
        srv.stop()


def test_shipped_model_streams_what_the_session_generates(shipped_server: TritonServer,
                                                          shipped_model_dir: Path) -> None:
    held_out = json.loads((shipped_model_dir / "heldout_prompts.json").read_text())
    prompts = [p["text"][:200] for p in held_out[:4]]
    with Session(shipped_model_dir, num_draft_tokens=3, speculation="fixed") as s:
        want = s.generate(prompts, SamplingParams(max_tokens=32))
    results: dict[int, Streamed] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, grpc_stream(
        shipped_server, "ensemble", text_input=prompts[i], max_tokens=32, stream=True,
        exclude_input_in_output=True, return_perf_metrics=True))) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, w in enumerate(want):
        assert results[i].error is None
        assert results[i].text == w.text
        assert results[i].stats["total_draft_tokens"] == w.stats.num_draft_tokens
    assert sum(r.stats["total_accepted_draft_tokens"] for r in results.values()) > 0  # the MTP head works


def _steps(model_dir: Path, prompt: str, params: SamplingParams) -> tuple[list[int], list[Any]]:
    """The prompt's ids and a request's outputs as a Session drafting as the servers do (k = 3 every step) reports
    them: one per decoding step (its output callback's, never merged)."""
    with Session(model_dir, num_draft_tokens=3, speculation="fixed") as s:
        ids, outs = s.tokenizer.encode(prompt), []
        s.executor.submit(ids, params, on_output=outs.append).result()
    assert all(o.text_delta and not o.mid_character for o in outs)  # no step's text waits for a later step's
    assert max(len(o.new_token_ids) for o in outs) > 1  # steps of several tokens
    return ids, outs


def _responses(server: TritonServer, model: str, inputs: list) -> list[Any]:
    """Every response of one gRPC stream that carries output, in order."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    got = []
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=60)
            assert error is None, error.message()
            if result.as_numpy("output_ids") is not None or result.as_numpy("text_output") is not None:
                got.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def _tokens_per_response(responses: list[Any]) -> list[int]:
    """Each response's tokens as its perf metrics count them: the drafts accepted since the response before, and the
    one token every step adds."""
    accepted = [0] + [int(r.as_numpy("total_accepted_draft_tokens").item()) for r in responses]
    return [1 + b - a for a, b in zip(accepted, accepted[1:])]


def test_shipped_model_streams_a_response_per_decoding_step(shipped_server: TritonServer,
                                                             shipped_model_dir: Path) -> None:
    """With MTP (k = 3) a step emits 1..4 tokens; streamed, each step is one response, as TensorRT-LLM streams a
    step's accepted tokens: tensorrt_llm's output_ids of each response are one step's tokens, in order, and the
    ensemble's and the BLS's text_output one step's text; each response's perf metrics say the same (its tokens are
    the drafts accepted since the response before, plus one), and there are as many responses as the request's
    output tokens less its accepted drafts. A greedy fixed-length output (end_id -1) whose every step has text of its
    own: no response waits for a later step's text."""
    prompt, n = "def fibonacci(n):", 32
    ids, steps = _steps(shipped_model_dir, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    want_ids = [list(o.new_token_ids) for o in steps]
    assert len(steps) == n - steps[-1].stats.num_accepted_draft_tokens
    direct = _responses(shipped_server, "tensorrt_llm", grpc_inputs(
        input_ids=np.array([ids], np.int32), input_lengths=np.array([[len(ids)]], np.int32),
        request_output_len=np.array([[n]], np.int32), end_id=np.array([[-1]], np.int32),
        streaming=np.array([[True]]), return_perf_metrics=np.array([[True]])))
    assert [r.as_numpy("output_ids").reshape(-1).tolist() for r in direct] == want_ids
    assert _tokens_per_response(direct) == list(map(len, want_ids))
    for model in ("ensemble", "tensorrt_llm_bls"):
        texts = _responses(shipped_server, model, grpc_inputs(
            text_input=prompt, max_tokens=n, end_id=-1, stream=True, exclude_input_in_output=True,
            return_perf_metrics=True, return_num_output_tokens=True))
        assert [r.as_numpy("text_output").reshape(-1)[0].decode() for r in texts] == [o.text_delta for o in steps]
        assert _tokens_per_response(texts) == list(map(len, want_ids)), model
        last = texts[-1]
        assert len(texts) == last.as_numpy("num_output_tokens").item() - \
            last.as_numpy("total_accepted_draft_tokens").item() == len(steps), model


def test_llmapi_flavour_streams_a_response_per_decoding_step(shipped_model_dir: Path, tmp_path: Path) -> None:
    """The same of the llmapi flavour's tensorrt_llm (its executor in a process of its own, as on a GPU), whose
    responses each carry the whole text so far: each response's text is the text after one more step, and its perf
    metrics count that step's tokens."""
    import yaml

    from serving.triton.model_repo import add_llmapi_model

    prompt, n = "def fibonacci(n):", 32
    _, steps = _steps(shipped_model_dir, prompt, SamplingParams(max_tokens=n))  # no ignore_eos: no llmapi input
    model = add_llmapi_model(tmp_path / "repo", shipped_model_dir)
    doc = yaml.safe_load((model / "1" / "model.yaml").read_text())
    doc["triton_config"].update(speculation="fixed", engine_process=True)
    (model / "1" / "model.yaml").write_text(yaml.safe_dump(doc))
    srv = start_server(tmp_path / "repo", log_file=tmp_path / "server.log", ready_timeout_s=240, exit_timeout_s=3)
    try:
        inputs = []
        for name, arr in dict(text_input=np.array([prompt.encode()], object), streaming=np.array([True]),
                              sampling_param_max_tokens=np.array([n], np.int32),
                              sampling_param_return_perf_metrics=np.array([True])).items():
            inputs.append(grpcclient.InferInput(name, list(arr.shape), DTYPES[arr.dtype]))
            inputs[-1].set_data_from_numpy(arr)
        responses = _responses(srv, "tensorrt_llm", inputs)
    finally:
        srv.stop()
    assert_no_stub_crash(srv)
    assert [r.as_numpy("text_output")[0].decode() for r in responses] == \
        ["".join(o.text_delta for o in steps[:i + 1]) for i in range(len(steps))]
    assert _tokens_per_response(responses) == [len(o.new_token_ids) for o in steps]


# ---- metrics ---------------------------------------------------------------------------------
def test_metrics_report_requests_tokens_acceptance_kv_and_queue(server: TritonServer, checkpoint: Path) -> None:
    long = " ".join(f"word{i}" for i in range(120))  # several full KV blocks, found in the prefix cache the second time
    for text in ("hello", long, long):
        grpc_stream(server, "ensemble", text_input=text, max_tokens=8)

    def settled() -> bool:
        m = metrics(server)
        return metric(m, "nv_trt_llm_request_metrics", request_type="active") == 0 and \
            metric(m, "nv_trt_llm_generated_tokens_total") > 0

    assert wait_for(settled)
    m = metrics(server)
    assert metric(m, "nv_trt_llm_requests_total", finish_reason="length") > 0
    assert metric(m, "nv_trt_llm_draft_tokens_total", draft_token_type="proposed") > 0
    assert 0 <= metric(m, "nv_trt_llm_spec_decode_metrics", spec_decode_type="acceptance_rate") <= 1
    assert metric(m, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max") > 0
    assert metric(m, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used") == 0
    assert metric(m, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per") == \
        read_limits(checkpoint)[1].kv_block_size
    assert metric(m, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="reused") > 0
    assert metric(m, "nv_trt_llm_request_metrics", request_type="waiting") == 0
    assert metric(m, "nv_llm_output_token_len_count") > 0


def test_finished_requests_count_each_returned_sequence(server: TritonServer) -> None:
    """nv_trt_llm_requests_total counts each of a request's num_return_sequences under its own finish reason (each
    sequence has its own final response and reason); it counted the request once, by its last sequence."""
    family = "nv_trt_llm_requests_total"
    before = settled_metrics(server, family)
    results = upstream_grpc_client(server, "ensemble", ["text_output", "sequence_index"], text_input=[[PROMPTS[0]]],
                                   max_tokens=4, top_k=40, temperature=1.0, end_id=-1, seed=np.uint64(3),
                                   num_return_sequences=3)
    assert sorted(sequences(results, "text_output")) == [0, 1, 2]
    after = settled_metrics(server, family)
    assert metric(after, family, finish_reason="length") == metric(before, family, finish_reason="length") + 3
    assert metric(after, family) == metric(before, family) + 3


@pytest.mark.parametrize("key, value, message", [
    ("engine_dir", '/e" }\nbackend: "pytorch', "a quote, backslash or control character ('\"') cannot stand inside a "
                                                "config.pbtxt string"),
    ("engine_dir", "/e\nx", "a quote, backslash or control character ('\\n') cannot stand inside a config.pbtxt string"),
    ("triton_max_batch_size", '8 backend: "evil"', "expected an integer in [1, 2147483647]"),
    ("decoupled_mode", "0x0", "expected true or false"),
])
def test_fill_template_refuses_values_that_would_add_settings(key: str, value: str, message: str) -> None:
    """config.pbtxt is protobuf text: a value that leaves its string or its number adds settings of its own (a
    `backend:` line, parameters), and 0x0 reads as false; such values are refused, naming the key."""
    template = (TEMPLATE_REPO / "tensorrt_llm" / "config.pbtxt").read_text()
    with pytest.raises(ValueError) as e:
        fill(template, {key: value}, "c.pbtxt")
    assert str(e.value) == f"c.pbtxt: {key}:{value!r}: {message}"
    with pytest.raises(ValueError) as e:  # a bare value of another template (upstream's): a number or a list
        fill("sizes: [ ${sizes} ]", {"sizes": '8 ] backend: "evil'}, "c.pbtxt")
    assert str(e.value) == ("c.pbtxt: sizes:'8 ] backend: \"evil': expected a number or a list of them (letters, "
                            "digits and '.,_+-' only: a space, quote, brace or colon would add settings of its own)")


def test_make_model_repo_writes_no_absolute_path(tmp_path: Path, shipped_model_dir: Path) -> None:
    """The model config endpoint shows clients each model's parameters: the engine and tokenizer are links in
    the model's own directory, named relative to it."""
    repo = fill_model_repo(tmp_path / "repo", repo_values(shipped_model_dir))
    text = "".join(c.read_text() for c in repo.glob("*/config.pbtxt"))
    assert "/work" not in text and "/tmp" not in text and "/" + shipped_model_dir.name not in text
    engine = re.search(r'key: "gpt_model_path"\s+value: \{\s+string_value: "([^"]+)"', text).group(1)
    assert engine == "engine" and (repo / "tensorrt_llm" / engine).resolve() == shipped_model_dir.resolve()
    assert (repo / "preprocessing" / "tokenizer").resolve() == shipped_model_dir.resolve()



# ---- hardening: admin APIs, refusals in the declared types, sizes, parameters ----------------
def http_call(server: TritonServer, path: str, body: Any = None, headers: dict | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.http_url}{path}", data, {"Content-Type": "application/json",
                                                                            **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("path, body", [
    ("/v2/systemsharedmemory/region/stub/register", {"key": "/dsv3_stub", "offset": 0, "byte_size": 64}),
    ("/v2/systemsharedmemory/status", None),
    ("/v2/logging", {"log_verbose_level": 1}),
    ("/v2/repository/index", {}),
    ("/v2/repository/models/ensemble/unload", {}),
    ("/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
], ids=["shm_register", "shm_status", "logging", "repository_index", "unload", "trace"])
def test_admin_apis_need_the_admin_key(server: TritonServer, path: str, body: Any) -> None:
    """Registering a Python stub's own shared-memory region let any client that reaches the port crash the server;
    clients also changed log levels. Those APIs answer only requests with the admin header (a launcher flag; off
    without it), over HTTP and gRPC, and the server stays up."""
    status, text = http_call(server, path, body)
    assert status == 403 and "This API is restricted, expecting header 'admin-key'" in text, (status, text)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(Exception, match="This protocol is restricted"):
        client.get_system_shared_memory_status()
    with pytest.raises(Exception, match="This protocol is restricted"):
        client.update_log_settings({"log_verbose_level": 1})
    assert http_call(server, "/v2/systemsharedmemory/status", headers={"admin-key": ADMIN_KEY}) == (200, "[]")
    assert_healthy(server)


def test_stub_regions_are_private_to_the_servers_user(server: TritonServer) -> None:
    """The Python backend's shared-memory regions carry every request's prompt and output, and Triton 2.51 makes them
    0644 whatever the umask: readable by every local user. The launcher makes each 0600 as it appears."""
    regions = sorted(SHM_DIR.glob(f"{server.shm_prefix}*"))
    assert len(regions) >= 5  # a stub each: ensemble's members, the BLS's instances
    assert {oct(region.stat().st_mode & 0o777) for region in regions} == {oct(0o600)}
    assert_healthy(server)


def test_launcher_restricts_admin_apis_by_default() -> None:
    """Without --admin_api_key the admin APIs are keyed to a random value no client can send (a line break inside:
    tritonserver's command line, key included, is readable by every local user): off."""
    install = find_install()
    cmds = [build_command(install, Path("/b"), Path("/repo"), host="127.0.0.1", http_port=1, grpc_port=2,
                          metrics_port=3) for _ in range(2)]
    flags = [[a for a in cmd if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))] for cmd in cmds]
    for http, grpc in flags:
        assert http.startswith("--http-restricted-api=shared-memory,model-repository,logging,trace:admin-key=")
        assert grpc.startswith("--grpc-restricted-protocol=shared-memory,model-repository,logging,trace:admin-key=")
        key = http.split(":admin-key=", 1)[1]
        assert grpc.endswith(f":admin-key={key}") and len(key) == 65 and key[32] == "\n"
    assert flags[0] != flags[1]


def test_model_config_endpoint_shows_no_server_path(server: TritonServer, checkpoint: Path) -> None:
    for model in ("tensorrt_llm", "preprocessing", "postprocessing"):
        status, text = http_call(server, f"/v2/models/{model}/config")
        assert status == 200 and str(checkpoint) not in text and '"/' not in text, text


REFUSALS = {  # values -> (refusal through the ensemble, through the BLS)
    "top_p_nan": (dict(GOOD, top_p=np.float32("nan")),
                  "runtime_top_p (top_p) must be a finite number in [0.0, 1.0], got nan",
                  "top_p must be a finite number in [0.0, 1.0], got nan"),
    "temperature_inf": (dict(GOOD, temperature=np.float32("inf")),
                        "temperature must be a finite number, got inf",
                        "temperature must be a finite number, got inf"),
    "top_k_negative": (dict(GOOD, top_k=-1), "runtime_top_k (top_k) must be an integer in [0, 2147483647], got -1",
                       "top_k must be an integer in [0, 2147483647], got -1"),
    "end_id_wrapped": (dict(GOOD, end_id=np.int32(-2**31)), "end_id must be an integer in [-1, 2147483647], got "
                       "-2147483648", "end_id must be an integer in [-1, 2147483647], got -2147483648"),
    "end_id_past_vocab": (dict(GOOD, end_id=10**7), "end_id must be an integer in [-1, {v1}], got 10000000",
                          "end_id must be an integer in [-1, {v1}], got 10000000"),
    "num_draft_tokens_negative": (dict(GOOD, num_draft_tokens=-1),
                                  "num_draft_tokens must be an integer in [0, 2147483647], got -1", None),
    "text_input_too_long": (dict(GOOD, text_input="x" * 2_000_000),
                            "text_input is 2000000 bytes, more than the {max_bytes} that can fit the model's context "
                            "(max_seq_len tokens of at most the tokenizer's longest token)", None),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_refusals_are_checked_in_the_declared_type(server: TritonServer, session: Session, case: str) -> None:
    """NaN top_p decoded greedily, an end_id past INT32 wrapped into "no end id", and a 100 MB text_input was
    tokenized for minutes while other requests waited: values are now checked as declared, before conversion
    or tokenizing, and each refusal names the client's input."""
    values, ensemble_error, bls_error = REFUSALS[case]
    fmt = dict(v1=session.tokenizer.vocab_size - 1, max_bytes=MAX_SEQ_LEN * session.tokenizer.max_token_bytes)
    t0 = time.monotonic()
    out = grpc_stream(server, "ensemble", **values)
    assert out.error is not None and ensemble_error.format(**fmt) in out.error, out.error
    assert time.monotonic() - t0 < 10
    out = grpc_stream(server, "tensorrt_llm_bls", **values)
    assert out.error is not None and (bls_error or ensemble_error).format(**fmt) in out.error, out.error
    assert_healthy(server)


def test_negative_seed_over_http_is_refused_by_tritons_frontend(server: TritonServer) -> None:
    """seed is UINT64, as upstream declares it: Triton's HTTP front end fails to convert -1 before any model sees
    it, and answers 500 on generate and on infer alike; nothing of ours runs, so this records Triton 2.51's behaviour
    (docs/reliability.md). A seed past 2^63 does reach the models, which take it modulo 2^63."""
    error = {"error": "Unable to parse 'data': attempt to access JSON non-unsigned-integer as unsigned-integer"}
    for model in ("ensemble", "tensorrt_llm_bls"):
        assert http_generate(server, model, **GOOD, seed=-1) == (500, error), model
        status, body = http_generate(server, model, **GOOD, seed=2**64 - 1)
        assert status == 200, (model, status, body)
    status, text = http_call(server, "/v2/models/tensorrt_llm_bls_sync/infer", {"inputs": [
        {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]},
        {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [8]},
        {"name": "seed", "shape": [1, 1], "datatype": "UINT64", "data": [-1]}]})
    assert (status, json.loads(text)) == (500, error)
    assert_healthy(server)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_unknown_generate_keys_are_refused(server: TritonServer, model: str) -> None:
    """The generate endpoint passes JSON keys that are not inputs on as request parameters; a misspelt input
    (`max_token`) was silently ignored."""
    status, body = http_generate(server, model, **GOOD, max_token=3)
    assert status == 400 and "unknown parameter(s) max_token: " in body["error"], body
    assert "takes inputs only (a generate endpoint's JSON keys must be input names)" in body["error"]
    assert_healthy(server)


def test_large_request_bodies_leave_the_stubs_shared_memory_as_it_was(server: TritonServer) -> None:
    """A 2 MB text_input (refused) grew the receiving stubs' regions from Triton's 1 MiB default, and Triton 2.51 maps
    a grown region again, keeping the old mapping: resident memory that stays. The launcher starts every region large
    enough for it."""
    regions = {r: r.stat().st_size for r in SHM_DIR.glob(f"{server.shm_prefix}*")}
    assert regions and set(regions.values()) == {PYTHON_SHM_REGION_BYTES}, regions
    with ThreadPoolExecutor(4) as pool:  # several at once, to the ensemble and the BLS
        outs = list(pool.map(lambda m: grpc_stream(server, m, **dict(GOOD, text_input="x" * 2_000_000)),
                             ["ensemble", "tensorrt_llm_bls"] * 4))
    assert all(o.error is not None and "text_input is 2000000 bytes" in o.error for o in outs), outs
    assert {r: r.stat().st_size for r in SHM_DIR.glob(f"{server.shm_prefix}*")} == regions
    assert_healthy(server)


def test_engine_word_lists_hold_token_ids(server: TritonServer, session: Session) -> None:
    """A stop word id of -4 on tensorrt_llm failed inside the tokenizer ("number too small to fit in target type")."""
    ids = session.tokenizer.encode("hello")
    out = grpc_stream(server, "tensorrt_llm", input_ids=np.array([ids], np.int32),
                      input_lengths=np.array([[len(ids)]], np.int32), request_output_len=np.array([[4]], np.int32),
                      stop_words_list=np.array([[[-4], [1]]], np.int32))
    assert out.error is not None and (f"stop_words_list must hold token ids in [0, {session.tokenizer.vocab_size}), "
                                      "got [-4]") in out.error, out.error
    assert_healthy(server)


@pytest.mark.parametrize("token, length, message", [
    (-1, 1, "TOKENS_BATCH must hold token ids in [0, {vocab}), got [-1]"),
    (99999, 1, "TOKENS_BATCH must hold token ids in [0, {vocab}), got [99999]"),
    (5, 3, "SEQUENCE_LENGTH must be in [0, 1] (the tokens given), got 3"),
])
def test_postprocessing_refuses_ids_outside_the_vocabulary(server: TritonServer, session: Session, token: int,
                                                           length: int, message: str) -> None:
    """Reached directly, postprocessing answered token -1 with a Python traceback (HTTP 500) and decoded 99999 as
    nothing."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    tokens = httpclient.InferInput("TOKENS_BATCH", [1, 1, 1], "INT32")
    tokens.set_data_from_numpy(np.array([[[token]]], np.int32))
    lengths = httpclient.InferInput("SEQUENCE_LENGTH", [1, 1], "INT32")
    lengths.set_data_from_numpy(np.array([[length]], np.int32))
    with pytest.raises(Exception) as e:
        client.infer("postprocessing", [tokens, lengths])
    assert message.format(vocab=session.tokenizer.vocab_size) in str(e.value) and "Traceback" not in str(e.value)
    assert e.value.status() == "400", e.value.status()  # a refusal, not a server error (500 before)
    assert_healthy(server)


def test_refusals_are_invalid_argument_on_every_model(server: TritonServer) -> None:
    """A refused request is the client's error: HTTP 400 and gRPC INVALID_ARGUMENT, never the 500 / INTERNAL a
    server fault gets (which alerting counts, and retrying clients retry). Unary infer on the non-decoupled models:
    preprocessing (max_tokens 0), postprocessing (a token outside the vocabulary), the non-decoupled BLS (a
    negative top_k, which it checks itself: Triton 2.51's BLS drops a composing model's error code)."""
    import grpc
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    def http_and_grpc(model: str, **values: Any) -> None:
        with pytest.raises(InferenceServerException) as e:
            grpcclient.InferenceServerClient(server.grpc_url).infer(model, grpc_inputs(**values))
        assert e.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT), (model, e.value.status(), str(e.value))
        http_inputs = []
        for name, arr in input_arrays(**values).items():
            http_inputs.append(httpclient.InferInput(name, list(arr.shape), DTYPES[arr.dtype]))
            http_inputs[-1].set_data_from_numpy(arr)
        with pytest.raises(InferenceServerException) as e:
            httpclient.InferenceServerClient(server.http_url).infer(model, http_inputs)
        assert e.value.status() == "400", (model, e.value.status(), str(e.value))

    http_and_grpc("preprocessing", QUERY=[[b"hello"]], REQUEST_OUTPUT_LEN=np.array([[0]], np.int32))
    http_and_grpc("postprocessing", TOKENS_BATCH=np.array([[[-1]]], np.int32),
                  SEQUENCE_LENGTH=np.array([[1]], np.int32))
    http_and_grpc("tensorrt_llm_bls_sync", text_input=[[b"hello"]], max_tokens=np.array([[8]], np.int32),
                  top_k=np.array([[-1]], np.int32))
    assert_healthy(server)


def test_text_models_do_not_import_torch() -> None:
    """preprocessing, postprocessing and the BLS run in stubs of their own (ten in the default repository): what
    their modules import, each stub holds. Importing torch through request validation's guided decoding took each
    from about 49 MB to 243 MB resident (2 GB over the default repository); only tensorrt_llm needs torch. The BLS
    runs tensorrt_llm's request conversion and checks (serving.triton.legacy_request), without it."""
    code = ("import sys, serving.request_validation, serving.triton.text_processing, serving.triton.parameters, "
            "serving.triton.legacy_request, serving.triton.engine_limits, serving.triton.bls; "
            "print(sorted(m for m in ('torch', 'llguidance', 'runtime.core.sampling') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_watchdog_takes_a_stalled_server_down(checkpoint: Path, tmp_path: Path) -> None:
    """Readiness that says ready while nothing is served is the worst kind: when the step loop makes no progress
    for watchdog_timeout_s while requests wait (here a 5 ms timeout that a long prefill exceeds), the model logs
    why with every thread's stack and stops tritonserver, so readiness fails and a supervisor can restart it."""
    repo = fill_model_repo(tmp_path / "repo", repo_values(checkpoint, watchdog_timeout_s="0.005"))
    srv = start_server(repo, log_file=tmp_path / "server.log", ready_timeout_s=240, exit_timeout_s=3)
    try:
        grpc_stream(srv, "tensorrt_llm_bls", text_input="hello world " * 300, max_tokens=64, timeout=30)
        assert wait_for(lambda: srv.process.poll() is not None, timeout=60)
        assert not srv.is_ready()
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "watchdog: executor: the executor's step loop has made no progress for " in log
    assert "requests running" in log and "stopping the server (pid " in log
    assert 'Thread 0x' in log and 'in _step' in log  # the stacks: where the step loop was


def test_shutdown_after_serving_is_clean(checkpoint: Path, tmp_path: Path) -> None:
    """After serving every surface, SIGINT unloads every model and tritonserver exits 0 with no stub crash in the
    log (each stub logs a crash with faulthandler): tensorrt_llm's stub crashed deleting its metrics at exit."""
    repo = fill_model_repo(tmp_path / "repo", repo_values(checkpoint))
    srv = start_server(repo, log_file=tmp_path / "server.log", ready_timeout_s=240, exit_timeout_s=30)
    try:
        for model in ("ensemble", "tensorrt_llm_bls"):
            assert grpc_stream(srv, model, **GOOD).error is None
        assert http_generate(srv, "ensemble", **GOOD)[0] == 200
        assert wait_for(lambda: metric(metrics(srv), "nv_trt_llm_generated_tokens_total") > 0)
    finally:
        status = srv.stop()
    assert_no_stub_crash(srv)
    log = (tmp_path / "server.log").read_text()
    for model in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"):
        assert f"successfully unloaded '{model}'" in log, model
    assert status == 0


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("missing", ["text_input", "max_tokens"])
def test_streaming_without_a_required_input_is_refused(server: TritonServer, model: str, missing: str) -> None:
    """Triton 2.51 counts inputs rather than checking which: with `stream` in their place, the ensemble answered
    HTTP 200 with an empty stream and the BLS named preprocessing's QUERY."""
    body = {k: v for k, v in dict(GOOD, stream=True).items() if k != missing}
    status, events = http_generate(server, model, "generate_stream", **body)
    error = events["error"] if isinstance(events, dict) else json.loads(events[0])["error"]
    assert status == 400 and f"{missing} is required" in error, (status, events)
    out = grpc_stream(server, model, **body)
    assert out.error is not None and f"{missing} is required" in out.error, out.error
    assert_healthy(server)


def test_word_lists_are_counted_before_they_are_converted(shipped_model_dir: Path) -> None:
    """600,000 stop words were tokenized (preprocessing) or decoded (tensorrt_llm) one by one, ~10 s on the one
    thread admitting requests, before the 64-string bound refused them; counted first now."""
    from serving.request_validation import RequestError, max_stop_words
    from serving.triton.legacy_request import word_list
    from serving.triton.text_processing import Preprocessor
    from runtime.io.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(shipped_model_dir)
    limit = max_stop_words(tokenizer)
    words = np.stack([np.full(600_000, 5), np.arange(1, 600_001)])[None]  # 600,000 one-token words
    with pytest.raises(RequestError, match=rf"^stop_words_list holds 600000 words; at most {limit}$"):
        word_list({"stop_words_list": words}, "stop_words_list", tokenizer.vocab_size, limit)
    inputs = {"QUERY": np.array([[b"hi"]], object), "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32),
              "STOP_WORDS_DICT": np.array([[b"x"] * 600_000], object)}
    with pytest.raises(RequestError, match=rf"^stop_words holds 600000 words; at most {limit}$"):
        Preprocessor(tokenizer, None, 1 << 20)(inputs.get)


def test_a_guide_too_large_is_refused_for_its_own_bound() -> None:
    """A guide's bound is its own, not the context's (the refusal said it could not fit the model's context)."""
    from serving.request_validation import RequestError
    from serving.triton.contract import MAX_GUIDE_BYTES, guided_decoding

    guide = np.array([[b"a" * (MAX_GUIDE_BYTES + 1)]], object)
    with pytest.raises(RequestError, match=rf"^guided_decoding_guide is {MAX_GUIDE_BYTES + 1} bytes, more than the "
                                           rf"{MAX_GUIDE_BYTES} a guide may be$"):
        guided_decoding({"guided_decoding_guide_type": np.array([[b"regex"]], object), "guided_decoding_guide": guide})
