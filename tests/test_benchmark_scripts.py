"""The benchmarks (benchmarks/): their metrics on hand-made timings, their flag checks, atomic result
files, and smoke runs of benchmarks.serving and benchmarks.load_test on the shipped model at the tiniest settings
(the JSON's keys and sanity, never its timings).

Metric conventions are vLLM's benchmarks/benchmark_serving.py: TTFT = first token - send; TPOT per request =
(latency - TTFT) / (output tokens - 1), 1-token requests left out, then averaged; output tokens/s = the
level's output tokens / its wall time; percentiles interpolate linearly (numpy's default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

import benchmarks.acceptance as ma
import benchmarks.attention_threads as att
import benchmarks.draft_overlap as dov
import benchmarks.common as bc
import benchmarks.load_test as lt
import benchmarks.serving as bs
import benchmarks.speculative as bspec
import benchmarks.step_profile as sprof
import benchmarks.triton_serving as bt
import benchmarks.verify_cost as vcost


# ---- benchmarks.common statistics ----------------------------------------------------------------------
@pytest.mark.parametrize("xs", [[3.0], [4.0, 1.0], [0.01, 0.5, 0.02, 0.03], list(np.random.default_rng(0).random(7)),
                                list(np.random.default_rng(1).random(100))])
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy(xs, q):
    assert bc.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-15)


def test_percentile_small_sample_p99_and_missing_values():
    # order statistics 1, 2, 3, 10: p99 sits at rank (4 - 1) x 0.99 = 2.97, 97% of the way from 3 to 10
    assert bc.percentile([10.0, 1.0, 3.0, 2.0], 99) == pytest.approx(3 + 0.97 * 7)
    assert bc.percentile([None, 2.0, float("nan"), 4.0], 50) == 3.0
    assert bc.percentile([], 99) is None and bc.percentile([None, float("nan")], 50) is None


def test_mean_and_ratio():
    assert bc.mean([1.0, None, 3.0, float("nan")]) == 2.0
    assert bc.mean([None]) is None
    assert bc.ratio(3.0, 2.0) == 1.5
    assert bc.ratio(None, 2.0) is None and bc.ratio(1.0, 0) is None and bc.ratio(1.0, None) is None


def test_request_ttft_tpot_is_vllms():
    # sent 10.0, first token 10.5, last 12.5, 5 tokens: latency 2.5, TTFT 0.5, TPOT (2.5 - 0.5) / 4
    assert bc.request_ttft_tpot(10.0, 10.5, 12.5, 5) == pytest.approx((0.5, 0.5))
    # a speculative first step that emitted 3 of the 5 tokens still divides by 4 (vLLM), not by 2
    assert bc.request_ttft_tpot(0.0, 1.0, 2.0, 5)[1] == pytest.approx(0.25)
    assert bc.request_ttft_tpot(10.0, 10.5, 10.5, 1) == (0.5, None)  # 1 token: no TPOT
    assert bc.request_ttft_tpot(10.0, None, None, 0) == (None, None)


def test_target_line():
    t = bc.target_line("x vs y", 1.25, 1.3)
    assert (t["measured"], t["goal"], t["met"]) == (1.25, 1.3, False) and t["text"].endswith("NOT MET")
    assert bc.target_line("x", 1.3, 1.3)["met"] is True
    t = bc.target_line("x", None, 1.0)
    assert t["met"] is None and t["text"].endswith("-")


def test_write_results_is_atomic(tmp_path):
    js, md = bc.write_results(tmp_path, "r", {"a": 1, "p": Path("x")}, "# hi\n\n")
    assert json.loads(js.read_text()) == {"a": 1, "p": "x"} and md.read_text() == "# hi\n"
    with pytest.raises(TypeError):  # not serializable: nothing half-written, the old file kept, no temporary left
        bc.write_json(js, {"a": object()})
    assert json.loads(js.read_text()) == {"a": 1, "p": "x"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]


def test_round_robin_by_source():
    items = [{"source": s, "text": f"{s}{i}"} for s, i in [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0)]]
    assert [x["text"] for x in bc.round_robin_by_source(items, 4)] == ["a0", "b0", "c0", "a1"]


def test_closed_loop_clients_sends_each_request_once():
    import threading
    seen, lock = [], threading.Lock()

    def send(i):
        with lock:
            seen.append(i)

    bc.closed_loop_clients(25, 4, send)
    assert sorted(seen) == list(range(25))


# ---- benchmark_serving ----------------------------------------------------------------------------
def _record(submitted, ttft, tpot, n, finished, drafted=0, accepted=0, steps=None):
    return {"submitted": submitted, "finished": finished, "finish_reason": "length", "prompt_tokens": 5,
            "output_tokens": n, "ttft_s": ttft, "tpot_s": tpot, "num_steps": n if steps is None else steps,
            "num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted}


def test_serving_summarize_hand_made_level():
    t0 = 100.0
    records = [_record(100.0, 0.2, 0.1, 11, 101.2, drafted=8, accepted=6, steps=5),
               _record(100.5, 0.3, 0.3, 6, 102.3, drafted=4, accepted=1, steps=4),
               _record(101.0, 0.4, None, 1, 101.4, steps=1),  # 1 token: no TPOT
               None]  # did not finish
    cancelled = dict(_record(100.0, 0.2, 0.1, 2, 103.0), finish_reason="cancelled")  # cut at a timeout
    s = bs.summarize(records + [cancelled], t0, ["TimeoutError: x"])
    assert (s["requests"], s["completed"], s["errors"]) == (5, 3, ["TimeoutError: x"])
    assert s["wall_s"] == pytest.approx(2.3)  # first send (t0) to the last finish
    assert s["output_tokens"] == 18
    assert s["output_tokens_per_s"] == pytest.approx(18 / 2.3)
    assert s["requests_per_s"] == pytest.approx(3 / 2.3)
    assert s["tpot_mean_s"] == pytest.approx(0.2)  # the 1-token request left out
    assert s["tpot_p50_s"] == pytest.approx(0.2) and s["tpot_p99_s"] == pytest.approx(0.1 + 0.99 * 0.2)
    assert s["ttft_mean_s"] == pytest.approx(0.3) and s["ttft_p99_s"] == pytest.approx(0.3 + 0.1 * 0.98)
    assert s["latency_mean_s"] == pytest.approx((1.2 + 1.8 + 0.4) / 3)
    assert s["acceptance_rate"] == pytest.approx(7 / 12)
    assert s["drafts_per_decode_step"] == pytest.approx(12 / 10)
    assert s["decode_tokens_per_step"] == pytest.approx(18 / 10)
    assert bs.summarize([None, None], t0, []) == {"completed": 0, "requests": 2, "errors": []}
    assert bs.summarize([_record(0.0, 0.1, 0.1, 3, 1.0)], 0.0, [])["acceptance_rate"] is None


def test_serving_collector_times_on_the_client_clock(monkeypatch):
    clock = iter([10.4, 10.9, 11.7])  # outputs with 3 tokens (speculative first step), 1 token, 1 token (final)
    monkeypatch.setattr(bs.time, "perf_counter", lambda: next(clock))
    col = bs._Collector(1, None)
    cb = col.callback(0, submitted=10.0)
    stats = SimpleNamespace(prompt_tokens=4, output_tokens=5, ttft_s=99.0, tpot_s=99.0, num_steps=3,
                            num_draft_tokens=4, num_accepted_draft_tokens=2)
    cb(SimpleNamespace(new_token_ids=[1, 2, 3], finished=False, finish_reason=None, stats=stats))
    cb(SimpleNamespace(new_token_ids=[4], finished=False, finish_reason=None, stats=stats))
    assert not col.finished.is_set()
    cb(SimpleNamespace(new_token_ids=[5], finished=True, finish_reason="length", stats=stats))
    r = col.records[0]
    assert col.finished.is_set()
    assert r["ttft_s"] == pytest.approx(0.4)  # not the runtime's numbers
    assert r["tpot_s"] == pytest.approx((11.7 - 10.4) / 4)
    assert (r["submitted"], r["finished"], r["output_tokens"]) == (10.0, 11.7, 5)


def _level(tok_s, tpot):
    return {"output_tokens_per_s": tok_s, "tpot_mean_s": tpot}


def test_serving_ratios_and_targets():
    results = {"concurrency_sweep": [
        {"concurrency": 1, "plain": _level(100.0, 0.010), "adaptive": _level(150.0, 0.006)},
        {"concurrency": 4, "plain": _level(300.0, 0.012), "adaptive": _level(360.0, 0.010)},
        {"concurrency": 16, "plain": _level(700.0, 0.020), "adaptive": _level(630.0, 0.025)}],
        "qps_sweep": [{"qps": 2.0, "plain": _level(50.0, 0.010), "adaptive": _level(40.0, 0.008)},
                      {"qps": 4.0, "plain": _level(80.0, 0.012), "adaptive": {"completed": 0}}]}
    modes = ["plain", "adaptive"]
    bs.add_ratios_vs_plain(results, modes)
    c1, c4, c16 = (row["adaptive"] for row in results["concurrency_sweep"])
    assert results["concurrency_sweep"][0]["plain"]["tok_s_vs_plain"] == 1.0
    assert c1["tok_s_vs_plain"] == pytest.approx(1.5) and c1["tpot_speedup_vs_plain"] == pytest.approx(0.010 / 0.006)
    assert c16["tok_s_vs_plain"] == pytest.approx(0.9)
    assert results["qps_sweep"][1]["adaptive"]["tok_s_vs_plain"] is None  # nothing completed: no ratio
    targets = {t["target"]: t for t in bs.serving_targets(results, modes)}
    assert targets["plain: output tok/s at concurrency 16 vs 1"]["measured"] == pytest.approx(7.0)
    assert targets["plain: output tok/s at concurrency 16 vs 1"]["met"] is True
    assert targets["adaptive: output tok/s at concurrency 16 vs 1"]["measured"] == pytest.approx(4.2)
    assert targets["adaptive vs plain output tok/s, worst concurrency level"]["measured"] == pytest.approx(0.9)
    assert targets["adaptive vs plain output tok/s, worst level at concurrency <= 4"]["measured"] == pytest.approx(1.2)
    # a rate where adaptive finished nothing counts as 0 (not skipped)
    assert targets["adaptive vs plain TPOT speed-up, worst Poisson rate (info)"]["measured"] == 0


def test_serving_make_requests_deterministic_and_in_range():
    a = bs.make_requests([[1], [2, 3], [4]], 50, 3, 7, seed=5)
    assert a == bs.make_requests([[1], [2, 3], [4]], 50, 3, 7, seed=5)
    assert all(3 <= n <= 7 for _, n in a) and {tuple(i) for i, _ in a} <= {(1,), (2, 3), (4,)}


@pytest.mark.parametrize("argv, flag", [
    (["--modes", "plain,turbo"], "--modes"), (["--modes", ","], "--modes"),
    (["--concurrency", "1,x"], "--concurrency"), (["--concurrency", "0,2"], "--concurrency"),
    (["--qps", "1,-2"], "--qps"), (["--qps", "fast"], "--qps"), (["--qps_fractions", "0"], "--qps_fractions"),
    (["--min_tokens", "8", "--max_tokens", "4"], "--max_tokens"), (["--num_requests", "0"], "--num_requests"),
    (["--fixed_k", "0"], "--fixed_k"), (["--timeout", "0"], "--timeout"), (["--rounds", "0"], "--rounds")])
def test_serving_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        bs.parse_args(argv)
    assert e.value.code == 2 and f"error: {flag}" in capsys.readouterr().err


def test_serving_parse_args_good():
    a = bs.parse_args(["--modes", "adaptive,plain", "--concurrency", "4,1", "--qps", "0.5,2", "--fixed_k", "0"])
    assert a.modes_list == ["plain", "adaptive"] and a.levels == [4, 1] and a.rates == [0.5, 2.0]
    assert bs.parse_args(["--qps", "none"]).rates == []


def test_quick_settings_are_defaults_that_explicit_flags_override():
    q = bs.parse_args(["--quick"])
    assert (q.levels, q.num_requests, q.fractions, q.max_tokens, q.name) == ([1, 4], 4, [0.5], 16, "serving_quick")
    q = bs.parse_args(["--quick", "--concurrency", "2", "--max_tokens", "40", "--name", "mine"])
    assert (q.levels, q.num_requests, q.max_tokens, q.name) == ([2], 4, 40, "mine_quick")
    assert bs.parse_args([]).fractions == [0.25, 0.5, 0.75, 1.0] and bs.parse_args(["--qps", "3"]).fractions == []
    q = lt.parse_args(["--quick", "--concurrency", "7"])
    assert (q.concurrency, q.num_requests, q.name) == (7, 12, "load_test_quick")


class _Handle:
    def __init__(self, ex: "_FakeExecutor", i: int):
        self.ex, self.i = ex, i

    @property
    def finished(self) -> bool:
        return self.i not in self.ex.hang or self.i in self.ex.cancelled

    def cancel(self) -> None:
        assert not self.finished, f"request {self.i} cancelled after it finished"
        self.ex.cancelled.append(self.i)
        self.ex.finish(self.i, "cancelled")

    def result(self, timeout=None):
        if self.i in self.ex.hang:
            raise TimeoutError(f"request {self.i} did not finish within {timeout} s")


class _FakeExecutor:
    """Finishes each request at once (1 token), except those in `hang`, which end only when cancelled."""

    def __init__(self, hang: set[int]):
        self.hang, self.cancelled, self.callbacks, self.n = hang, [], {}, 0

    def submit(self, ids, params, on_output):
        i, self.n = self.n, self.n + 1
        self.callbacks[i] = on_output
        if i not in self.hang:
            self.finish(i, "length")
        return _Handle(self, i)

    def finish(self, i: int, reason: str) -> None:
        stats = SimpleNamespace(prompt_tokens=1, output_tokens=1, num_steps=1, num_draft_tokens=0,
                                num_accepted_draft_tokens=0)
        self.callbacks[i](SimpleNamespace(new_token_ids=[7], finished=True, finish_reason=reason, stats=stats))

    def stats(self):
        return SimpleNamespace(acceptance_estimate=None, current_draft_len=0)


def test_serving_cut_requests_are_cancelled_and_not_counted(monkeypatch):
    reqs = [([1, 2], 1)] * 4
    monkeypatch.setattr(bs, "CANCEL_WAIT_S", 5.0)
    ex = _FakeExecutor(hang={1, 3})
    out = bs.poisson_loop(ex, reqs, qps=1000.0, seed=0, timeout=0.2, bar=None)
    assert sorted(ex.cancelled) == [1, 3]  # nothing left running into the next level
    assert (out["requests"], out["completed"], out["errors"]) == (4, 2, ["timed out after 0.2 s"])
    ex = _FakeExecutor(hang={2})
    records, errors = bs.closed_loop(ex, reqs, concurrency=1, timeout=0.1, bar=None)
    assert ex.cancelled == [2]  # and the client stopped at its timed-out request
    assert [r and r["finish_reason"] for r in records] == ["length", "length", "cancelled", None]
    assert errors == ["TimeoutError: request 2 did not finish within 0.1 s"]
    assert bs.summarize(records, 0.0, errors)["completed"] == 2


def test_serving_rounds_pool_end_to_end():
    one = [_record(0.0, 0.1, 0.1, 11, 1.0), _record(0.5, 0.2, 0.3, 6, 2.0)]  # a round of 2 s, 17 tokens
    two = [_record(0.0, 0.1, 0.2, 5, 0.5), None]  # 0.5 s, 5 tokens, 1 not finished
    records, errors = bs.end_to_end([(one, ["x"]), (two, ["y"])])
    assert [r and (r["submitted"], r["finished"]) for r in records] == [(0.0, 1.0), (0.5, 2.0), (2.0, 2.5), None]
    s = bs.summarize(records, 0.0, errors)
    assert (s["requests"], s["completed"], s["errors"], s["wall_s"]) == (4, 3, ["x", "y"], 2.5)
    assert s["output_tokens_per_s"] == pytest.approx(22 / 2.5) and s["tpot_mean_s"] == pytest.approx(0.2)
    assert s["latency_mean_s"] == pytest.approx((1.0 + 1.5 + 0.5) / 3)


def test_triton_closed_loop_counts_failed_requests():
    def send(prompt, max_tokens):
        if prompt == "bad":
            raise RuntimeError("in ensemble 'ensemble', max_tokens must be >= 1")
        return {"ttft_s": 0.5, "tpot_s": 0.01, "tokens": max_tokens}

    out = bt.closed_loop(send, ["good", "bad", "good"], concurrency=2, n_requests=6, max_tokens=4)
    assert (out["requests"], out["completed"], out["tpot_s"], out["ttft_s"]) == (6, 4, 0.01, 0.5)
    assert sorted(out["errors"]) == [f"request {i}: RuntimeError: in ensemble 'ensemble', max_tokens must be >= 1"
                                     for i in (1, 4)]


def test_triton_rounds_merge_weighted_by_completed_requests():
    runs = [{"concurrency": 1, "requests": 4, "completed": 4, "errors": [], "tpot_s": 0.01, "ttft_s": 0.1,
             "output_tok_s": 100.0, "wall_s": 2.0},
            {"concurrency": 1, "requests": 4, "completed": 2, "errors": ["request 1: x"], "tpot_s": 0.04,
             "ttft_s": 0.4, "output_tok_s": 50.0, "wall_s": 1.0}]
    out = bt.merged(runs)
    assert (out["requests"], out["completed"], out["errors"], out["wall_s"]) == (8, 6, ["request 1: x"], 3.0)
    assert out["tpot_s"] == pytest.approx(0.02) and out["ttft_s"] == pytest.approx(0.2)
    assert out["output_tok_s"] == pytest.approx(250 / 3)


def test_cpu_seconds_counts_each_group_and_this_process():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.5: pass\nimport sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        time.sleep(1.5)
        before = bc.cpu_seconds({"busy": [busy.pid], "none": []})
        t = time.process_time()
        while time.process_time() - t < 0.3:  # this process burns 0.3 s
            pass
        after = bc.cpu_seconds({"busy": [busy.pid], "none": [], "absent": [10**8]})  # above any pid_max
    finally:
        busy.communicate(b"")
    assert 0.4 <= before["busy"] <= after["busy"] <= before["busy"] + 0.1  # its 0.5 s, then idle
    assert before["none"] == after["none"] == after["absent"] == 0.0
    assert 0.25 <= after["this process"] - before["this process"] <= 0.5


def test_structured_output_quick_run_times_the_grammar(tmp_path):
    """The script called GrammarMatcher.masks, which had left runtime.core.grammar: every run died before writing."""
    import benchmarks.structured_output as so

    so.main(["--quick", "--threads", "1", "--max_tokens", "8", "--out_dir", str(tmp_path)])
    res = json.loads((tmp_path / "structured_output_quick.json").read_text())["results"]
    assert all(r["json_schema"]["masks_us_per_step"] > 0 and r["json_schema"]["advance_us_per_token"] > 0
               for r in res.values()) and len(res) >= 2


def test_attention_threads_quick_run_writes_every_kernel_and_shape(tmp_path):
    assert att.main(["--quick", "--threads", "2", "--out_dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "attention_threads_quick.json").read_text())
    assert res["threads"] == 2
    assert sorted((r["shape"], r["kernel"]) for r in res["results"]) == [
        ("DeepSeek-V3", "mla_attention"), ("DeepSeek-V3", "mla_prepare"), ("shipped model", "mla_attention"),
        ("shipped model", "mla_prepare")]
    assert all(r["us_1_thread"] > 0 and r["us_2_threads"] > 0 and r["context"] == 64 for r in res["results"])


def test_draft_overlap_quick_run_bounds_the_pipelined_step(tmp_path):
    assert dov.main(["--quick", "--threads", "2", "--out_dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "draft_overlap_quick.json").read_text())
    assert [r["k"] for r in res["results"]] == [1, 2, 3, 4] and res["threads"] == 2
    for r in res["results"]:
        assert r["serial_us"] == pytest.approx(r["verify_us_2_threads"] + r["draft_us_2_threads"], abs=0.2)
        assert r["pipelined_bound_us"] == max(r["verify_us_1_thread"], r["draft_us_1_thread"])
    one = res["us_per_forward"]["1"]  # k = 3's drafting: the catch-up over 4 positions and 2 chain steps
    assert res["results"][2]["draft_us_1_thread"] == pytest.approx(one["mtp_q4"] + 2 * one["mtp_q1"], abs=0.1)


def test_cpu_time_sums_each_sides_spans_per_token():
    def burn(seconds: float) -> None:
        t = time.process_time()
        while time.process_time() - t < seconds:
            pass

    cpu = bc.CpuTime()
    for _ in range(2):
        with cpu.span("server", {"none": []}, this_process="client"):
            burn(0.2)
        with cpu.span("session"):
            burn(0.1)
    got = cpu.per_token_us(1000)  # us per token over 1000 tokens: 1 s of CPU reads 1000
    assert sorted(got) == ["server", "session"] and sorted(got["server"]) == ["client", "none"]
    assert got["server"]["none"] == 0.0 and list(got["session"]) == ["this process"]
    assert 380 <= got["server"]["client"] <= 500 and 180 <= got["session"]["this process"] <= 300


def test_triton_server_processes_group_stubs_by_model(monkeypatch):
    monkeypatch.setattr(bt, "python_stubs", lambda pid: {11: "tensorrt_llm_0_0", 12: "preprocessing_0_1",
                                                         13: "preprocessing_1_0", 14: "tensorrt_llm_bls_0_0"})
    assert bt.server_processes(10) == {"tritonserver": [10], "tensorrt_llm stub": [11],
                                       "preprocessing stub": [12, 13], "tensorrt_llm_bls stub": [14]}


# ---- benchmark_speculative / measure_acceptance / load_test pure parts -----------------------------
def test_speculative_summarize_ours_and_hf():
    ours = [{"token_ids": [1, 2, 3, 4], "output_tokens": 4, "latency_s": 1.0, "ttft_s": 0.4, "tpot_s": 0.2,
             "num_steps": 2, "num_draft_tokens": 4, "num_accepted_draft_tokens": 2, "draft_s": 0.1, "target_s": 0.5},
            {"token_ids": [1, 2, 9, 9], "output_tokens": 4, "latency_s": 3.0, "ttft_s": 0.6, "tpot_s": 0.4,
             "num_steps": 3, "num_draft_tokens": 6, "num_accepted_draft_tokens": 1, "draft_s": 0.2, "target_s": 0.5}]
    ref = [[1, 2, 3, 4], [1, 2, 3, 4]]
    s = bspec.summarize(ours, ref)
    assert s["tpot_mean_s"] == pytest.approx(0.3) and s["decode_tokens_per_s"] == pytest.approx(1 / 0.3)
    assert s["ttft_mean_s"] == pytest.approx(0.5) and s["e2e_tokens_per_s"] == pytest.approx(8 / 4.0)
    assert s["acceptance_rate"] == pytest.approx(3 / 10) and s["decode_tokens_per_step"] == pytest.approx(8 / 5)
    assert s["outputs_equal_reference"] == 1 and s["mean_common_prefix_tokens"] == pytest.approx(3.0)
    assert s["runner_draft_s_per_decode_step"] == pytest.approx(0.3 / 5)
    hf = [{"token_ids": [1, 2, 3, 4, 5], "output_tokens": 5, "latency_s": 1.0, "ttft_s": 0.2, "tpot_s": 0.2,
           "num_steps": 3}]  # a plain first step, then 2 assisted steps emitting 4 tokens
    h = bspec.summarize(hf, None)
    assert h["decode_tokens_per_step"] == pytest.approx(2.0) and h["acceptance_rate_implied"] == pytest.approx(1.0)
    assert "outputs_equal_reference" not in h


def test_step_profile_parts_add_up_and_bound_the_ratio():
    """A step's timed regions become disjoint parts that add up to its wall time; the bounds read them per token."""
    ms = 1e-3
    k0 = {"runner": 1.0 * ms, "forward_target": 0.8 * ms, "layers_kernel": 0.6 * ms, "logits": 0.1 * ms,
          "schedule": 0.05 * ms, "update": 0.05 * ms, "detok_stop": 0.02 * ms, "callback": 0.03 * ms,
          "step": 1.2 * ms, "loop_gap": 0.01 * ms, "emitted": 1}
    k1 = dict(k0, runner=1.6 * ms, draft=0.4 * ms, mtp_kernel=0.3 * ms, step=1.8 * ms, emitted=2)
    for r in (k0, k1):
        parts = sprof.parts_of(r)
        assert sum(parts.values()) == pytest.approx(r["step"] + r["loop_gap"]) and min(parts.values()) >= 0
    assert sprof.parts_of(k1)["mtp_kernels"] == pytest.approx(0.3 * ms)
    base, spec = sprof.summarize([], [k0]), sprof.summarize([], [k1])
    assert base["kernels_s_per_step"] == pytest.approx(0.7 * ms) and spec["kernels_s_per_step"] == pytest.approx(ms)
    b = sprof.bounds(spec, base)
    assert b["measured"] == pytest.approx((1.21 / 1) / (1.81 / 2))
    assert b["no_host"] == pytest.approx(0.7 / (1.0 / 2)) and b["free_drafts"] == pytest.approx(0.7 / (0.7 / 2))
    assert sprof.bounds(base, base)["measured"] == pytest.approx(1.0)


def test_verify_cost_splits_the_moe_increase_into_experts_and_tokens():
    """Medians per q and part, increases over q = 1, and the MoE fit recovering the costs the timings were made of."""
    samples = []
    for q, experts in [(1, [2, 2]), (1, [2, 2]), (2, [3, 4]), (2, [4, 4]), (3, [5, 4]), (3, [4, 6])]:
        us = dict.fromkeys((name for name, _ in vcost.PARTS), 10.0 * q)
        us["moe"] = sum(1.0 + 5.0 * e + 2.0 * q for e in experts)  # per layer: 1 + 5 per expert + 2 per token
        samples.append({"q": q, "us": us, "experts": experts})
    s = vcost.summarize(samples, [1, 2, 3])
    assert s["us"][3]["stack"] == 30.0 and s["over_q1_us"][2]["o"] == 10.0 and s["over_q1_us"][1]["q_a"] == 0.0
    assert s["distinct_experts_per_moe_layer"] == {1: 2.0, 2: 3.75, 3: 4.75}
    fit = s["moe_fit_us_per_layer"]
    assert (fit["constant"], fit["per_distinct_expert"], fit["per_token"]) == pytest.approx((1.0, 5.0, 2.0))


def test_speculative_expected_tokens():
    assert bspec.expected_tokens(0.5, 0) == pytest.approx(1.0)
    assert bspec.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert bspec.expected_tokens(1.0, 3) == pytest.approx(4.0, rel=1e-4)  # a -> 1: k + 1


def test_repeated_ngram_fraction():
    assert ma.repeated_ngram_fraction([1, 2, 3, 4], [1, 2, 3, 4], n=4) == pytest.approx(1 / 4)  # only (1,2,3,4)
    assert ma.repeated_ngram_fraction([], [5, 6], n=4) == 0.0
    assert ma.repeated_ngram_fraction([7, 7, 7], [7, 7], n=2) == 1.0


def test_load_test_make_requests():
    tok = SimpleNamespace(bos_token_id=0, encode=lambda text: [0] + [int(w) for w in text.split()])
    texts = [{"source": "a", "text": " ".join(str(i) for i in range(10, 40))},
             {"source": "b", "text": " ".join(str(i) for i in range(50, 90))}]
    reqs = lt.make_requests(texts, tok, 30, 12, 5, seed=3)
    assert [r["id"] for r in reqs] == list(range(30))
    for r in reqs:
        assert r["prompt_ids"][0] == 0 and 0 not in r["prompt_ids"][1:] and 1 <= len(r["prompt_ids"]) <= 12
        assert 1 <= r["max_tokens"] <= 5
    assert reqs == lt.make_requests(texts, tok, 30, 12, 5, seed=3)


@pytest.mark.parametrize("argv, flag", [
    (["--modes", "plain,turbo"], "--modes"), (["--concurrency", "0"], "--concurrency"),
    (["--max_output_tokens", "0"], "--max_output_tokens"), (["--kv_cache_tokens", "0"], "--kv_cache_tokens"),
    (["--modes", "fixed", "--k", "0"], "--k"), (["--timeout", "-1"], "--timeout")])
def test_load_test_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        lt.parse_args(argv)
    assert e.value.code == 2 and f"error: {flag}" in capsys.readouterr().err


# ---- smoke runs ---------------------------------------------------------------------------------
def _run_benchmark(module: str, args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    return subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _no_temporaries(out_dir: Path) -> None:
    assert not [p.name for p in out_dir.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]


def test_benchmark_serving_smoke(shipped_model_dir, tmp_path):
    levels, n_min, n_max = [1, 2], 2, 4
    r = _run_benchmark("serving", [
        "--model", str(shipped_model_dir), "--out_dir", str(tmp_path), "--name", "smoke", "--threads", "1",
        "--concurrency", "1,2", "--num_requests", "2", "--requests_per_client", "1", "--rounds", "2", "--qps", "50",
        "--qps_requests", "2", "--min_tokens", str(n_min), "--max_tokens", str(n_max), "--timeout", "120"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.md").is_file()
    assert (tmp_path / "smoke.png").is_file() or "plot_error" in res
    _no_temporaries(tmp_path)
    assert {"benchmark", "settings", "machine", "engine", "concurrency_sweep", "qps_sweep", "targets"} <= set(res)
    modes = res["settings"]["modes"]
    assert modes == ["plain", "fixed", "adaptive"] and res["settings"]["qps"] == [50.0]
    assert [row["concurrency"] for row in res["concurrency_sweep"]] == levels
    n_prompts = res["settings"]["prompts"]
    sweeps = [(row, 2 * bs.make_requests([[0]] * n_prompts, 2, n_min, n_max, seed=c)) for row, c in
              zip(res["concurrency_sweep"], levels)]  # 2 rounds of the same requests, pooled
    sweeps += [(res["qps_sweep"][0], bs.make_requests([[0]] * n_prompts, 2, n_min, n_max, seed=10_000))]
    for row, reqs in sweeps:
        for m in modes:
            s = row[m]
            assert s["completed"] == s["requests"] == len(reqs) and s["errors"] == [], (m, s)
            assert s["output_tokens"] == sum(n for _, n in reqs)  # ignore_eos: every request ran to its length
            assert s["output_tokens_per_s"] > 0 and s["requests_per_s"] > 0
            assert 0 < s["ttft_mean_s"] <= s["latency_mean_s"] and s["ttft_p50_s"] <= s["ttft_p99_s"]
            assert 0 < s["tpot_p50_s"] <= s["tpot_p99_s"] and s["tpot_mean_s"] > 0
            assert s["decode_tokens_per_step"] >= 1
            if m == "plain":
                assert s["acceptance_rate"] is None and s["drafts_per_decode_step"] == 0
                assert s["tok_s_vs_plain"] == 1.0 and s["tpot_speedup_vs_plain"] == 1.0
            else:
                assert s["tok_s_vs_plain"] > 0 and s["tpot_speedup_vs_plain"] > 0
            if m == "fixed":  # k 1 every step: it drafted
                assert 0 <= s["acceptance_rate"] <= 1 and s["drafts_per_decode_step"] > 0
            if m == "adaptive":  # its k follows measured step costs: it may have chosen not to draft
                assert s["acceptance_rate"] is None or 0 <= s["acceptance_rate"] <= 1
    assert {t["target"] for t in res["targets"]} == {
        "adaptive vs plain output tok/s, worst concurrency level",
        "adaptive vs plain output tok/s, worst level at concurrency <= 4",
        "adaptive vs plain TPOT speed-up, worst Poisson rate (info)"}


def test_openai_serving_smoke(shipped_model_dir, tmp_path):
    """dsv3-serve next to the Session at the tiniest settings: both paths measured for both modes, ratios and
    targets written, the server's log directory gone."""
    pytest.importorskip("fastapi")
    r = _run_benchmark("openai_serving", ["--model", str(shipped_model_dir), "--out_dir", str(tmp_path), "--name",
                                          "oai", "--threads", "1", "--requests", "1", "--rounds", "2",
                                          "--max_tokens", "6"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "oai.json").read_text())
    assert (tmp_path / "oai.md").read_text().startswith("# OpenAI server (dsv3-serve) vs Session")
    _no_temporaries(tmp_path)
    assert set(res["results"]) == {"plain", "mtp"} and len(res["targets"]) == 2
    for mode in res["results"].values():
        assert mode["server"]["tpot_s"] > 0 and mode["session"]["tpot_s"] > 0
        assert mode["server_over_session_tpot"] == pytest.approx(mode["server"]["tpot_s"] / mode["session"]["tpot_s"],
                                                                 rel=1e-3)
    assert res["machine"]["command"].startswith("python -m benchmarks.openai_serving ")


def test_load_test_smoke(shipped_model_dir, tmp_path):
    n = 6
    r = _run_benchmark("load_test", [
        "--model", str(shipped_model_dir), "--out_dir", str(tmp_path), "--name", "lt", "--threads", "1",
        "--num_requests", str(n), "--concurrency", "3", "--max_prompt_tokens", "24", "--max_output_tokens", "6",
        "--max_num_tokens", "16", "--timeout", "150"])
    res = json.loads((tmp_path / "lt.json").read_text())
    assert r.returncode == 0 and res["passed"] is True and res["failures"] == [], (res.get("failures"), r.stderr[-3000:])
    assert (tmp_path / "lt.md").read_text().startswith("# Load test: PASSED")
    _no_temporaries(tmp_path)
    assert set(res["modes"]) == {"plain", "fixed", "adaptive"}
    assert sum(res["reference"]["finish_reasons"].values()) == n
    for m, s in res["modes"].items():
        assert all(s["checks"].values()), (m, s["checks"])
        assert s["completed"] == n and s["incomplete"] == [] and s["errors"] == [] and s["mismatches"] == []
        es = s["end_stats"]
        assert es["kv_blocks_used"] == 0 and es["kv_blocks_free"] == es["kv_blocks_total"] > 0
        assert es["free_list_intact"] and es["running"] == 0 and es["queued"] == 0
        assert es["requests_finished"] == n and s["output_tokens"] == es["generated_tokens"] > 0
        if m != "plain":
            assert 0 <= s["acceptance_rate"] <= 1


def test_soak_rss_checks_tell_a_plateau_from_a_leak():
    """A process that reaches a high-water mark after the baseline fails the start-to-end bound but not the
    second-half rate; one that starts climbing late fails the rate while its start-to-end growth is under 10%;
    noise fails neither; a short run fits no rate."""
    import benchmarks.soak_common as st

    load_s, every = 1800.0, 60.0
    curves = {1: lambda t: 160_000 if t >= 300 else 100_000 + 250 * t,  # kB: its peak 5 minutes in, then flat
              2: lambda t: 100_000 + 15 * max(0.0, t - 1200),  # flat, then 15 kB/s for the last 10 minutes
              3: lambda t: 50_000 + (1_500 if int(t / every) % 2 else 0)}  # +-3% noise
    pids = {1: "plateau", 2: "late leak", 3: "noise"}

    def at(t: float, phase: str) -> dict:
        return {"phase": phase, "at_s": t, "rss_kb": {pid: f(t) for pid, f in curves.items()},
                "shmem_kb": {pid: 2_000 + t for pid in curves}}

    samples = [at(0.0, "idle"), at(0.0, "primed"), *[at(float(t), "load") for t in np.arange(every, load_s, every)]]
    start_index = [x["at_s"] for x in samples].index(120.0, 2)
    end = {pid: f(load_s) for pid, f in curves.items()}
    end_shmem = {pid: 9_000 for pid in curves}
    rows = {r["process"]: r for r in st.rss_table(pids, samples, start_index, end, end_shmem, load_s)}
    p, leak, noise = rows["plateau"], rows["late leak"], rows["noise"]
    assert (p["start_kb"], p["end_kb"]) == (130_000, 160_000) and p["over_limit"]
    assert (p["start_shmem_kb"], p["end_shmem_kb"]) == (2_120, 9_000)  # reported, not judged
    assert p["second_half_kb_per_h"] == pytest.approx(0, abs=1e-6) and not p["still_growing"]
    assert leak["growth"] == pytest.approx(0.09) and not leak["over_limit"]
    assert leak["second_half_kb_per_h"] > 20_000 and leak["still_growing"]
    assert not noise["over_limit"] and not noise["still_growing"]
    short = [x for x in samples if x["at_s"] <= 120.0]
    row = st.rss_table(pids, short, len(short) - 1, end, end_shmem, 150.0)[0]
    assert row["second_half_kb_per_h"] is None and not row["still_growing"]


def test_soak_rss_reads_proc_status_as_the_runtime_does():
    """The soaks' memory samples and the executor's rss_bytes read /proc/<pid>/status through one function
    (lifetime.status_kb): kB, None for a process gone."""
    import benchmarks.soak_common as st
    from runtime.executors.lifetime import rss_bytes, status_kb

    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    kb = st.rss_kb({os.getpid(): "me", gone.pid: "gone"})
    assert kb[gone.pid] is None and status_kb(gone.pid, "VmRSS") is None and rss_bytes(gone.pid) == 0
    assert abs(kb[os.getpid()] * 1024 - rss_bytes(os.getpid())) < 64 << 20  # read a moment apart
    assert st.rss_kb({os.getpid(): "me"}, "RssShmem")[os.getpid()] == status_kb(os.getpid(), "RssShmem")


# the llmapi soak's bad requests that serving/triton/llmapi_request.py refuses (the others are refused by Triton, the
# executor or the model's stop handling: the llmapi smoke test sends them to the real server)
LLMAPI_REQUEST_REFUSALS = ["max_tokens_zero", "temperature_negative", "top_k_negative", "top_p_above_one", "top_p_nan",
                           "frequency_penalty_past_limit", "best_of_greedy", "text_input_too_long", "text_input_not_utf8",
                           "text_input_missing", "two_prompts", "too_many_stops", "image_url"]


@pytest.mark.parametrize("case", LLMAPI_REQUEST_REFUSALS)
def test_soak_llmapi_bad_requests_expect_llmapi_requests_refusals(case, monkeypatch):
    """Each such bad kind of `soak_test --flavour llmapi`, over every transport it picks, its values converted as its
    gRPC client converts them (no batch dimension), and read by llmapi_request as the llmapi model reads them: the
    refusal is the one the soak expects (a message changed on one side fails here, not minutes into a soak), and
    LLMAPI_GOOD, which each case departs from, is served."""
    pytest.importorskip("tritonclient.grpc")
    import random

    import benchmarks.soak_test as st
    from serving.request_validation import RequestError
    from serving.triton.llmapi_request import llmapi_request

    max_bytes = 1000

    def model(values: dict) -> st.Reply:
        try:
            llmapi_request(st.grpc_arrays(values, batched=False), max_bytes)
        except RequestError as e:
            return st.Reply(error=str(e), status=400)
        return st.Reply(text=b"served", status=200)

    sent = []
    monkeypatch.setattr(st, "grpc_stream", lambda ctx, name, values, **kw: sent.append("grpc") or model(values))
    monkeypatch.setattr(st, "http_generate", lambda ctx, name, body: sent.append("generate") or model(body))
    monkeypatch.setattr(st, "http_sse", lambda ctx, name, body: sent.append("sse") or model(body))
    ctx = st.Ctx(None, st.FLAVOURS["llmapi"], SimpleNamespace(vocab_size=1000, max_text_bytes=lambda n: max_bytes), 64,
                 [], [], {})
    assert model(st.LLMAPI_GOOD).error is None
    run = st.LLMAPI_KINDS[f"bad_{case}"][1]
    for seed in range(12):
        assert run(ctx, random.Random(seed)).outcome == "expected_refusal"
    assert set(sent) in ({"grpc"}, {"generate", "sse"}, {"grpc", "generate", "sse"}), sent


def test_soak_llmapi_streamed_text_is_the_whole_text_so_far():
    """The llmapi flavour's streamed text_output is the whole text so far: each must extend the previous (the reply
    keeps the last); the legacy flavour's are added up. Its requests use the llmapi model's input names."""
    pytest.importorskip("tritonclient.grpc")
    import benchmarks.soak_test as st

    legacy, llmapi = st.FLAVOURS["legacy"], st.FLAVOURS["llmapi"]
    reply = st.Reply()
    for text in (b"Hel", b"Hello", b"Hello"):
        reply.add_text(text, llmapi.cumulative)
    assert reply.text == b"Hello"
    with pytest.raises(st.Unexpected, match="does not extend"):
        reply.add_text(b"Help", llmapi.cumulative)
    reply = st.Reply()
    for text in (b"Hel", b"lo"):
        reply.add_text(text, legacy.cumulative)
    assert reply.text == b"Hello"
    ctx = SimpleNamespace(flavour=llmapi)
    assert st.text_request(ctx, None, "hi", max_tokens=4, stream=True, num_draft_tokens=0) == {
        "text_input": "hi", "sampling_param_max_tokens": 4, "sampling_param_exclude_input_from_output": True,
        "sampling_param_num_draft_tokens": 0, "streaming": True}
    inputs = {f"sampling_param_{name}" for name in ("max_tokens", "temperature", "top_p", "seed", "num_draft_tokens",
                                                     "exclude_input_from_output")} | {"streaming"}
    assert set(llmapi.names.values()) == inputs  # each an input the llmapi model declares
    from serving.triton.llmapi_request import INPUTS
    assert inputs <= INPUTS


@pytest.mark.parametrize("soak, name", [("soak_openai", "soak_openai"), ("soak_openai", "soak_openai_engine_process"),
                                        ("soak_test", "soak_llmapi_quick")])
def test_soak_report_is_the_one_written_with_its_results(soak, name):
    """The report the OpenAI soak (and the Triton soak's llmapi flavour) writes, from the results it wrote with it
    (docs/benchmarks): the soaks' shared report (soak_common.report_md) gives it byte for byte."""
    if soak == "soak_test":
        pytest.importorskip("tritonclient.grpc")
    import importlib

    markdown = importlib.import_module(f"benchmarks.{soak}").markdown
    docs = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
    assert markdown(json.loads((docs / f"{name}.json").read_text())) + "\n" == (docs / f"{name}.md").read_text()


def _soak_test_smoke(model_dir: Path, out: Path, title: str, *flags: str) -> dict:
    """A few seconds of `soak_test` at concurrency 4 (with `flags`), and what both flavours' smoke tests check of its
    results: every kind sent, nothing unexpected, every check but memory's (not judged this short) passed, every KV
    block free, every cancel in the executor, each process alive and sampled."""
    pytest.importorskip("tritonclient.grpc")
    r = _run_benchmark("soak_test", ["--engine_dir", str(model_dir), "--out", str(out / "soak"), "--minutes", "0.2",
                                     "--concurrency", "4", *flags], timeout=300)
    res = json.loads((out / "soak.json").read_text())
    assert r.returncode == (0 if res["passed"] else 1), r.stderr[-3000:]
    assert (out / "soak.md").read_text().startswith(f"# {title}: ")
    _no_temporaries(out)
    checks = res["checks"]
    for c in ("no_unexpected_errors", "no_probe_mismatches", "clients_stopped", "server_processes_alive",
              "kv_blocks_all_free", "cancels_reached_the_executor", "healthy_at_end", "no_stub_crash_in_log"):
        assert checks[c], (c, res["unexpected_errors"], res["mismatches"], res["end"])
    assert checks["clean_shutdown"] == (res["server_exit_status"] == 0)
    assert res["settings"]["concurrency"] == 4 and res["settings"]["host"] == "127.0.0.1"
    assert res["priming"]["kinds_sent"] == {k: 4 for k in res["kinds"]}  # every kind, by every client, before the load
    assert checks["rss_second_half_rate_within_10%"] is None  # a 12 s run has too few samples to fit a rate
    req = res["requests"]
    assert req["total"] == sum(k["requests"] for k in res["kinds"].values()) > 0 and req["served"] > 0
    assert req["by_outcome"].get("unexpected_error", 0) == 0 and res["unexpected_errors"] == {}
    assert all(k["weight"] > 0 for k in res["kinds"].values()) and "probe_greedy" in res["kinds"]
    lat = res["latency"]["all"]
    assert 0 < lat["latency_p50_s"] <= lat["latency_p99_s"]
    assert all(p["alive"] and p["start_kb"] > 0 and p["end_kb"] > 0 for p in res["rss"]["processes"])
    kv = res["end"]["kv_blocks"]
    assert kv["used"] == 0 and kv["free"] == kv["max"] > 0
    assert res["cancellation"]["executor_cancelled"] == res["cancellation"]["cancels_and_disconnects"] > 0
    assert res["machine"]["git_commit"]
    assert res["machine"]["command"].startswith("python -m benchmarks.soak_test --engine_dir ")
    return res


def test_soak_test_smoke(shipped_model_dir, tmp_path):
    """A few seconds of the soak's mixed load on the real tritonserver (the legacy repository): every kind is sent,
    nothing unexpected comes back, and the results hold the figures the soak reports."""
    res = _soak_test_smoke(shipped_model_dir, tmp_path, "Soak test")
    assert res["flavour"] == "legacy" and "repo_values" in res["settings"]
    names = {p["process"] for p in res["rss"]["processes"]}
    bls = {n for n in names if n.startswith("stub tensorrt_llm_bls_")}  # Triton: <model>_<i>_<device>
    assert names - bls == {"tritonserver", "stub preprocessing_0_0", "stub postprocessing_0_0", "stub tensorrt_llm_0_0"}
    assert len(bls) == 8  # make_model_repo's bls_instance_count


def test_soak_test_llmapi_smoke(shipped_model_dir, tmp_path):
    """The same with --flavour llmapi: the llmapi repository's one decoupled tensorrt_llm over every surface, its
    stop requests by id and each bad request's exact refusal; the memory and KV checks cover its processes."""
    res = _soak_test_smoke(shipped_model_dir, tmp_path, "Soak test, llmapi flavour", "--flavour", "llmapi")
    assert res["flavour"] == "llmapi" and res["settings"]["model_yaml"]["triton_config"]["decoupled"] is True
    assert {"stop_by_id", "cancel_grpc", "disconnect_http_sse", "bad_unary_infer_on_decoupled"} <= set(res["kinds"])
    assert res["priming"]["by_outcome"]["expected_refusal"] == 4 * sum(k.startswith("bad_") for k in res["kinds"])
    assert set(res["kinds"]["stop_by_id"]["outcomes"]) <= {"cancelled"}  # priming's 4 too: no unexpected error
    assert res["settings"]["cancel_prompts"] > 0
    names = {p["process"] for p in res["rss"]["processes"]}
    assert {"tritonserver", "stub tensorrt_llm_0_0"} <= names  # and the engine's own process where it has one
    assert all(n.startswith("under stub tensorrt_llm_0_0: runtime.executors.") for n in names
               - {"tritonserver", "stub tensorrt_llm_0_0"})


def test_the_soaks_name_our_children_by_their_module():
    """The soaks found an engine's processes by `-m` in their command lines, which python_module's do not have: the
    Triton soak sampled none of them."""
    from runtime.executors.lifetime import module_run_by, python_module

    argv = [a.encode() for a in python_module("runtime.executors.process")] + [b"7"]
    assert module_run_by(argv) == "runtime.executors.process"
    assert module_run_by([b"python", b"-m", b"runtime.executors.process", b"7"]) is None
    assert module_run_by(argv[:3]) is None  # the runner's code with nothing after it


def test_soak_openai_smoke(shipped_model_dir, tmp_path):
    """A few seconds of the OpenAI soak's mixed load on dsv3-serve with its executor in a process of its own: every
    kind is sent, every bad request gets its exact refusal, probes match, every KV block is free, each disconnect
    reaches the server, and SIGTERM leaves no process behind (memory growth is not judged this short)."""
    pytest.importorskip("openai")
    r = _run_benchmark("soak_openai", ["--model", str(shipped_model_dir), "--out", str(tmp_path / "soak"),
                                       "--minutes", "0.2", "--concurrency", "4", "--engine_process"], timeout=300)
    res = json.loads((tmp_path / "soak.json").read_text())
    assert r.returncode == (0 if res["passed"] else 1), r.stderr[-3000:]
    assert (tmp_path / "soak.md").read_text().startswith("# OpenAI server soak test, engine process: ")
    _no_temporaries(tmp_path)
    checks = res["checks"]
    for c in ("no_unexpected_errors", "no_probe_mismatches", "clients_stopped", "server_processes_alive",
              "kv_blocks_all_free", "disconnects_reached_the_server", "healthy_at_end", "no_error_in_log",
              "clean_shutdown"):
        assert checks[c], (c, res["unexpected_errors"], res["mismatches"], res["end"], res["shutdown"])
    assert checks["rss_second_half_rate_within_10%"] is None  # a 12 s run has too few samples to fit a rate
    assert res["priming"]["kinds_sent"] == {k: 4 for k in res["kinds"]}  # every kind, by every client, before the load
    assert res["priming"]["by_outcome"]["expected_refusal"] == 4 * sum(k.startswith("bad_") for k in res["kinds"])
    req = res["requests"]
    assert req["total"] == sum(k["requests"] for k in res["kinds"].values()) > 0 and req["served"] > 0
    assert req["by_outcome"].get("unexpected_error", 0) == 0 and req["openai_client"]
    assert res["cancellation"]["logged_client_disconnected"] == res["cancellation"]["cancels_and_disconnects"] > 0
    assert set(res["end"]["probes"].values()) == {"ok"} and len(res["end"]["probes"]) == 12
    server, engine = sorted(p["process"] for p in res["rss"]["processes"])
    assert server == "dsv3-serve" and engine == "under dsv3-serve: runtime.executors.process"
    assert all(p["alive"] and p["start_kb"] > 0 for p in res["rss"]["processes"])
    assert res["shutdown"]["exit_status"] == 0 and res["shutdown"]["children_left"] == []
    assert res["end"]["gauges"]["kv_used"] == 0 and res["end"]["gauges"]["kv_free"] > 0
    assert res["machine"]["command"].startswith("python -m benchmarks.soak_openai --model ")


def test_prefix_cache_smoke(shipped_model_dir, tmp_path):
    """Both measurements at the tiniest settings: the cached prefix and the chat's later turns reuse blocks with
    reuse on, nothing with it off, and the TTFT target is reported."""
    r = _run_benchmark("prefix_cache", [
        "--model", str(shipped_model_dir), "--out_dir", str(tmp_path), "--name", "pc", "--threads", "1",
        "--prefix_tokens", "40", "--conversations", "2", "--turns", "2", "--system_tokens", "20",
        "--question_tokens", "4", "--max_tokens", "3", "--rounds", "1"], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "pc.json").read_text())
    assert (tmp_path / "pc.md").read_text().startswith("# Prefix caching (KV block reuse) with MTP")
    _no_temporaries(tmp_path)
    ttft, chat = res["ttft"], res["chat"]
    assert ttft["cold"]["reused_blocks"] == [0] and ttft["cached"]["reused_blocks"] == [2]  # 40 tokens: 2 full blocks
    assert ttft["speedup"] == pytest.approx(ttft["cold"]["ttft_mean_s"] / ttft["cached"]["ttft_mean_s"])
    assert chat["off"]["hit_rate"] == 0 and 0 < chat["on"]["hit_rate"] < 1
    for name in ("on", "off"):
        assert [x["requests"] for x in chat[name]["rounds"]] == [4] and chat[name]["output_tokens_per_s"] > 0
    assert [t["target"] for t in res["targets"]] == ["TTFT, 40-token prefix cached vs not"]
    assert res["machine"]["command"].startswith("python -m benchmarks.prefix_cache ")


def test_fp8_gpu_modes_must_name_known_modes_and_the_fp32_reference(capsys):
    from benchmarks import fp8_gpu
    for modes in ("bf16,fp8", "fp32,fp4"):
        with pytest.raises(SystemExit) as e:
            fp8_gpu.main(["--modes", modes])
        assert e.value.code == 2
        assert (f"--modes: names of fp32, bf16, fp8, fp8_dequantize including fp32 (the reference), got {modes!r}"
                in capsys.readouterr().err)


@pytest.mark.parametrize("module, argv, message", [
    ("fp8_gpu", ["--dtype", "float16"], "--dtype: each mode sets its own (--modes), got 'float16'"),
    ("verify_cost", ["--device", "cuda"], "--device / --dtype: this benchmark times the CPU kernels on the engine's "
                                          "own weights, got --device 'cuda' --dtype None"),
    ("verify_cost", ["--dtype", "bfloat16"], "--device / --dtype: this benchmark times the CPU kernels on the "
                                             "engine's own weights, got --device 'cpu' --dtype 'bfloat16'"),
])
def test_benchmarks_refuse_device_and_dtype_flags_they_would_ignore(capsys, module, argv, message):
    """verify_cost ran on the CPU at the engine's dtype whatever --device / --dtype said, and fp8_gpu's modes set the
    dtype whatever --dtype said: the result files claimed settings that were not used."""
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"benchmarks.{module}").main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("name, argv", [
    ("acceptance", ["--num_prompts", "2", "--max_tokens", "8", "--ks", "1,2"]),
    ("verify_cost", []),
    ("step_profile", ["--threads", "1", "--max_tokens", "8", "--ks", "0,1"]),
    ("speculative", ["--threads", "1", "--max_tokens", "8", "--ks", "0,1", "--num_prompts", "1", "--cost_repeats", "2",
                     "--no_hf"]),
])
def test_batch1_benchmarks_quick_runs_write_their_results(tmp_path, name, argv):
    """No test ran these scripts' main, so one that called a name the runtime had dropped (as structured_output did)
    would fail only when a person next measured: each quick run must end and write its result files."""
    run = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out_dir", str(tmp_path), *argv],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = sorted(p.suffix for p in tmp_path.iterdir())
    assert ".json" in results and ".md" in results, results
    assert json.loads(next(tmp_path.glob("*.json")).read_text())["machine"]["command"]
