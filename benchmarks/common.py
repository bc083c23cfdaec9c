"""Helpers shared by the benchmark scripts: machine info, held-out prompts, engine limits,
markdown tables, atomic result files, target lines.

Every benchmark writes `docs/benchmarks/<name>.json` and `<name>.md` (and sometimes `.png`),
each written to a temporary file in the same folder and renamed into place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from benchmarks import ROOT
from runtime.core.sampling_params import SamplingParams
from runtime.executors.lifetime import proc_stat
from runtime.executors.session import Session
from runtime.io.atomic import atomic_write
from runtime.io.checkpoint import expected_tensor_shapes, is_mtp_tensor
from runtime.model.kernels.modules import KernelMLA, PackedExperts, PackedLinear

DEFAULT_MODEL = "models/deepseek-v3-mini"
DEFAULT_OUT_DIR = "docs/benchmarks"
PROMPTS_FILE = "heldout_prompts.json"


# ---- setup ----------------------------------------------------------------------------------
def add_common_args(p, *, threads_help: str = "torch intra-op threads (0: torch's default)") -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF DeepSeek-V3 checkpoint or engine directory")
    p.add_argument("--out_dir", type=Path, default=Path(DEFAULT_OUT_DIR))
    p.add_argument("--threads", type=int, default=0, help=threads_help)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny settings, results still written")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the native runtime on a GPU)")
    p.add_argument("--dtype", default=None, help="model dtype (default: the engine's build dtype)")


def parse_with_quick(p, argv: list[str] | None, quick_defaults: dict[str, Any]):
    """Parse the flags; with --quick, the smoke run's settings replace the defaults (flags given explicitly
    still win) and --name gets '_quick', so a smoke run never overwrites a full run's results."""
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**quick_defaults)
        args = p.parse_args(argv)
        args.name += "_quick"
    return args


def comma_list(p, flag: str, value: str, kind: type = int, what: str = "integers") -> list:
    """A comma-separated flag value as a list of `kind`, or argparse's error naming the flag."""
    try:
        return [kind(x) for x in value.split(",")]
    except ValueError:
        p.error(f"{flag}: expected comma-separated {what}, got {value!r}")


def check_minimums(p, args, minimums: dict[str, float]) -> None:
    """argparse's error (exit status 2) naming the first flag below its least value."""
    for flag, least in minimums.items():
        if getattr(args, flag) < least:
            p.error(f"--{flag}: must be >= {least}, got {getattr(args, flag)}")


def sync(device: str | torch.device) -> None:
    """Wait for queued GPU work, so that host clocks time it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def set_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)


def _command_line() -> str:
    """The command that reproduces this run: `python -m benchmarks.<name> ...` for a benchmark module."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = f"python -m {spec.name}" if spec is not None else Path(sys.argv[0]).name
    return " ".join([program, *sys.argv[1:]])


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on; load average tells whether something else was running."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average_1m_5m_15m": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "git_commit": _git("rev-parse", "HEAD"),
        # changed tracked files, but not the benchmark outputs this very run rewrites
        "git_dirty_files": (_git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                 ":(exclude)docs/benchmarks") or "").splitlines(),
        "command": _command_line(),
    }
    try:
        import transformers
        info["transformers_version"] = transformers.__version__
    except Exception:  # transformers is optional for most scripts
        pass
    return info


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
        return out.rstrip()  # not strip(): `status --porcelain` lines start with a meaningful blank
    except Exception:
        return None


def load_prompts(model_dir: str | Path, path: str | Path | None = None) -> list[dict[str, str]]:
    """Held-out prompts ({"source", "text"}): `path`, else `<model>/heldout_prompts.json`, else
    `data/heldout_prompts.json`."""
    candidates = [Path(path)] if path else [Path(model_dir) / PROMPTS_FILE, ROOT / "data" / PROMPTS_FILE]
    for c in candidates:
        if c.is_file():
            items = json.loads(c.read_text())
            if not items or not all(isinstance(x, dict) and x.get("text") for x in items):
                raise SystemExit(f"{c}: expected a list of {{'source', 'text'}} objects")
            return [{"source": x.get("source", "?"), "text": x["text"]} for x in items]
    raise SystemExit(f"no held-out prompts: looked for {', '.join(map(str, candidates))}")


def round_robin_by_source(items: list[dict[str, str]], n: int) -> list[dict[str, str]]:
    """The first n prompts taking one from each source in turn (sources in order of appearance)."""
    by_source: dict[str, list[dict[str, str]]] = {}
    for x in items:
        by_source.setdefault(x["source"], []).append(x)
    out, queues = [], [list(v) for v in by_source.values()]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def weight_bytes_in_memory(model) -> int:
    """Bytes the loaded model's weights occupy: parameters plus the CPU kernels' forms of them (packed FP8/BF16
    panels, attention's per-head absorption weights)."""
    tensors = {id(t): t for t in model.parameters()}
    for m in model.modules():
        packs = [m.packed] if isinstance(m, PackedLinear) and m.packed is not None else []
        if isinstance(m, PackedLinear) and m.weight is not None:
            tensors[id(m.weight)] = m.weight
        if isinstance(m, KernelMLA):
            tensors |= {id(t): t for t in m.absorbed}
        if isinstance(m, PackedExperts):
            packs = [m.gate_proj, m.up_proj, m.down_proj]
        for p in packs:
            tensors[id(p.panels)], tensors[id(p.scale)] = p.panels, p.scale
    return sum(t.numel() * t.element_size() for t in tensors.values())


def engine_info(engine) -> dict[str, Any]:
    cfg = engine.model_config
    shapes = expected_tensor_shapes(cfg)  # the release's tensors (the loaded model may hold some packed)
    n_params = sum(math.prod(s) for s in shapes.values())
    n_mtp = sum(math.prod(s) for name, s in shapes.items() if is_mtp_tensor(name, cfg))
    return {
        "path": str(engine.path),
        "build": engine.build.to_dict(),
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "n_routed_experts": cfg.n_routed_experts,
        "parameters_total": n_params,
        "parameters_mtp": n_mtp,
        "parameters_target": n_params - n_mtp,
        "dtype": str(next(engine.model.parameters()).dtype),
        "weights_packed_for_cpu_kernels": sum(isinstance(m, PackedLinear) for m in engine.model.modules()),
        "weight_bytes_in_memory": weight_bytes_in_memory(engine.model),
    }


def run_tool(cmd: Sequence[Any]) -> None:
    """Run a command line (e.g. build_engine) quietly; on failure stop with its own error output, which
    check=True with capture_output would have swallowed (CalledProcessError names only the exit status)."""
    cmd = [str(c) for c in cmd]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        tail = "\n".join((r.stderr.strip() or r.stdout.strip()).splitlines()[-20:])
        raise SystemExit(f"{Path(cmd[0]).name} failed (exit status {r.returncode}): {' '.join(cmd[1:])}\n{tail}")


# ---- load -----------------------------------------------------------------------------------
def closed_loop_clients(num_requests: int, concurrency: int, send: Callable[[int], bool | None],
                        join_until: float | None = None) -> None:
    """`concurrency` client threads; each sends request i (the next unsent index) once its previous
    one finished, and stops when the indices run out or `send` returns False. Joins the threads
    (until the perf_counter time `join_until`, when given)."""
    lock, order = threading.Lock(), iter(range(num_requests))

    def client() -> None:
        while True:
            with lock:
                i = next(order, None)
            if i is None or send(i) is False:
                return

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(None if join_until is None else max(0.0, join_until - time.perf_counter()))


# ---- statistics -----------------------------------------------------------------------------
def drafting_summary(outs: Sequence[Any]) -> dict[str, Any]:
    """Requests' drafting in all: drafts, accepted drafts, acceptance and tokens per step (outputs' stats)."""
    drafted = sum(o.stats.num_draft_tokens for o in outs)
    accepted = sum(o.stats.num_accepted_draft_tokens for o in outs)
    return {"requests": len(outs), "draft_tokens": drafted, "accepted_draft_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_step": sum(o.stats.output_tokens for o in outs) / sum(o.stats.num_steps for o in outs)}


def mean(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.fmean(xs) if xs else None


def percentile(xs: Sequence[float | None], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics, as numpy's default
    (and so vLLM's benchmark) computes it; None and NaN are left out, None when nothing is left."""
    xs = sorted(x for x in xs if x is not None and not math.isnan(x))
    if not xs:
        return None
    i = (len(xs) - 1) * q / 100
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def timed_request(ex: Any, prompt_ids: list[int], params: Any) -> tuple[Any, float, float | None, float | None]:
    """Submit one request to an executor and wait for it: its final output, the time it was sent, and the times its
    first and last outputs with tokens reached the output callback (None when none came)."""
    stamps: dict[str, float] = {}

    def on_output(o: Any) -> None:
        if o.new_token_ids:
            stamps["last"] = time.perf_counter()
            stamps.setdefault("first", stamps["last"])

    t0 = time.perf_counter()
    out = ex.submit(prompt_ids, params, on_output=on_output).result()
    return out, t0, stamps.get("first"), stamps.get("last")


def request_ttft_tpot(sent: float, first_token: float | None, last_token: float | None,
                      output_tokens: int) -> tuple[float | None, float | None]:
    """TTFT and TPOT of one request as vLLM's benchmarks/benchmark_serving.py defines them, from the client's
    clock: TTFT = first token time - send time; TPOT = (latency - TTFT) / (output tokens - 1), latency being
    the last token's time - send time, i.e. (last token - first token) / (output tokens - 1). TPOT is None for
    a request of fewer than 2 output tokens (vLLM leaves those out of its TPOT statistics); both None when no
    token came. Every token after the first counts in TPOT's denominator, also those a speculative step
    emitted together with the first."""
    if first_token is None:
        return None, None
    ttft = first_token - sent
    if output_tokens < 2 or last_token is None:
        return ttft, None
    return ttft, (last_token - first_token) / (output_tokens - 1)


def session_request(session: Session, prompt: str, max_tokens: int) -> tuple[float | None, float | None]:
    """TTFT and TPOT of one request to a runtime Session on the client's clock (when its handle yields the first
    and last outputs), eos ignored: the baseline a server's are compared with."""
    ids = session.tokenizer.encode(prompt)
    sent = time.perf_counter()
    first = last = None
    for out in session.executor.submit(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
        if out.new_token_ids:
            last = time.perf_counter()
            first = first or last
    return request_ttft_tpot(sent, first, last, max_tokens)


def cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU time (user + system, seconds) each named group of processes has used so far; "this process" is added
    (every thread of it). A process that has exited counts 0."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for name, group in pids.items():
        used[name] = 0.0
        for pid in group:
            fields = proc_stat(pid)
            if fields is not None:
                used[name] += (int(fields[11]) + int(fields[12])) / tick
    mine = os.times()
    used["this process"] = mine.user + mine.system
    return used


class CpuTime:
    """CPU time of each side of a comparison, summed over the spans it ran: its processes' and this process's
    (named by the role this process plays for that side, such as "client")."""

    def __init__(self) -> None:
        self.used: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def span(self, side: str, processes: dict[str, list[int]] | None = None,
             this_process: str = "this process") -> Iterator[None]:
        before = cpu_seconds(processes or {})
        yield
        totals = self.used.setdefault(side, {})
        for name, seconds in cpu_seconds(processes or {}).items():
            key = this_process if name == "this process" else name
            totals[key] = totals.get(key, 0.0) + seconds - before[name]

    def per_token_us(self, tokens: int) -> dict[str, dict[str, float]]:
        return {side: {name: round(s / tokens * 1e6, 1) for name, s in used.items()}
                for side, used in self.used.items()}


def median_us(fn: Callable[[], Any], reps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of fn() in microseconds on `clock` (wall time; time.thread_time for the calling thread's CPU),
    over `reps` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e6


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


class Timer:
    def __enter__(self) -> "Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0


# ---- formatting -----------------------------------------------------------------------------
def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{digits}f}"
    return str(x)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], digits: int = 2) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(x, digits) for x in r) + " |")
    return "\n".join(lines)


def target_line(name: str, value: float | None, goal: float, unit: str = "x") -> dict[str, Any]:
    """A target next to its measured value (reported, never asserted)."""
    met = None if value is None else value >= goal
    return {"target": name, "goal": goal, "measured": value, "met": met,
            "text": f"{name}: {fmt(value)}{unit} (target >= {goal}{unit}) "
                    f"{'-' if met is None else 'MET' if met else 'NOT MET'}"}


def machine_md(info: dict[str, Any]) -> str:
    keys = ("date_utc", "cpu_model", "cpu_count", "gpu", "torch_threads", "torch_version", "transformers_version",
            "load_average_1m_5m_15m", "uvicorn", "git_commit", "git_dirty_files", "command")
    return "\n".join(f"- {k}: `{info[k]}`" for k in keys if info.get(k) is not None)


# ---- atomic outputs -------------------------------------------------------------------------
def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, default=_json_default) + "\n").encode())


def write_text(path: Path, text: str) -> None:
    atomic_write(path, (text.rstrip() + "\n").encode())


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    atomic_write(path, buf.getvalue())


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_results(out_dir: Path, name: str, results: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    js, md = out_dir / f"{name}.json", out_dir / f"{name}.md"
    write_json(js, results)
    write_text(md, markdown)
    return js, md
