"""The Triton contracts of upstream TensorRT-LLM, against the real tritonserver on loopback ports.

A tiny random DeepSeek-V3 + MTP checkpoint deployed as upstream's tools/inflight_batcher_llm/end_to_end_test.py
deploys the legacy flavour (every model non-decoupled, so unary ModelInfer works on `tensorrt_llm` and the
ensemble).
Each model's inputs and outputs, as its model configuration endpoint reports them, are compared with the tables in
tests/data/upstream_triton_contract.json, copied from upstream's config.pbtxt files; outputs are compared with an
in-process runtime.Session on the same checkpoint.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")

from runtime.core.sampling import SamplingParams  # noqa: E402
from runtime.executors.session import Session  # noqa: E402
from test_triton import DTYPES, grpc_inputs  # noqa: E402
from triton_util import TritonServer, fill_model_repo, make_tiny_checkpoint, repo_values, start_server  # noqa: E402

UPSTREAM = json.loads((Path(__file__).parent / "data" / "upstream_triton_contract.json").read_text())
TOKENS = 24
PROMPTS = ["hello world", "日本語のテキスト", "def f(x):", "emoji 😀 and 東京"]
CONFIG_DTYPES = {"TYPE_STRING": "STRING", "TYPE_BOOL": "BOOL", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64",
                 "TYPE_UINT8": "UINT8", "TYPE_UINT64": "UINT64", "TYPE_FP16": "FP16", "TYPE_FP32": "FP32"}


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("contract") / "tiny")


@pytest.fixture(scope="module")
def session(checkpoint: Path) -> Iterator[Session]:
    with Session(checkpoint, num_draft_tokens=3, speculation="fixed") as s:
        yield s


@pytest.fixture(scope="module")
def expected(session: Session) -> dict[str, Any]:
    return dict(zip(PROMPTS, session.generate(PROMPTS, SamplingParams(max_tokens=TOKENS))))


@pytest.fixture(scope="module")
def unary(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """The legacy flavour, every model non-decoupled (upstream end_to_end_test.py's deployment)."""
    work = tmp_path_factory.mktemp("contract_unary")
    repo = fill_model_repo(work / "repo", repo_values(checkpoint, decoupled_mode="false"))
    srv = start_server(repo, log_file=work / "server.log", ready_timeout_s=240, exit_timeout_s=3)
    try:
        yield srv
    finally:
        srv.stop()


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


def infer_grpc(server: TritonServer, model: str, request_id: str = "", **values: Any) -> Any:
    return grpcclient.InferenceServerClient(server.grpc_url).infer(model, grpc_inputs(**values), request_id=request_id)


def test_unary_tensorrt_llm_refuses_streaming_naming_the_input(unary: TritonServer) -> None:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as e:
        infer(unary, "ensemble", ["text_output"], text_input=np.array([["hi"]], object),
              max_tokens=np.array([[4]], np.int32), stream=np.array([[True]]))
    assert e.value.status() == "400" and "streaming (stream) true needs a decoupled model" in str(e.value), e.value
