"""dsv3-serve as a child process, for the quick start, benchmarks and tests: started on a free loopback port and
returned once /health answers."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from runtime.executors.lifetime import free_ports, spawn


@dataclass
class ServeProcess:
    process: subprocess.Popen
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM (a graceful stop) and the exit status."""
        self.process.terminate()
        return self.process.wait(timeout=timeout_s)


def start_dsv3_serve(model: str | Path, *flags: str, log: Path | None = None, timeout_s: float = 300) -> ServeProcess:
    """`dsv3-serve model --port P *flags` with its output to the file `log` (None: inherited); RuntimeError, with
    the log's end, if it exits or is not healthy within timeout_s (it is stopped then)."""
    [port] = free_ports(1)
    with open(log, "w") if log is not None else contextlib.nullcontext() as out:
        process = spawn([Path(sys.executable).with_name("dsv3-serve"), str(model), "--port", str(port), *flags],
                        stdout=out, stderr=subprocess.STDOUT if out is not None else None)  # a killed caller leaves none
    server = ServeProcess(process, port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None else ""
            raise RuntimeError(f"dsv3-serve exited with status {process.returncode} before becoming healthy\n{tail}")
        try:
            urllib.request.urlopen(server.base_url + "/health", timeout=2)
            return server
        except OSError:
            time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"dsv3-serve did not become healthy within {timeout_s:.0f} s")
