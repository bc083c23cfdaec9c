"""The Triton contracts of upstream TensorRT-LLM, against the real tritonserver on loopback ports.

Two deployments of a tiny random DeepSeek-V3 + MTP checkpoint: the legacy flavour as upstream's
tools/inflight_batcher_llm/end_to_end_test.py deploys it (every model non-decoupled, so unary ModelInfer works on
`tensorrt_llm` and the ensemble), and the llmapi flavour (`make_model_repo --flavour llmapi`), decoupled and not.
Each model's inputs and outputs, as its model configuration endpoint reports them, are compared with the tables in
tests/data/upstream_triton_contract.json, copied from upstream's config.pbtxt files; outputs are compared with an
in-process runtime.Session on the same checkpoint.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import yaml

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")

from builder.trtllm_engine import TrtllmOptions, llm_api_options  # noqa: E402
from runtime.core.sampling_params import GuidedDecodingParams, RelaxedAcceptance, SamplingParams  # noqa: E402
from runtime.executors.session import Session  # noqa: E402
from runtime.io.engine_format import read_limits  # noqa: E402
from serving.request_validation import RequestError, refuse_unsupported  # noqa: E402
from serving.triton.contract import GUIDED_INPUTS, UNSUPPORTED_ENGINE_INPUTS  # noqa: E402
from serving.triton.llmapi_config import ModelYamlError, read_model_yaml  # noqa: E402
from serving.triton.model_repo import add_llmapi_model  # noqa: E402
from serving.triton.parameters import TritonConfig  # noqa: E402
from runtime.executors.base import ExecutorConfig  # noqa: E402
from test_triton import DTYPES, Streamed, grpc_inputs, http_generate, metric, metrics, wait_for  # noqa: E402
from triton_util import (PROMPTS as ALL_PROMPTS, TEMPLATE_REPO, TOKENS, TritonServer, add_model,  # noqa: E402
                         assert_no_stub_crash, fill_model_repo, repo_values, start_server)

UPSTREAM = json.loads((Path(__file__).parent / "data" / "upstream_triton_contract.json").read_text())
PROMPTS = ALL_PROMPTS[:4]  # the legacy and llmapi models are compared on these
CONFIG_DTYPES = {"TYPE_STRING": "STRING", "TYPE_BOOL": "BOOL", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64",
                 "TYPE_UINT8": "UINT8", "TYPE_UINT64": "UINT64", "TYPE_FP16": "FP16", "TYPE_FP32": "FP32"}


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def unary(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """The legacy flavour, every model non-decoupled (upstream end_to_end_test.py's deployment), prefix caching off
    (enable_kv_cache_reuse false); and tensorrt_llm_bounded with a BLS of its own."""
    work = tmp_path_factory.mktemp("contract_unary")
    repo = fill_model_repo(work / "repo", repo_values(checkpoint, decoupled_mode="false",
                                                      enable_kv_cache_reuse="false"))
    # a batch of one and a queue bound of one, drafting nothing (a slow request): for load shedding end to end
    add_model(repo, TEMPLATE_REPO / "tensorrt_llm", repo_values(checkpoint, decoupled_mode="false", max_queue_size="1",
                                                               executor_max_batch_size="1", num_draft_tokens="0"),
              name="tensorrt_llm_bounded")
    add_model(repo, TEMPLATE_REPO / "tensorrt_llm_bls", repo_values(
        checkpoint, decoupled_mode="false", bls_instance_count="1", tensorrt_llm_model_name="tensorrt_llm_bounded"),
        name="tensorrt_llm_bls_bounded")
    srv = start_server(repo, log_file=work / "server.log", ready_timeout_s=240, exit_timeout_s=3)
    try:
        yield srv
    finally:
        srv.stop()
    assert_no_stub_crash(srv)


@pytest.fixture(scope="module")
def llmapi(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """The llmapi flavour: `tensorrt_llm` decoupled, and the same model non-decoupled as `tensorrt_llm_unary`."""
    work = tmp_path_factory.mktemp("contract_llmapi")
    (work / "repo").mkdir()
    for name, decoupled in (("tensorrt_llm", True), ("tensorrt_llm_unary", False)):
        model = add_llmapi_model(work / "repo", checkpoint, decoupled=decoupled, name=name)
        doc = yaml.safe_load((model / "1" / "model.yaml").read_text())
        # the executor in its own process (the default on CUDA devices; the legacy flavour's tests run one process)
        doc["triton_config"].update(speculation="fixed", cancellation_check_period_ms=20, engine_process=True)
        (model / "1" / "model.yaml").write_text(yaml.safe_dump(doc))
    srv = start_server(work / "repo", log_file=work / "server.log", ready_timeout_s=240, exit_timeout_s=3)
    try:
        yield srv
    finally:
        srv.stop()
    assert_no_stub_crash(srv)


def llmapi_stream(server: TritonServer, model: str, request_id: str = "", on_first: Any = None,
                  **values: Any) -> Streamed:
    """One request over gRPC streaming with its inputs shaped as given (the llmapi model's max_batch_size is 0: no
    batch dimension); `on_first()` runs after the first response."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = []
    for name, arr in values.items():
        inputs.append(grpcclient.InferInput(name, list(arr.shape), DTYPES[arr.dtype]))
        inputs[-1].set_data_from_numpy(arr)
    out = Streamed()
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=60)
            if error is not None:
                out.error, out.status = error.message(), error.status()
                return out
            if result.as_numpy("text_output") is not None:
                out.chunks += list(result.as_numpy("text_output"))
            if result.as_numpy("finish_reason") is not None:
                out.finish_reason = result.as_numpy("finish_reason")[0].decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out
            if on_first is not None and len(out.chunks) == 1:
                on_first()
    finally:
        client.stop_stream()
        client.close()


def declared(server: TritonServer, model: str) -> dict[str, dict[str, list]]:
    """The model's inputs and outputs as its model configuration endpoint reports them: name -> [dtype, dims]."""
    config = grpcclient.InferenceServerClient(server.grpc_url).get_model_config(model, as_json=True)["config"]
    return {section: {t["name"]: [CONFIG_DTYPES[t["data_type"]], [int(d) for d in t["dims"]]]
                      for t in config[section]} for section in ("input", "output")}


def infer(server: TritonServer, model: str, outputs: list[str] | None = None, **values: Any) -> Any:
    """Unary ModelInfer over HTTP, as end_to_end_test.py (--protocol http) calls each model."""
    inputs = []
    for name, arr in values.items():
        arr = np.asarray(arr)
        if arr.dtype.kind in "US":
            arr = arr.astype(object)
        inputs.append(httpclient.InferInput(name, list(arr.shape), DTYPES[arr.dtype]))
        inputs[-1].set_data_from_numpy(arr)
    return httpclient.InferenceServerClient(server.http_url).infer(
        model, inputs, outputs=[httpclient.InferRequestedOutput(n) for n in outputs or []] or None)


# ---- the legacy flavour -----------------------------------------------------------------------
@pytest.mark.parametrize("model", list(UPSTREAM["legacy"]))
def test_legacy_models_declare_every_upstream_tensor(unary: TritonServer, model: str) -> None:
    """Every input and output of upstream's inflight_batcher_llm model, with its data type and dims (this
    repository declares a few more: current upstream's return_num_*_tokens, the older min_length / random_seed)."""
    ours = declared(unary, model)
    for section, tensors in UPSTREAM["legacy"][model].items():
        for name, (dtype, dims) in tensors.items():
            assert ours[section].get(name) == [dtype, dims], (model, section, name, ours[section].get(name))


def test_num_draft_tokens_is_declared_as_upstreams_bls_declares_it(unary: TritonServer) -> None:
    """Upstream's BLS input num_draft_tokens (INT32 [1]) is the request's MTP draft cap; the ensemble and tensorrt_llm,
    whose upstream models have no such input, declare it the same way, for the ensemble's clients and for the BLS to
    pass it on."""
    upstream = UPSTREAM["legacy"]["tensorrt_llm_bls"]["input"]["num_draft_tokens"]
    assert upstream == ["INT32", [1]]
    assert "num_draft_tokens" not in UPSTREAM["legacy"]["ensemble"]["input"]
    assert "num_draft_tokens" not in UPSTREAM["legacy"]["tensorrt_llm"]["input"]
    for model in ("tensorrt_llm_bls", "ensemble", "tensorrt_llm"):
        assert declared(unary, model)["input"]["num_draft_tokens"] == upstream, model


def test_upstream_end_to_end_test_runs_unchanged(unary: TritonServer, expected: dict) -> None:
    """tools/inflight_batcher_llm/end_to_end_test.py: preprocessing, unary tensorrt_llm (with the padded decoder
    inputs it reads from preprocessing) and postprocessing by hand, then the ensemble and the BLS, all unary; the
    texts agree, and are the session's (after the prompt: exclude_input_in_output is false by default)."""
    for prompt in PROMPTS[:2]:
        pre = infer(unary, "preprocessing", QUERY=np.array([[prompt]], object),
                    BAD_WORDS_DICT=np.array([[""]], object), STOP_WORDS_DICT=np.array([[""]], object),
                    REQUEST_OUTPUT_LEN=np.array([[TOKENS]], np.int32))
        assert pre.as_numpy("DECODER_INPUT_ID").shape == (1, 1)
        engine = infer(unary, "tensorrt_llm", input_ids=pre.as_numpy("INPUT_ID"),
                       decoder_input_ids=pre.as_numpy("DECODER_INPUT_ID"),
                       input_lengths=pre.as_numpy("REQUEST_INPUT_LEN"),
                       request_output_len=pre.as_numpy("REQUEST_OUTPUT_LEN"),
                       end_id=pre.as_numpy("OUT_END_ID"), pad_id=pre.as_numpy("OUT_PAD_ID"))
        post = infer(unary, "postprocessing", TOKENS_BATCH=engine.as_numpy("output_ids").astype(np.int32),
                     SEQUENCE_LENGTH=engine.as_numpy("sequence_length"))
        output0 = post.as_numpy("OUTPUT")
        for model in ("ensemble", "tensorrt_llm_bls"):
            result = infer(unary, model, ["text_output"], text_input=np.array([[prompt]], object),
                           max_tokens=np.array([[TOKENS]], np.int32), bad_words=np.array([[""]], object),
                           stop_words=np.array([[""]], object))
            assert output0 == result.as_numpy("text_output"), model  # end_to_end_test.py's own check
        assert output0[0].decode() == prompt + expected[prompt].text


def test_unary_tensorrt_llm_shares_the_batch_and_takes_stop(unary: TritonServer, session: Session) -> None:
    """Non-decoupled tensorrt_llm answers from the executor's thread like the decoupled one, so execute() is free
    for more requests while one runs: TensorRT-LLM's `stop` request reaches a long unary request and ends it."""
    ids = session.tokenizer.encode(PROMPTS[0])
    inputs = dict(input_ids=np.array([ids], np.int32), input_lengths=np.array([[len(ids)]], np.int32),
                  request_output_len=np.array([[900]], np.int32), end_id=np.array([[-1]], np.int32))
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(r=infer_grpc(unary, "tensorrt_llm", "long", **inputs)))
    t0 = time.monotonic()
    worker.start()
    time.sleep(0.5)
    infer_grpc(unary, "tensorrt_llm", "long", input_ids=np.array([[0]], np.int32),
               input_lengths=np.array([[1]], np.int32), request_output_len=np.array([[1]], np.int32),
               stop=np.array([[True]]))
    worker.join(timeout=60)
    assert int(result["r"].as_numpy("sequence_length")[0][0]) < len(ids) + 900, "the stop did not reach it"
    assert time.monotonic() - t0 < 60


def test_a_full_queue_is_unavailable_naming_max_queue_size(unary: TritonServer, session: Session) -> None:
    """Load shedding through Triton: with one request running (a batch of one) and one waiting (max_queue_size 1), a
    third is refused with UNAVAILABLE naming the bound by its Triton name, for the client to retry, also through the
    BLS (it answered INTERNAL / 500); the server serves the others and the next request."""
    from tritonclient.utils import InferenceServerException

    ids = session.tokenizer.encode(PROMPTS[0])
    long = dict(input_ids=np.array([ids], np.int32), input_lengths=np.array([[len(ids)]], np.int32),
                request_output_len=np.array([[1000 - len(ids)]], np.int32), end_id=np.array([[-1]], np.int32))
    results: dict[str, Any] = {}
    workers = [threading.Thread(target=lambda rid=rid: results.update(
        {rid: infer_grpc(unary, "tensorrt_llm_bounded", rid, **long)})) for rid in ("running", "waiting")]

    def requests(kind: str) -> float:
        return metric(metrics(unary), "nv_trt_llm_request_metrics", model="tensorrt_llm_bounded", request_type=kind)

    for worker, kind in zip(workers, ("active", "waiting")):  # the second waits while the first runs
        worker.start()
        assert wait_for(lambda: requests(kind) >= 1), kind
    try:
        with pytest.raises(InferenceServerException) as e:
            infer_grpc(unary, "tensorrt_llm_bounded", **long)
        assert (e.value.status(), e.value.message()) == (
            "StatusCode.UNAVAILABLE", "the queue is full: 1 requests wait to be scheduled (max_queue_size); try again "
                                      "later")
        with pytest.raises(InferenceServerException) as e:  # relayed by the BLS (Triton made it INTERNAL there)
            infer(unary, "tensorrt_llm_bls_bounded", ["text_output"], text_input=np.array([["hi"]], object),
                  max_tokens=np.array([[4]], np.int32))
        assert e.value.status() == "503" and "(max_queue_size); try again later" in e.value.message(), e.value
    finally:
        for rid in ("running", "waiting"):
            infer_grpc(unary, "tensorrt_llm_bounded", rid, input_ids=np.array([[0]], np.int32),
                       input_lengths=np.array([[1]], np.int32), request_output_len=np.array([[1]], np.int32),
                       stop=np.array([[True]]))
        for worker in workers:
            worker.join(timeout=60)
    assert sorted(results) == ["running", "waiting"]
    short = dict(long, request_output_len=np.array([[4]], np.int32))
    assert int(infer_grpc(unary, "tensorrt_llm_bounded", **short).as_numpy("sequence_length")[0][0]) == len(ids) + 4


def test_enable_kv_cache_reuse_false_turns_prefix_caching_off(unary: TritonServer, session: Session) -> None:
    """TensorRT-LLM's legacy enable_kv_cache_reuse parameter is the executor's enable_block_reuse: deployed with it
    false, tensorrt_llm reuses no block of a prompt it has seen (by default it reuses the prompt's full blocks:
    test_triton.py's test_perf_metrics_and_token_counts_as_upstream)."""
    ids = session.tokenizer.encode(" ".join(PROMPTS * 3))
    inputs = dict(input_ids=np.array([ids], np.int32), input_lengths=np.array([[len(ids)]], np.int32),
                  request_output_len=np.array([[4]], np.int32), return_perf_metrics=np.array([[True]]))
    reused = [int(infer_grpc(unary, "tensorrt_llm", **inputs).as_numpy("kv_cache_reused_blocks")[0][0])
              for _ in range(2)]
    assert len(ids) > 32 and reused == [0, 0]


def infer_grpc(server: TritonServer, model: str, request_id: str = "", **values: Any) -> Any:
    return grpcclient.InferenceServerClient(server.grpc_url).infer(model, grpc_inputs(**values), request_id=request_id)


@pytest.mark.parametrize("model, name", [("ensemble", "streaming (stream)"), ("tensorrt_llm_bls", "stream")])
def test_unary_models_refuse_streaming_naming_the_input(unary: TritonServer, model: str, name: str) -> None:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as e:
        infer(unary, model, ["text_output"], text_input=np.array([["hi"]], object),
              max_tokens=np.array([[4]], np.int32), stream=np.array([[True]]))
    assert e.value.status() == "400" and (f"{name} true needs a decoupled model (this one is deployed with decoupled "
                                          "false: one response per request)") in str(e.value), e.value


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_unary_models_refuse_several_sequences_naming_the_input(unary: TritonServer, model: str) -> None:
    """A unary model sends one response per request; upstream's sends one per sequence. The BLS refuses it as
    tensorrt_llm does (serving.request_validation.check_response_count)."""
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as e:
        infer(unary, model, ["text_output"], text_input=np.array([["hi"]], object),
              max_tokens=np.array([[4]], np.int32), top_k=np.array([[40]], np.int32),
              num_return_sequences=np.array([[2]], np.int32))
    assert e.value.status() == "400" and ("num_return_sequences 2 needs a decoupled model (a response per sequence; "
                                          "this one is deployed with decoupled false)") in str(e.value), e.value


# ---- the llmapi flavour -----------------------------------------------------------------------
@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_unary"])
def test_llmapi_model_declares_upstreams_tensors_exactly(llmapi: TritonServer, model: str) -> None:
    upstream = UPSTREAM["llmapi"]["tensorrt_llm"]
    # plus the legacy model's guided decoding inputs (upstream's llmapi model has no structured output) and this
    # runtime's per-request draft length, typed as upstream's sampling_param_* integers
    guided = {name: UPSTREAM["legacy"]["tensorrt_llm"]["input"][name] for name in GUIDED_INPUTS}
    draft = {"sampling_param_num_draft_tokens": upstream["input"]["sampling_param_max_tokens"]}
    assert declared(llmapi, model) == {"input": {**upstream["input"], **guided, **draft}, "output": upstream["output"]}
    config = grpcclient.InferenceServerClient(llmapi.grpc_url).get_model_config(model).config
    assert config.max_batch_size == 0 and config.model_transaction_policy.decoupled == (model == "tensorrt_llm")


def test_llmapi_unary_matches_the_session(llmapi: TritonServer, expected: dict) -> None:
    """Greedy (no sampling input: the LLM API decodes greedily) over unary ModelInfer and the HTTP generate
    endpoint; text_output is flat [1], read as upstream's clients read it."""
    for prompt in PROMPTS:
        result = infer(llmapi, "tensorrt_llm_unary", text_input=np.array([prompt], object),
                       sampling_param_max_tokens=np.array([TOKENS], np.int32))
        assert result.as_numpy("text_output").shape == (1,)
        assert result.as_numpy("text_output")[0].decode() == expected[prompt].text
        status, body = http_generate(llmapi, "tensorrt_llm_unary", text_input=prompt, sampling_param_max_tokens=TOKENS)
        assert status == 200 and body["text_output"] == expected[prompt].text, body


def test_llmapi_guided_decoding_matches_the_session(llmapi: TritonServer, session: Session) -> None:
    """guided_decoding_guide_type / guided_decoding_guide (the legacy names): a regex-guided greedy output equal to the
    Session's under the same MTP drafting, in the regex's language; an invalid regex is refused naming the input and
    the position, and the model goes on serving."""
    from tritonclient.utils import InferenceServerException

    regex = r"[a-z]{1,6}( [a-z]{1,6}){2}\."
    want = session.generate(PROMPTS[0], SamplingParams(max_tokens=40, guided_decoding=GuidedDecodingParams(regex=regex)))
    guided = dict(text_input=np.array([PROMPTS[0]], object), sampling_param_max_tokens=np.array([40], np.int32),
                  guided_decoding_guide_type=np.array(["regex"], object))
    result = infer(llmapi, "tensorrt_llm_unary", **guided, guided_decoding_guide=np.array([regex], object))
    text = result.as_numpy("text_output")[0].decode()
    assert text == want[0].text and re.fullmatch(regex, text), (text, want[0].text)
    with pytest.raises(InferenceServerException) as e:
        infer(llmapi, "tensorrt_llm_unary", **guided, guided_decoding_guide=np.array(["ab(c"], object))
    assert "guided_decoding_guide is invalid at position 2: unclosed group" in str(e.value), e.value
    result = infer(llmapi, "tensorrt_llm_unary", **guided, guided_decoding_guide=np.array([regex], object))
    assert result.as_numpy("text_output")[0].decode() == text


def test_llmapi_streams_the_session_text(llmapi: TritonServer, expected: dict) -> None:
    """Decoupled, streaming: as upstream's model (the LLM API's CompletionOutput.text in every response), each
    response the whole text so far, on whole characters, growing to the session's text (it sent the new text alone,
    which a client written for upstream's model shows as only the latest fragment)."""
    for prompt in PROMPTS:
        out = llmapi_stream(llmapi, "tensorrt_llm", text_input=np.array([prompt.encode()], object),
                            streaming=np.array([True]), sampling_param_max_tokens=np.array([TOKENS], np.int32))
        assert out.error is None and len(out.chunks) > 1
        status, events = http_generate(llmapi, "tensorrt_llm", "generate_stream", text_input=prompt, streaming=True,
                                       sampling_param_max_tokens=TOKENS)
        assert status == 200 and len(events) > 1
        for texts in ([c.decode("utf-8") for c in out.chunks], [json.loads(e)["text_output"] for e in events]):
            assert texts[-1] == expected[prompt].text
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts


def test_llmapi_stop_request_ends_the_stream_and_is_answered_cancelled(llmapi: TritonServer) -> None:
    """Upstream's llmapi model: a `stop` request naming a running request's id aborts that request (its stream ends,
    finish_reason cancelled) and is itself answered with a CANCELLED error, "Request cancelled by client"."""
    stopped: dict[str, Streamed] = {}

    def stop() -> None:
        stopped["reply"] = llmapi_stream(llmapi, "tensorrt_llm", request_id="job-9", text_input=np.array([b""], object),
                                         stop=np.array([True]))

    out = llmapi_stream(llmapi, "tensorrt_llm", request_id="job-9", on_first=stop,
                        text_input=np.array([PROMPTS[0].encode()], object), streaming=np.array([True]),
                        sampling_param_max_tokens=np.array([900], np.int32), return_finish_reason=np.array([True]))
    assert stopped["reply"].error == "Request cancelled by client"  # a stream's error carries no code in 2.51
    assert out.error is None and out.finish_reason == "cancelled" and len(out.chunks) < 900, out
    reply = llmapi_stream(llmapi, "tensorrt_llm", text_input=np.array([b""], object), stop=np.array([True]))
    assert reply.error == "stop: a request id is needed to say which request to stop"
    from tritonclient.utils import InferenceServerException
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stop", [1], "BOOL")]
    inputs[0].set_data_from_numpy(np.array([b""], object))
    inputs[1].set_data_from_numpy(np.array([True]))
    with pytest.raises(InferenceServerException) as unary:  # unary over gRPC, the code arrives
        grpcclient.InferenceServerClient(llmapi.grpc_url).infer("tensorrt_llm_unary", inputs, request_id="job-10")
    assert (unary.value.status(), unary.value.message()) == ("StatusCode.CANCELLED", "Request cancelled by client")


def test_a_setting_the_machine_cannot_hold_fails_the_load_under_the_files_name(checkpoint: Path, tmp_path: Path) -> None:
    """A KV cache larger than the memory is refused when the engine model loads, with the names the model's file set it
    by (it said kv_cache_tokens and free_memory_fraction, the executor's): model.yaml's keys for the llmapi model,
    config.pbtxt's parameters for the legacy one."""
    repo = tmp_path / "repo"
    repo.mkdir()
    model = add_llmapi_model(repo, checkpoint, name="llmapi_too_big")
    doc = yaml.safe_load((model / "1" / "model.yaml").read_text())
    doc["kv_cache_config"] = {"max_tokens": 10**13}
    (model / "1" / "model.yaml").write_text(yaml.safe_dump(doc))
    add_model(repo, TEMPLATE_REPO / "tensorrt_llm", repo_values(checkpoint, max_tokens_in_paged_kv_cache=str(10**13)),
              name="legacy_too_big")
    with pytest.raises(RuntimeError) as e:
        start_server(repo, log_file=tmp_path / "server.log", ready_timeout_s=240, exit_timeout_s=3)
    log = (tmp_path / "server.log").read_text()
    assert "kv_cache_config.max_tokens 10000000000000 does not fit: " in log, str(e.value)
    assert "max_tokens_in_paged_kv_cache 10000000000000 does not fit: " in log, str(e.value)
    assert " bytes fit in kv_cache_config.free_gpu_memory_fraction 0.9 of the " in log
    assert " bytes fit in kv_cache_free_gpu_mem_fraction 0.9 of the " in log


def test_llmapi_finish_reason_stop_reason_and_perf_metrics(llmapi: TritonServer, expected: dict) -> None:
    """As upstream: finish_reason / stop_reason only when asked for (str() of the LLM API's values), the perf
    metrics only with sampling_param_return_perf_metrics."""
    prompt = next(p for p in PROMPTS if len(expected[p].text) > 8 and "\ufffd" not in expected[p].text[3:6])
    stop = expected[prompt].text[3:6]
    plain = infer(llmapi, "tensorrt_llm_unary", text_input=np.array([prompt], object),
                  sampling_param_max_tokens=np.array([4], np.int32))
    assert plain.as_numpy("finish_reason") is None and plain.as_numpy("acceptance_rate") is None
    result = infer(llmapi, "tensorrt_llm_unary", text_input=np.array([prompt], object),
                   sampling_param_max_tokens=np.array([TOKENS], np.int32),
                   sampling_param_stop=np.array([stop], object), return_finish_reason=np.array([True]),
                   return_stop_reason=np.array([True]), sampling_param_return_perf_metrics=np.array([True]))
    text = result.as_numpy("text_output")[0].decode()
    assert expected[prompt].text.startswith(text + stop)  # the stop string is cut, as the LLM API's default
    assert result.as_numpy("finish_reason")[0] == b"stop" and result.as_numpy("stop_reason")[0] == stop.encode()
    assert result.as_numpy("total_draft_tokens").shape == (1,) and result.as_numpy("total_draft_tokens")[0] > 0
    reused, missed = result.as_numpy("kv_cache_reused_block")[0], result.as_numpy("kv_cache_missed_block")[0]
    total = result.as_numpy("kv_cache_alloc_total_blocks")[0]
    assert reused + missed >= 1 and result.as_numpy("kv_cache_hit_rate")[0] == pytest.approx(reused / (reused + missed))
    assert total >= 1 and result.as_numpy("kv_cache_alloc_new_blocks")[0] == total - reused
    first, last = result.as_numpy("first_token_time_ns")[0], result.as_numpy("last_token_time_ns")[0]
    assert result.as_numpy("arrival_time_ns")[0] <= first <= last
    length = infer(llmapi, "tensorrt_llm_unary", text_input=np.array([prompt], object),
                   sampling_param_max_tokens=np.array([2], np.int32), return_finish_reason=np.array([True]),
                   return_stop_reason=np.array([True]))
    assert length.as_numpy("finish_reason")[0] == b"length" and length.as_numpy("stop_reason")[0] == b"None"


def test_llmapi_samples_as_the_llm_api(llmapi: TritonServer, expected: dict) -> None:
    """temperature alone samples (the LLM API's rule, unlike the legacy model's); top_k 1 is greedy; a seed repeats."""
    prompt = PROMPTS[0]

    def text(**values: Any) -> str:
        status, body = http_generate(llmapi, "tensorrt_llm_unary", text_input=prompt, sampling_param_max_tokens=TOKENS,
                                     **values)
        assert status == 200, body
        return body["text_output"]

    assert text(sampling_param_top_k=1, sampling_param_temperature=1.0) == expected[prompt].text
    seeded = {text(sampling_param_temperature=1.0, sampling_param_seed=s) for s in (1, 1, 2**63 + 1)}
    assert len(seeded) == 1 and seeded != {expected[prompt].text}  # a UINT64 seed is taken modulo 2^63


def test_llmapi_penalties_and_cumulative_logprob_match_the_session(llmapi: TritonServer, session: Session) -> None:
    """sampling_param_presence/frequency_penalty and return_cumulative_logprob, as the executor computes them."""
    prompt = PROMPTS[2]
    want = session.generate([prompt], SamplingParams(max_tokens=TOKENS, presence_penalty=1.5, frequency_penalty=0.5,
                                                     logprobs=0))[0]
    result = infer(llmapi, "tensorrt_llm_unary", text_input=np.array([prompt], object),
                   sampling_param_max_tokens=np.array([TOKENS], np.int32),
                   sampling_param_presence_penalty=np.array([1.5], np.float32),
                   sampling_param_frequency_penalty=np.array([0.5], np.float32),
                   return_cumulative_logprob=np.array([True]))
    assert result.as_numpy("text_output")[0].decode() == want.text
    assert result.as_numpy("cumulative_logprob").shape == (1,)
    assert result.as_numpy("cumulative_logprob")[0] == pytest.approx(want.cumulative_logprob, rel=1e-4, abs=1e-3)


def test_llmapi_best_of_returns_the_most_likely_candidate(llmapi: TritonServer, session: Session) -> None:
    """sampling_param_best_of (n 1, as upstream's model): the candidate with the highest cumulative logprob, of
    those seeded seed + i."""
    prompt = PROMPTS[1]
    sampled = SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=5)
    want = session.generate([prompt], replace(sampled, best_of=3, logprobs=0))[0]
    candidates = [session.generate([prompt], replace(sampled, seed=5 + i, logprobs=0))[0] for i in range(3)]
    assert want.text == max(candidates, key=lambda c: c.cumulative_logprob).text
    result = infer(llmapi, "tensorrt_llm_unary", text_input=np.array([prompt], object),
                   sampling_param_max_tokens=np.array([TOKENS], np.int32),
                   sampling_param_temperature=np.array([1.0], np.float32),
                   sampling_param_seed=np.array([5], np.uint64), sampling_param_best_of=np.array([3], np.int32))
    assert result.as_numpy("text_output")[0].decode() == want.text


def test_llmapi_num_draft_tokens_caps_the_requests_mtp_drafts(llmapi: TritonServer, session: Session) -> None:
    """sampling_param_num_draft_tokens (this runtime's input) is the request's SamplingParams.num_draft_tokens (the
    model drafts 3): greedy, 0 and 2 give the same text, the session's, and the perf metrics count what the session's
    request with that cap drafted: nothing for 0, some for 2; unary and streamed alike."""
    prompt = PROMPTS[0]
    drafted = {}
    for k in (0, 2):
        want = session.generate([prompt], SamplingParams(max_tokens=TOKENS, num_draft_tokens=k))[0]
        values = dict(text_input=np.array([prompt], object), sampling_param_max_tokens=np.array([TOKENS], np.int32),
                      sampling_param_num_draft_tokens=np.array([k], np.int32),
                      sampling_param_return_perf_metrics=np.array([True]))
        result = infer(llmapi, "tensorrt_llm_unary", **values)
        assert result.as_numpy("text_output")[0].decode() == want.text
        assert result.as_numpy("total_draft_tokens")[0] == want.stats.num_draft_tokens
        assert result.as_numpy("total_accepted_draft_tokens")[0] == want.stats.num_accepted_draft_tokens
        streamed = llmapi_stream(llmapi, "tensorrt_llm", **values, streaming=np.array([True]))
        assert streamed.error is None and streamed.chunks[-1].decode() == want.text
        drafted[k] = want.stats.num_draft_tokens
    assert drafted[0] == 0 < drafted[2]


LLMAPI_BAD_REQUESTS = {
    "max_tokens_zero": (dict(sampling_param_max_tokens=0), "sampling_param_max_tokens"),
    "top_p_above_one": (dict(sampling_param_top_p=1.5), "sampling_param_top_p"),
    "best_of_greedy": (dict(sampling_param_best_of=2), "sampling_param_best_of must be 1 when decoding greedily (no "
                       "sampling_param_temperature, top_k or top_p given), got 2"),
    "best_of_top_k_1": (dict(sampling_param_best_of=3, sampling_param_top_k=1, sampling_param_temperature=1.0),
                        "sampling_param_best_of must be 1 when decoding greedily (sampling_param_top_k 1), got 3"),
    "best_of_above_max_batch": (dict(sampling_param_best_of=1000, sampling_param_temperature=1.0),
                                "sampling_param_best_of 1000 exceeds this executor's max_batch_size"),
    "max_tokens_past_context": (dict(sampling_param_max_tokens=5000), "sampling_param_max_tokens 5000 with a "),
    "prompt_past_context": (dict(text_input="hello world " * 1100), "text_input has "),
    "too_many_stops": (dict(sampling_param_stop=[f"w{i}" for i in range(65)]),
                       "sampling_param_stop holds 65 strings; at most 64"),
    "frequency_penalty": (dict(sampling_param_frequency_penalty=5.0), "sampling_param_frequency_penalty"),
    "temperature_negative": (dict(sampling_param_temperature=-1.0), "sampling_param_temperature"),
    "lora": (dict(lora_id=3, lora_name="a", lora_path="/x"), "lora_id"),
    "image_url": (dict(image_url="http://example.com/cat.png"), "image_url"),
    "unknown_key": (dict(max_token=4), "max_token"),
    "streaming_on_unary": (dict(streaming=True), "streaming"),
    "two_prompts": (dict(text_input=["a", "b"]), "one prompt per request"),
}


@pytest.mark.parametrize("value, message", [
    (-1, "sampling_param_num_draft_tokens must be an integer in [0, 2147483647], got -1"),
    (4, "sampling_param_num_draft_tokens 4 exceeds this executor's draft length 3")])
def test_llmapi_num_draft_tokens_refusals_name_the_input(llmapi: TritonServer, value: int, message: str) -> None:
    """A negative draft cap, refused as read; one above the model's draft length (3), by the executor, as Session and
    the OpenAI server refuse it, under this model's name for it."""
    assert http_generate(llmapi, "tensorrt_llm_unary", text_input="hello",
                         sampling_param_num_draft_tokens=value) == (400, {"error": message})
    out = llmapi_stream(llmapi, "tensorrt_llm", text_input=np.array([b"hello"], object),
                        sampling_param_num_draft_tokens=np.array([value], np.int32))
    assert out.error == message


@pytest.mark.parametrize("case", list(LLMAPI_BAD_REQUESTS))
def test_llmapi_bad_requests_are_400_naming_the_input(llmapi: TritonServer, case: str) -> None:
    values, name = LLMAPI_BAD_REQUESTS[case]
    status, body = http_generate(llmapi, "tensorrt_llm_unary", **{"text_input": "hello", **values})
    assert status == 400 and name in body["error"], body
    out = llmapi_stream(llmapi, "tensorrt_llm", text_input=np.array([b"hello"], object),
                        sampling_param_max_tokens=np.array([4], np.int32))
    assert out.error is None and out.text
    assert llmapi.is_ready()


@pytest.mark.parametrize("sampling, because", [
    ({}, "no sampling_param_temperature, top_k or top_p given"),
    (dict(sampling_param_top_k=np.array([1], np.int32), sampling_param_temperature=np.array([1.0], np.float32)),
     "sampling_param_top_k 1"),
    (dict(sampling_param_top_p=np.array([0.0], np.float32)), "sampling_param_top_p 0"),
    (dict(sampling_param_temperature=np.array([0.0], np.float32)), "sampling_param_temperature 0"),
])
def test_llmapi_best_of_greedy_names_what_made_it_greedy(sampling: dict[str, np.ndarray], because: str) -> None:
    """The llmapi model decodes greedily by the LLM API's rule (llm_api_sampling); best_of > 1 is refused then by
    SamplingParams' one check, naming what made the request greedy (it was checked twice, with a list of causes here
    and "temperature 0", which the client may not have sent, there). Sampling, it is taken."""
    from serving.triton.llmapi_request import llmapi_request

    inputs = {"text_input": np.array([b"hello"], object), "sampling_param_best_of": np.array([3], np.int32)}
    with pytest.raises(RequestError) as e:
        llmapi_request({**inputs, **sampling}, 1000)
    assert str(e.value) == f"sampling_param_best_of must be 1 when decoding greedily ({because}), got 3"
    sampled = llmapi_request({**inputs, "sampling_param_temperature": np.array([0.5], np.float32)}, 1000).params
    assert (sampled.temperature, sampled.best_of) == (0.5, 3)


# ---- model.yaml and make_model_repo --flavour llmapi (no server) --------------------------------
def write_yaml(tmp_path: Path, checkpoint: Path, **keys: Any) -> Path:
    (tmp_path / "engine").symlink_to(checkpoint, target_is_directory=True)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump({"model": "engine", **keys}))
    return path


def test_model_yaml_maps_llm_api_keys(tmp_path: Path, checkpoint: Path) -> None:
    path = write_yaml(tmp_path, checkpoint, backend="pytorch", max_batch_size=4, max_seq_len=512, max_num_tokens=256,
                      speculative_config={"decoding_type": "MTP", "max_draft_len": 2},
                      kv_cache_config={"free_gpu_memory_fraction": 0.5, "max_tokens": 4096, "enable_block_reuse": False},
                      triton_config={"max_batch_size": 0, "decoupled": True, "speculation": "fixed",
                                     "max_queue_size": 16})
    llm = read_model_yaml(path, tmp_path)
    e = llm.executor
    assert (e.max_batch_size, e.max_seq_len, e.max_num_tokens, e.num_draft_tokens, e.speculation) == (4, 512, 256, 2,
                                                                                                      "fixed")
    assert e.max_queued_requests == 16  # the legacy flavour's max_queue_size, under triton_config
    assert (e.free_memory_fraction, e.kv_cache_tokens, e.enable_block_reuse) == (0.5, 4096, False)
    assert llm.triton.decoupled and not llm.warnings
    (tmp_path / "bare").mkdir()
    bare = read_model_yaml(write_yaml(tmp_path / "bare", checkpoint), tmp_path / "bare")
    assert bare.executor.speculation == "off"  # no speculative_config: no drafting, as the LLM API
    assert bare.executor.enable_block_reuse  # prefix caching on by default, as the LLM API
    # what the file leaves out keeps the settings' own defaults, read from the dataclasses, not repeated
    assert bare.triton == TritonConfig() and bare.executor == ExecutorConfig(speculation="off", num_draft_tokens=0)


def test_relaxed_acceptance_keeps_upstreams_defaults(tmp_path: Path, checkpoint: Path) -> None:
    """What a model.yaml leaves out of relaxed acceptance means what MTPDecodingConfig's defaults say (top 1, delta 0),
    as the builder's --backend trtllm options do: one set of defaults, RelaxedAcceptance's."""
    spec = {"decoding_type": "MTP", "max_draft_len": 2, "use_relaxed_acceptance_for_thinking": True,
            "end_thinking_phase_token": 7}
    relaxed = read_model_yaml(write_yaml(tmp_path, checkpoint, speculative_config=spec), tmp_path).executor
    # the thinking span left out is DeepSeek-R1's <think> ... </think>, as upstream's
    assert relaxed.relaxed_acceptance == RelaxedAcceptance(top_n=1, delta=0.0, begin_thinking_token=128798,
                                                           end_thinking_token=7)
    assert (TrtllmOptions.relaxed_topk, TrtllmOptions.relaxed_delta) == (1, 0.0)
    # null turns CUDA graphs off; upstream's CudaGraphConfig leaves them on, its batch sizes not applied
    for name in ("off", "on"):
        (tmp_path / name).mkdir()
    graphs = read_model_yaml(write_yaml(tmp_path / "off", checkpoint, cuda_graph_config=None), tmp_path / "off")
    assert not graphs.executor.cuda_graphs and not graphs.warnings
    graphs = read_model_yaml(write_yaml(tmp_path / "on", checkpoint, cuda_graph_config={"enable_padding": True,
                                                                                        "batch_sizes": [1, 2]}),
                             tmp_path / "on")
    assert graphs.executor.cuda_graphs and graphs.warnings == [
        "cuda_graph_config.batch_sizes, cuda_graph_config.enable_padding: not applied (the batch sizes CUDA graphs are "
        "captured for change how the work is done, not what is generated)"]


@pytest.mark.parametrize("keys, message", [
    (dict(speculative_config={"decoding_type": "Eagle", "max_draft_len": 2}), "decoding_type 'Eagle'"),
    (dict(kv_cache_config={"dtype": "fp8"}), "kv_cache_config.dtype 'fp8'"),
    (dict(kv_cache_config={"max_attention_window": [64]}), "kv_cache_config: unknown key(s) max_attention_window"),
    (dict(kv_cache_config={"enable_block_reuse": "no"}), "kv_cache_config.enable_block_reuse must be true or false, "
                                                         "got 'no'"),
    (dict(max_beam_width=4), "max_beam_width 4"),
    # upstream's pydantic reads a quoted "false" as false; read as truthy it turned lossy relaxed acceptance on
    (dict(speculative_config={"decoding_type": "MTP", "max_draft_len": 2, "use_relaxed_acceptance_for_thinking": "false"}),
     "speculative_config.use_relaxed_acceptance_for_thinking must be true or false, got 'false'"),
    (dict(speculative_config={"decoding_type": "MTP", "use_relaxed_acceptance_for_thinking": True, "relaxed_topk": 0}),
     "speculative_config: relaxed acceptance top_n must be an integer >= 1, got 0"),
    (dict(speculative_config={"decoding_type": "MTP", "use_relaxed_acceptance_for_thinking": True,
                              "end_thinking_phase_token": "</think>"}),
     "relaxed acceptance end_thinking_token must be a token id (an integer >= 0), got '</think>'"),
    # false for null kept CUDA graphs on; keys of upstream's CudaGraphConfig only, typed
    (dict(cuda_graph_config=False), "cuda_graph_config must be a mapping, got False"),
    (dict(cuda_graph_config={"max_batch_sze": 8}), "cuda_graph_config: unknown key(s) max_batch_sze"),
    (dict(cuda_graph_config={"enable_padding": "yes"}), "cuda_graph_config.enable_padding must be true or false"),
    (dict(cuda_graph_config={"batch_sizes": [1, 0]}), "cuda_graph_config.batch_sizes must be a list of integers >= 1"),
    (dict(tensor_parallel_size="eight"), "tensor_parallel_size must be an integer >= 1, got 'eight'"),
    (dict(enable_lora=True), "unknown key(s) enable_lora"),
    (dict(speculative_config={"decoding_type": "MTP", "max_draft_len": 2, "num_nextn_predict_layers": 3}),
     "max_draft_len 2 and num_nextn_predict_layers 3 differ"),
    (dict(speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": "two"}),
     "speculative_config.num_nextn_predict_layers must be an integer >= 0, got 'two'"),
    (dict(triton_config={"decoupled": "yes"}), "triton_config.decoupled must be true or false"),
    (dict(triton_config={"max_batch_sizes": 4}), "triton_config: unknown key(s) max_batch_sizes"),
    (dict(triton_config={"watchdog_timeout_s": "long"}), "triton_config.watchdog_timeout_s must be a number"),
    (dict(triton_config={"watchdog_timeout_s": -1}),
     "triton_config.watchdog_timeout_s must be a number in [0.001, 86400], got -1.0"),
    (dict(triton_config={"cancellation_check_period_ms": 10**20}),
     f"triton_config.cancellation_check_period_ms must be a number in [1, 3600000], got {10**20}"),
    (dict(triton_config={"torch_threads": 10**9}), "triton_config.torch_threads must be a number in [1, 1024]"),
    (dict(speculative_config={"decoding_type": "MTP", "max_draft_len": 1}, triton_config={"speculation": "always"}),
     "triton_config.speculation must be 'off', 'fixed' or 'adaptive'"),
    # read as an empty mapping, a YAML boolean, a path said twice, torch's words
    (dict(triton_config=[]), "triton_config must be a mapping, got []"),
    (dict(triton_config={"speculation": False}), "triton_config.speculation is false: YAML reads an unquoted off as "
                                                 "false; write speculation: 'off'"),
    (dict(triton_config={"device": "gpu"}), "triton_config.device must be cpu or cuda[:index], got 'gpu'"),
    # a null model was read as a directory named None; true is 1 to Python
    (dict(model=None), "model must be the engine directory or Hugging Face checkpoint (a path), got None"),
    (dict(max_beam_width=True), "max_beam_width True: supported: 1 (no beam search)"),
    # the executor's check, under model.yaml's key (it said free_memory_fraction)
    (dict(kv_cache_config={"free_gpu_memory_fraction": 1.5}),
     "kv_cache_config.free_gpu_memory_fraction must be in (0, 1], got 1.5"),
])
def test_model_yaml_refuses_what_changes_the_output_naming_the_key(tmp_path: Path, checkpoint: Path,
                                                                   keys: dict, message: str) -> None:
    with pytest.raises(ModelYamlError, match=re.escape(message)) as e:
        read_model_yaml(write_yaml(tmp_path, checkpoint, **keys), tmp_path)
    assert str(e.value).count(str(tmp_path)) == 1  # the file named once


BOMB = "xa: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(  # nine levels of aliases: 9^9 items in ~300 bytes
    f"x{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")) + "max_seq_len: *i\n"


@pytest.mark.parametrize("text, message", [
    (BOMB, "max_seq_len must be an integer >= 2, got [[...], [...], [...], [...], ...]"),
    ("1: 2\n", "unknown key(s) 1: not implemented by this runtime"),
    ("max_seq_len: " + "9" * 5000 + "\n", "cannot read it: Exceeds the limit (4300 digits)"),
    ("max_seq_len: 64\nkv_cache_config: {}\nmax_seq_len: 128\n", "found duplicate key 'max_seq_len'\n  in"),
])
def test_a_hostile_model_yaml_gets_a_short_error_naming_the_file(tmp_path: Path, checkpoint: Path, text: str,
                                                                  message: str) -> None:
    """A model.yaml of YAML aliases (a few hundred bytes that expand to billions of items: the refusal printed the
    value, and took 2.5 GB and 30 s), keys that are not strings, an integer too long to convert, or a key given twice:
    each a short ModelYamlError naming the file (they were a MemoryError, a TypeError, a bare ValueError, and the
    last value taken silently)."""
    path = write_yaml(tmp_path, checkpoint)
    path.write_text("model: engine\n" + text)
    with pytest.raises(ModelYamlError) as e:
        read_model_yaml(path, tmp_path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value) and len(str(e.value)) < 400, str(e.value)




def test_max_queue_size_is_the_executors_queue_bound(tmp_path: Path, checkpoint: Path) -> None:
    """TensorRT-LLM's max_queue_size (fill_template's default 0: no bound, as upstream's) sets the executor's
    max_queued_requests in both flavours; a negative one is refused naming it."""
    from serving.triton.parameters import queue_bound

    assert (queue_bound(0), queue_bound(8)) == (None, 8)
    with pytest.raises(ValueError, match=r"^must be an integer >= 0 \(0: no bound\), got -1$"):
        queue_bound(-1)
    repo = fill_model_repo(tmp_path / "repo", repo_values(checkpoint))
    config = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'key: "max_queue_size"\n  value: {\n    string_value: "0"' in config
    # the executor's count alone bounds the queue: Triton's queue in front of a model knows no free batch places (a
    # bound there refused bursts the batch would take)
    assert all("default_queue_policy" not in c.read_text() for c in repo.glob("*/config.pbtxt"))
    repo = fill_model_repo(tmp_path / "repo8", repo_values(checkpoint, max_queue_size="8"))
    assert 'string_value: "8"' in (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    for value, expected in ((0, None), (3, 3)):
        (tmp_path / str(value)).mkdir()
        llm = read_model_yaml(write_yaml(tmp_path / str(value), checkpoint, triton_config={"max_queue_size": value}),
                              tmp_path / str(value))
        assert llm.executor.max_queued_requests == expected
    (tmp_path / "neg").mkdir()
    with pytest.raises(ModelYamlError, match=r"^[^:]*model.yaml: triton_config.max_queue_size must be an integer >= "
                                             r"0 \(0: no bound\), got -1$"):  # the file named once (it was twice)
        read_model_yaml(write_yaml(tmp_path / "neg", checkpoint, triton_config={"max_queue_size": -1}),
                        tmp_path / "neg")


def test_the_launchers_world_size_is_read_with_the_executor_config(tmp_path: Path, checkpoint: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """launch_triton_server --world_size reaches the engine models as DSV3_WORLD_SIZE, read where each flavour builds
    its ExecutorConfig (engine_parameters, read_model_yaml), so make_model_repo's checks and the model read one
    config; a value that is not an integer is refused naming the variable."""
    from serving.triton.engine_parameters import engine_parameters
    from serving.triton.parameters import WORLD_SIZE_ENV, read_model_config

    config = read_model_config(fill_model_repo(tmp_path / "repo", repo_values(checkpoint)) / "tensorrt_llm")
    (tmp_path / "llmapi").mkdir()
    path = write_yaml(tmp_path / "llmapi", checkpoint)
    for value, expected in (("2", 2), ("", None)):
        monkeypatch.setenv(WORLD_SIZE_ENV, value)
        assert engine_parameters(config, True).executor.world_size == expected
        assert read_model_yaml(path, tmp_path / "llmapi").executor.world_size == expected
    monkeypatch.setenv(WORLD_SIZE_ENV, "two")
    for read in (lambda: engine_parameters(config, True), lambda: read_model_yaml(path, tmp_path / "llmapi")):
        with pytest.raises(ValueError) as e:
            read()
        assert str(e.value) == "DSV3_WORLD_SIZE: expected an integer, got 'two'"


def test_a_long_refused_value_is_quoted_short_with_its_length(tmp_path: Path, checkpoint: Path) -> None:
    """model.yaml's refusals quote a value as config.pbtxt's do (runtime.io.yaml_file.shown): a long string is
    cut, its length said."""
    with pytest.raises(ModelYamlError) as e:
        read_model_yaml(write_yaml(tmp_path, checkpoint, backend="x" * 5000), tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'model.yaml'}: backend {'x' * 40!r}... (5000 characters): supported: "
                                   "pytorch")


def test_yaml_merge_keys_override_without_being_duplicates(tmp_path: Path) -> None:
    """`<<` merges bring in keys a mapping may override, also in a mapping that is itself a merge source (which
    PyYAML flattens before constructing it): read as safe_load reads them; a key given twice is still refused."""
    from runtime.io.yaml_file import read_yaml

    for text in ("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  x: 5\n",
                 "x:\n  defs: &m\n    <<: {a: 1}\n    a: 2\ny:\n  <<: *m\n",
                 "x:\n  defs: &m {a: 1, <<: {a: 2}}\ny:\n  <<: *m\n",
                 "a: &a {x: 1}\nb: &b {y: 2}\nc:\n  <<: [*a, *b]\n  x: 3\n"):
        path = tmp_path / "doc.yaml"
        path.write_text(text)
        assert read_yaml(path) == yaml.safe_load(text), text
    path.write_text("d:\n  <<: {x: 1}\n  x: 2\n  x: 3\n")
    with pytest.raises(yaml.YAMLError, match="found duplicate key 'x'"):
        read_yaml(path)

def test_model_yaml_names_what_it_does_not_apply(tmp_path: Path, checkpoint: Path) -> None:
    llm = read_model_yaml(write_yaml(tmp_path, checkpoint, enable_attention_dp=True, tensor_parallel_size=8,
                                     speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2,
                                                         "use_mtp_vanilla": True}), tmp_path)
    assert llm.executor.num_draft_tokens == 2
    joined = "\n".join(llm.warnings)
    for key in ("enable_attention_dp", "tensor_parallel_size 8", "num_nextn_predict_layers is deprecated",
                "speculative_config.use_mtp_vanilla"):
        assert key in joined, joined


def test_builders_llm_api_options_are_a_model_yaml(tmp_path: Path, checkpoint: Path) -> None:
    """The options build_engine --backend trtllm writes (what upstream's own llmapi model is given) read here
    without a refusal: every key is an LLM-API key this reader knows."""
    cfg, build = read_limits(checkpoint)
    options = llm_api_options(build, TrtllmOptions(use_relaxed_acceptance_for_thinking=True, relaxed_topk=3,
                                                   relaxed_delta=0.2))
    llm = read_model_yaml(write_yaml(tmp_path, checkpoint, **options), tmp_path)
    assert llm.executor.num_draft_tokens == build.max_draft_len and llm.executor.relaxed_acceptance.top_n == 3


def test_make_model_repo_writes_the_llmapi_flavour(tmp_path: Path, checkpoint: Path) -> None:
    script = Path(sys.executable).with_name("make_model_repo")
    run = subprocess.run([script, "--engine_dir", checkpoint, "--output_dir", tmp_path / "repo", "--flavour", "llmapi",
                          "--set", "decoupled_mode:false"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    model = tmp_path / "repo" / "tensorrt_llm"
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["tensorrt_llm"]
    doc = yaml.safe_load((model / "1" / "model.yaml").read_text())
    assert doc["model"] == "engine" and (model / "engine").resolve() == checkpoint.resolve()
    # both names (max_draft_len alone drafts one token on 1.0 / 1.1)
    assert doc["speculative_config"] == {"decoding_type": "MTP", "max_draft_len": 3, "num_nextn_predict_layers": 3}
    assert doc["triton_config"] == {"max_batch_size": 0, "decoupled": False}
    config = (model / "config.pbtxt").read_text()
    assert "max_batch_size: 0" in config and "decoupled: false" in config and "${" not in config
    bad = subprocess.run([script, "--engine_dir", checkpoint, "--output_dir", tmp_path / "bad", "--flavour", "llmapi",
                          "--set", "num_draft_tokens:2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "num_draft_tokens" in bad.stderr and "model.yaml" in bad.stderr
    assert not (tmp_path / "bad").exists()


def test_make_model_repo_never_deletes_its_inputs_nor_leaves_half_a_repository(tmp_path: Path, checkpoint: Path) -> None:
    """--force replaces a repository, nothing else: an --output_dir that is or contains the engine or the working
    directory is refused (it was deleted, the engine with it); a refusal while the repository is written leaves
    the one already there as it was, and no half-written directory."""
    script = Path(sys.executable).with_name("make_model_repo")
    project = tmp_path / "project"
    shutil.copytree(checkpoint, project / "engine")
    (project / "notes.txt").write_text("keep")
    for engine, out, cwd, name in ((project / "engine", project, tmp_path, "--engine_dir"),
                                   (checkpoint, Path("."), project, "the current directory")):
        run = subprocess.run([script, "--engine_dir", engine, "--output_dir", out, "--force"],
                             capture_output=True, text=True, cwd=cwd)
        assert run.returncode == 2 and f"--output_dir {out} is or contains {name}" in run.stderr, run.stderr
        assert (project / "notes.txt").read_text() == "keep" and (project / "engine" / "config.json").is_file()
    tokenizer = project / "tokenizer"
    shutil.copytree(checkpoint, tokenizer)
    run = subprocess.run([script, "--engine_dir", checkpoint, "--output_dir", project, "--force",
                          "--set", f"tokenizer_dir:{tokenizer}"], capture_output=True, text=True)
    assert run.returncode == 2 and f"is or contains --set tokenizer_dir ({tokenizer})" in run.stderr, run.stderr
    assert (tokenizer / "tokenizer.json").is_file()
    repo = tmp_path / "repo"
    assert subprocess.run([script, "--engine_dir", checkpoint, "--output_dir", repo], capture_output=True).returncode == 0
    again = subprocess.run([script, "--engine_dir", checkpoint, "--output_dir", repo], capture_output=True, text=True)
    assert again.returncode == 2 and "output directory already exists; pass --force to replace it" in again.stderr
    before = sorted(str(p.relative_to(repo)) for p in repo.rglob("*"))
    bad = subprocess.run([script, "--engine_dir", checkpoint, "--output_dir", repo, "--force",
                          "--set", "decoupled_mode:0x0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "decoupled_mode" in bad.stderr, bad.stderr
    # a misspelt setting was left out without a word; engine_dir beside --engine_dir was a traceback
    for setting, message in (("max_queue_sise:4", "make_model_repo: --set max_queue_sise: no model of the repository "
                                                  "takes it (see triton_repo/README.md for the settings)\n"),
                             ("engine_dir:/etc", "make_model_repo: --set engine_dir: the engine is --engine_dir\n"),
                             # values the tensorrt_llm model refuses when it loads: read as it reads them
                             ("max_queue_size:-1", "make_model_repo: model tensorrt_llm: parameter max_queue_size: "
                                                   "must be an integer >= 0 (0: no bound), got -1\n"),
                             ("speculation:sometimes", "make_model_repo: model tensorrt_llm: parameter speculation: "
                                                       "must be 'off', 'fixed' or 'adaptive', got 'sometimes'\n")):
        bad = subprocess.run([script, "--engine_dir", checkpoint, "--output_dir", repo, "--force", "--set", setting],
                             capture_output=True, text=True)
        assert (bad.returncode, bad.stderr) == (2, message)
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project", "repo"]


@pytest.mark.parametrize("setting, message", [
    ("num_draft_tokens:three", "parameter num_draft_tokens: expected an integer, got 'three'"),
    ("kv_cache_free_gpu_mem_fraction:2",
     "parameter kv_cache_free_gpu_mem_fraction: must be in (0, 1], got 2.0"),
    ("watchdog_timeout_s:0", "parameter watchdog_timeout_s: must be a number in [0.001, 86400], got 0.0"),
    ("device:tpu", "parameter device: must be cpu or cuda[:index], got 'tpu'"),
    # and against the engine, as its executor checks them and the model's load says it
    ("executor_max_seq_len:100000", "executor_max_seq_len 100000 exceeds max_position_embeddings (1024) of {checkpoint}"),
    ("num_draft_tokens:9", "num_draft_tokens 9 exceeds 8, the most the MTP module is re-run for ({checkpoint})")])
def test_make_model_repo_reads_the_engine_model_as_it_loads(tmp_path: Path, checkpoint: Path, capsys, setting: str,
                                                           message: str) -> None:
    """Every value the legacy tensorrt_llm model would refuse when a server loads it (its parameters read by the
    model's own reader, then checked against the engine) is refused when the repository is written, naming the
    parameter; they were written, and the server then failed to load the model."""
    import serving.triton.model_repo as model_repo

    assert model_repo.main(["--engine_dir", str(checkpoint), "--output_dir", str(tmp_path / "repo"),
                            "--set", setting]) == 2
    assert capsys.readouterr().err == f"make_model_repo: model tensorrt_llm: {message.format(checkpoint=checkpoint)}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("setting, message", [
    ("add_special_tokens:maybe", "model preprocessing: parameter add_special_tokens: expected true or false, got "
                                 "'maybe'"),
    ("vocab_size:x", "model postprocessing: parameter vocab_size: expected an integer, got 'x'"),
    ("accumulate_tokens:maybe", "model tensorrt_llm_bls: parameter accumulate_tokens: expected true or false, got "
                                "'maybe'"),
    ("tensorrt_llm_model_name:nope", "--set tensorrt_llm_model_name:nope: no such model in the repository (the BLS "
                                     "calls it for every request); its engine model is tensorrt_llm"),
    ("tokenizer_dir:/nonexistent", "model preprocessing: parameter tokenizer_dir: no tokenizer.json in /nonexistent"),
    ("triton_max_batch_size:abc", "ensemble/config.pbtxt: triton_max_batch_size:'abc': expected an integer in "
                                  "[0, 2147483647]"),
    ("triton_max_batch_size:0", "preprocessing/config.pbtxt: triton_max_batch_size:'0': expected an integer in "
                                "[1, 2147483647]"),  # a dynamic batch's preferred size (the llmapi flavour takes 0)
    ("num_draft_tokens:${oops}", "--set num_draft_tokens:${oops}: a template placeholder is not a value"),
    ("num_draft_tokens:1,num_draft_tokens:2", "substitution 'num_draft_tokens' given twice")])
def test_make_model_repo_reads_every_model_as_it_loads(tmp_path: Path, checkpoint: Path, capsys, setting: str,
                                                      message: str) -> None:
    """The text models' and the BLS's settings too (each model's own reader, the tokenizers loaded), and Triton's own
    numbers: each of these repositories was written, and then a server failed to load it or every BLS request
    failed."""
    import serving.triton.model_repo as model_repo

    assert model_repo.main(["--engine_dir", str(checkpoint), "--output_dir", str(tmp_path / "repo"),
                            "--set", setting]) == 2
    assert capsys.readouterr().err == f"make_model_repo: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_make_model_repo_interrupted_leaves_nothing_and_clears_what_a_killed_run_left(
        tmp_path: Path, checkpoint: Path, capsys, monkeypatch) -> None:
    """SIGTERM / Ctrl-C while writing left its temporary repository and lock, which a rerun (even --force) left too;
    as build_engine: nothing left, exit 130, and a killed run's leftovers removed by the next."""
    import serving.triton.model_repo as model_repo

    def interrupted(dst: Path, values: dict) -> None:
        (dst / "half").mkdir()
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(model_repo, "fill_model_repo", interrupted)
        assert model_repo.main(["--engine_dir", str(checkpoint), "--output_dir", str(tmp_path / "repo")]) == 130
    assert capsys.readouterr().err == "make_model_repo: interrupted; no model repository was written\n"
    assert list(tmp_path.iterdir()) == []
    (tmp_path / ".repo.tmp-killed").mkdir()  # what a SIGKILLed run leaves: its temporary and a lock nobody holds
    (tmp_path / ".repo.tmp-killed.lock").touch()
    assert model_repo.main(["--engine_dir", str(checkpoint), "--output_dir", str(tmp_path / "repo")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


def test_make_model_repo_names_a_bad_tokenizer_where_it_is(tmp_path: Path, checkpoint: Path, capsys) -> None:
    """A tokenizer.json that does not read was named inside the temporary repository being written (deleted since)."""
    import serving.triton.model_repo as model_repo

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{")
    assert model_repo.main(["--engine_dir", str(checkpoint), "--output_dir", str(tmp_path / "repo"), "--set",
                            f"tokenizer_dir:{tok}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"make_model_repo: cannot read tokenizer file {tok / 'tokenizer.json'}"), err


def test_make_model_repo_says_which_upstream_settings_it_ignores(tmp_path: Path, checkpoint: Path, capsys) -> None:
    """Upstream's settings this repository does not use are taken, and said to be ignored (as fill_template says;
    they were dropped without a word)."""
    import serving.triton.model_repo as model_repo

    assert model_repo.main(["--engine_dir", str(checkpoint), "--output_dir", str(tmp_path / "repo"), "--set",
                            "batch_scheduler_policy:max_utilization,max_attention_window_size:64"]) == 0
    assert capsys.readouterr().err == ("make_model_repo: --set batch_scheduler_policy, max_attention_window_size: "
                                       "ignored (upstream's settings, not used by this repository)\n")


def test_make_model_repo_refuses_an_output_inside_what_it_links(tmp_path: Path, checkpoint: Path, capsys) -> None:
    """The repository links the engine (and a --set tokenizer_dir): inside either, Triton walked the loop and never
    became ready (a 740 MB log in 2 minutes)."""
    import serving.triton.model_repo as model_repo

    engine = tmp_path / "engine"
    shutil.copytree(checkpoint, engine)
    for flags, flag in (([], "--engine_dir"), (["--set", f"tokenizer_dir:{engine}"], "--set tokenizer_dir")):
        assert model_repo.main(["--engine_dir", str(engine if not flags else checkpoint), "--output_dir",
                                str(engine / "repo"), *flags]) == 2
        assert capsys.readouterr().err == (
            f"make_model_repo: --output_dir {engine / 'repo'} is inside {flag} ({engine}): the repository links that "
            "directory, and Triton would walk the loop; choose a directory outside it\n")
    assert not (engine / "repo").exists()


@pytest.mark.parametrize("flavour", ["legacy", "llmapi"])
def test_make_model_repo_refuses_a_truncated_or_missing_rank_file(tmp_path: Path, checkpoint: Path, capsys,
                                                                  flavour: str) -> None:
    """A rank file cut short (a copy that ran out of space) or missing was taken, and the server then refused the
    engine on its hash; hashing reads every weight, too slow for a full-size engine, so the file's size is checked
    against what its safetensors header declares: one line naming it, exit status 2, nothing written."""
    import serving.triton.model_repo as model_repo
    from builder.cli import main as build_main

    engine = tmp_path / "engine"
    assert build_main(["--model_dir", str(checkpoint), "--output_dir", str(engine), "--max_seq_len", "256"]) == 0
    rank = engine / "rank0.safetensors"
    size, header = rank.stat().st_size, int.from_bytes(rank.read_bytes()[:8], "little")
    rank.write_bytes(rank.read_bytes()[:-100])
    argv = ["--engine_dir", str(engine), "--output_dir", str(tmp_path / "repo"), "--flavour", flavour]
    capsys.readouterr()
    assert model_repo.main(argv) == 2
    assert capsys.readouterr().err == (
        f"make_model_repo: {rank}: file is truncated: {size - 100} bytes, expected {size} (8 + {header}-byte header + "
        f"{size - 8 - header} bytes of data); rebuild the engine or copy the file again\n")
    rank.unlink()
    assert model_repo.main(argv) == 2
    assert capsys.readouterr().err == (
        f"make_model_repo: {rank}: weight file missing, expected 1 (rank0.safetensors) for tp_size 1\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


def test_make_model_repo_on_a_full_disk_is_one_line(tmp_path: Path, checkpoint: Path, monkeypatch, capsys) -> None:
    """The file system's refusals while the repository is written (here no space, after a first file) are one line
    naming the file where the repository was to be (not in its temporary directory, deleted since), exit status 2,
    and no half-written repository (shutil's traceback before)."""
    import errno
    import os

    import serving.triton.model_repo as model_repo

    def full_disk(repo: Path, values: dict) -> None:
        (repo / "ensemble").mkdir()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(repo / "ensemble" / "config.pbtxt"))

    monkeypatch.setattr(model_repo, "fill_model_repo", full_disk)
    repo = tmp_path / "new" / "repo"  # and the directory made for it is removed
    assert model_repo.main(["--engine_dir", str(checkpoint), "--output_dir", str(repo)]) == 2
    assert capsys.readouterr().err == (f"make_model_repo: {repo / 'ensemble' / 'config.pbtxt'}: No space left on "
                                       "device; no model repository was written\n")
    assert list(tmp_path.iterdir()) == []

    def no_space(src: str, dst: str, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def copytree(src: str, dst: str, *args: object, **kwargs: object) -> object:  # its own recursion passes args
        return real_copytree(src, dst, *args, **(kwargs if args else {**kwargs, "copy_function": no_space}))

    real_copytree = shutil.copytree  # which keeps only its failed copies' messages: it said "Error"
    monkeypatch.undo()
    monkeypatch.setattr(shutil, "copytree", copytree)
    assert model_repo.main(["--engine_dir", str(checkpoint), "--output_dir", str(repo)]) == 2
    assert capsys.readouterr().err in {f"make_model_repo: {repo / 'ensemble' / name}: No space left on device; no model "
                                       "repository was written\n" for name in ("config.pbtxt", "1/.gitkeep")}
    assert list(tmp_path.iterdir()) == []

def test_the_default_admin_key_cannot_be_sent(unary: TritonServer) -> None:
    """Without --admin_api_key the admin APIs are keyed to a value with a line break, because tritonserver's command
    line shows the key to every local user: a client that read it there cannot present it, over HTTP (its halves,
    the header folded, a bare line feed) or gRPC (metadata holds no line break), and the server stays up."""
    import socket

    import tritonclient.grpc as grpcclient

    argv = Path(f"/proc/{unary.process.pid}/cmdline").read_bytes().split(b"\0")
    [flag] = [a for a in argv if a.startswith(b"--http-restricted-api=")]
    key = flag.split(b":admin-key=", 1)[1]
    first, second = key.split(b"\n")
    for value in (first, second, first + b" " + second, first + b"\r\n " + second, key):
        with socket.create_connection(("127.0.0.1", unary.http_port), timeout=10) as c:
            c.sendall(b"GET /v2/logging HTTP/1.1\r\nHost: x\r\nadmin-key: " + value + b"\r\nConnection: close\r\n\r\n")
            try:
                answer = c.recv(200)
            except socket.timeout:
                answer = b""
        assert not answer.startswith(b"HTTP/1.1 200"), (value, answer)
    client = grpcclient.InferenceServerClient(unary.grpc_url)
    for value in (first, second):
        with pytest.raises(Exception, match="This protocol is restricted"):
            client.update_log_settings({"log_verbose_level": 1},
                                       headers={"triton-grpc-protocol-admin-key": value.decode()})
    assert unary.is_ready()


def test_kv_cache_retention_inputs_are_refused_for_what_they_ask() -> None:
    """Retention priorities are refused as such: the runtime does reuse prefixes (its refusal said it reused none)."""
    with pytest.raises(RequestError) as e:
        refuse_unsupported({"retention_decode_priority": np.array([[50]], np.int32)}, UNSUPPORTED_ENGINE_INPUTS)
    assert str(e.value) == ("retention_decode_priority is not supported by this runtime (KV cache retention "
                            "priorities: its prefix cache evicts the least recently used blocks); supported: not given")


def test_fp32_inputs_are_read_as_the_decimal_the_client_wrote() -> None:
    """A FP32 input is the shortest decimal that float32 is: 0.01 as 0.01, which repetition_penalty's documented
    range [0.01, 100] takes (it was read as 0.009999999776482582 and refused, on every legacy model)."""
    import numpy as np

    from serving.triton.contract import TENSORRT_LLM_SCALARS

    read = TENSORRT_LLM_SCALARS["repetition_penalty"].read
    assert read(np.array([[0.01]], np.float32), "repetition_penalty") == 0.01
    assert read(np.array([[100]], np.float32), "repetition_penalty") == 100
    with pytest.raises(RequestError) as e:
        read(np.array([[0.0099]], np.float32), "repetition_penalty")
    assert str(e.value) == "repetition_penalty must be a finite number in [0.01, 100.0], got 0.0099"
    assert TENSORRT_LLM_SCALARS["temperature"].read(np.array([[0.7]], np.float32), "temperature") == 0.7


@pytest.mark.parametrize("values, message", [
    (np.array([[2.0]], np.float32), "{name}: expected an integer, got float32 2.0"),
    (np.array([[2**31]], np.int64), "{name} must be an integer in [0, 2147483647], got 2147483648"),
    (np.array([[-1]], np.int32), "{name} must be an integer in [0, 2147483647], got -1"),
])
def test_num_draft_tokens_is_read_in_its_declared_type(values: np.ndarray, message: str) -> None:
    """Each model reads its draft cap as the INT32 it declares, before anything converts it, and its refusal names the
    input: the BLS (the client's input), tensorrt_llm (behind the ensemble too) and the llmapi model."""
    from serving.triton.legacy_request import bls_values, scalar
    from serving.triton.llmapi_request import llmapi_request

    with pytest.raises(RequestError) as e:
        bls_values({"num_draft_tokens": values})
    assert str(e.value) == message.format(name="num_draft_tokens")
    with pytest.raises(RequestError) as e:
        scalar({"num_draft_tokens": values}, "num_draft_tokens")
    assert str(e.value) == message.format(name="num_draft_tokens")
    with pytest.raises(RequestError) as e:
        llmapi_request({"text_input": np.array([b"hello"], object),
                        "sampling_param_num_draft_tokens": values.reshape(1)}, 1000)
    assert str(e.value) == message.format(name="sampling_param_num_draft_tokens")
    assert bls_values({"num_draft_tokens": np.array([[2]], np.int32)}) == {"num_draft_tokens": 2}
