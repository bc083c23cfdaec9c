"""Reading a Triton model's config.pbtxt parameters: unset and unfilled template values fall back to
the default; a value that does not parse names the model and the parameter (the model then fails to
load with that message instead of serving with a silently wrong setting); the engine models' one instance; and
the refusal of unknown request keys the models share."""

from __future__ import annotations

import pytest

from serving.triton.parameters import FALSE_VALUES, TRUE_VALUES, boolean, integer, number, parameter


def config(**values: str) -> dict:
    return {"name": "postprocessing", "parameters": {k: {"string_value": v} for k, v in values.items()}}


@pytest.mark.parametrize("raw", ["", "${skip_special_tokens}"])
def test_unset_and_unfilled_values_take_the_default(raw: str) -> None:
    assert parameter(config(skip_special_tokens=raw), "skip_special_tokens", boolean, default=True) is True
    assert parameter(config(), "skip_special_tokens", boolean) is None


def test_booleans_read_both_ways_in_any_case() -> None:
    for raw in TRUE_VALUES + ("True", " YES "):
        assert parameter(config(x=raw), "x", boolean, default=False) is True, raw
    for raw in FALSE_VALUES + ("False", "OFF"):
        assert parameter(config(x=raw), "x", boolean, default=True) is False, raw


def test_integers_and_strings() -> None:
    assert parameter(config(n="12"), "n", integer) == 12
    assert parameter(config(n=" -3 "), "n", integer) == -3
    assert [parameter(config(x=v), "x", number) for v in ("0.5", "1e3", ".25", "2.", "-4")] == [0.5, 1000.0, 0.25, 2.0, -4.0]
    assert parameter(config(s="cpu"), "s") == "cpu"


@pytest.mark.parametrize("name, raw, cast, message", [
    ("skip_special_tokens", "maybe", boolean,
     "model postprocessing: parameter skip_special_tokens: expected true or false, got 'maybe'"),
    ("num_draft_tokens", "three", integer,
     "model postprocessing: parameter num_draft_tokens: expected an integer, got 'three'"),
    ("num_draft_tokens", "2.5", integer,
     "model postprocessing: parameter num_draft_tokens: expected an integer, got '2.5'"),
    # what Python reads and a config.pbtxt does not mean: other scripts' digits, underscores, NaN
    ("max_tokens_in_paged_kv_cache", "\uff11\uff12", integer,
     "model postprocessing: parameter max_tokens_in_paged_kv_cache: expected an integer, got '\uff11\uff12'"),
    ("max_tokens_in_paged_kv_cache", "1_000", integer,
     "model postprocessing: parameter max_tokens_in_paged_kv_cache: expected an integer, got '1_000'"),
    ("watchdog_timeout_s", "nan", number, "model postprocessing: parameter watchdog_timeout_s: expected a number, got 'nan'"),
    ("watchdog_timeout_s", "1_0.5", number,
     "model postprocessing: parameter watchdog_timeout_s: expected a number, got '1_0.5'"),
    ("watchdog_timeout_s", "1e999", number, "model postprocessing: parameter watchdog_timeout_s: expected a number, got '1e999'"),
    ("max_queue_size", "\xa012", integer, "model postprocessing: parameter max_queue_size: expected an integer, got '\\xa012'"),
])
def test_a_value_that_does_not_parse_names_the_model_and_parameter(name: str, raw: str, cast, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parameter(config(**{name: raw}), name, cast)
    assert str(e.value) == message


def test_a_long_value_is_quoted_short() -> None:
    with pytest.raises(ValueError) as e:
        parameter(config(max_queue_size="1" + "0" * 5000), "max_queue_size", integer)
    assert str(e.value) == ("model postprocessing: parameter max_queue_size: expected an integer, got "
                            "'1000000000000000000000000000000000000000'... (5001 characters)")


def test_sibling_config_reads_another_models_parameters(tmp_path) -> None:
    """The BLS filled by upstream's commands has no tokenizer_dir: it takes preprocessing's settings from that
    model's config.pbtxt, read in the shape Triton gives a model its own."""
    from serving.triton.fill_template import fill
    from serving.triton.model_repo import TEMPLATE_REPO
    from serving.triton.parameters import sibling_config

    (tmp_path / "preprocessing").mkdir()
    (tmp_path / "preprocessing" / "config.pbtxt").write_text(fill(
        (TEMPLATE_REPO / "preprocessing" / "config.pbtxt").read_text(),
        {"tokenizer_dir": "tok", "max_input_tokens": "512", "triton_max_batch_size": "8",
         "preprocessing_instance_count": "1"}))
    cfg, directory = sibling_config(str(tmp_path / "tensorrt_llm_bls"), "preprocessing")
    assert directory == str(tmp_path / "preprocessing")
    assert parameter(cfg, "tokenizer_dir") == "tok" and parameter(cfg, "max_input_tokens", integer) == 512
    assert parameter(cfg, "add_special_tokens", boolean) is None  # left unfilled: unset


def test_the_engine_models_unknown_parameters_are_refused() -> None:
    """A misspelt parameter of the legacy tensorrt_llm model left its setting at the default without a word
    (speculaton: off drafted adaptively); upstream's own parameters are taken (and not used), as fill_template takes
    them."""
    from serving.triton.engine_parameters import engine_parameters

    given = {"name": "tensorrt_llm", "parameters": {k: {"string_value": v} for k, v in (
        ("speculaton", "off"), ("num_draft_token", "1"), ("batch_scheduler_policy", "guaranteed_no_evict"))}}
    with pytest.raises(ValueError) as e:
        engine_parameters(given, decoupled=True)
    assert str(e.value).startswith("model tensorrt_llm: unknown parameter(s) num_draft_token, speculaton (its "
                                   "parameters: cancellation_check_period_ms, device, ")
    del given["parameters"]["speculaton"], given["parameters"]["num_draft_token"]
    assert engine_parameters(given, decoupled=True).executor.speculation == "adaptive"


def test_a_refusal_of_unknown_keys_shows_a_few_of_them_shortened() -> None:
    """Every unknown generate key was joined into the error: 100,000 keys made an error as long as the body (found by
    an adversarial run). A few are shown, each cut short, with how many more there were."""
    import json

    from serving.request_validation import SHOWN_KEY_CHARS, SHOWN_KEYS, RequestError, no_unknown_parameters

    keys = {f"k{i:03d}" + "x" * 1000: 1 for i in range(100)}
    with pytest.raises(RequestError) as e:
        no_unknown_parameters(json.dumps(keys), "tensorrt_llm")
    shown = ", ".join(f"k{i:03d}" + "x" * (SHOWN_KEY_CHARS - 4) for i in range(SHOWN_KEYS))
    assert str(e.value) == (f"unknown parameter(s) {shown} and {100 - SHOWN_KEYS} more: tensorrt_llm takes inputs "
                            "only (a generate endpoint's JSON keys must be input names)")
    with pytest.raises(RequestError, match=r"^unknown parameter\(s\) max_token: tensorrt_llm takes inputs only"):
        no_unknown_parameters('{"max_token": 3}', "tensorrt_llm")


def test_the_engine_models_refuse_a_second_instance() -> None:
    """instance_group count 2 loaded two executors: a stop request reached one of them (4 of 4 stops did nothing in
    an adversarial run) and the KV-cache metrics of both carried the same labels."""
    from serving.triton.parameters import check_one_instance

    check_one_instance({"name": "tensorrt_llm", "instance_group": [{"count": 1, "kind": "KIND_CPU"}]})
    check_one_instance({"name": "tensorrt_llm", "instance_group": [{"count": 1, "kind": "KIND_GPU", "gpus": [3]}]})
    # Triton lists every visible GPU in a KIND_GPU group that names none, and runs `count` instances on each
    for groups in ([{"count": 2, "kind": "KIND_CPU"}], [{"count": 1}, {"count": 1}],
                   [{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]):
        with pytest.raises(ValueError) as e:
            check_one_instance({"name": "tensorrt_llm", "instance_group": groups})
        assert str(e.value) == ("model tensorrt_llm: instance_group count 2: one instance serves every request, "
                                "batched in flight by its executor (more would each load the model and a KV cache, "
                                "and a stop request or the metrics would reach one of them); set count: 1 in "
                                "config.pbtxt")


def test_executor_messages_are_named_as_deployed() -> None:
    """A load error of the executor names each setting as the model's file does; an engine's own limit, a flag and a
    dotted key keep their names."""
    from serving.triton.engine_parameters import SETTING_NAMES as LEGACY
    from serving.triton.llmapi_config import SETTING_NAMES as LLMAPI
    from serving.triton.parameters import named_as_deployed

    message = ("max_batch_size 16 exceeds the engine's max_batch_size 8; rebuild the engine with --max_batch_size 16; "
               "kv_cache_config.max_tokens kv_cache_tokens free_memory_fraction")
    assert named_as_deployed(message, LEGACY) == (
        "executor_max_batch_size 16 exceeds the engine's max_batch_size 8; rebuild the engine with --max_batch_size 16; "
        "kv_cache_config.max_tokens max_tokens_in_paged_kv_cache kv_cache_free_gpu_mem_fraction")
    assert named_as_deployed("num_draft_tokens 3 needs max_num_tokens >= 4", LLMAPI) == \
        "speculative_config.max_draft_len 3 needs max_num_tokens >= 4"
    assert named_as_deployed("device cuda: torch here sees 0 CUDA device(s); use device cpu", LLMAPI) == \
        "triton_config.device cuda: torch here sees 0 CUDA device(s); use triton_config.device cpu"
    assert named_as_deployed(message, {}) == message


def test_a_stop_reaches_the_clients_request_and_the_bls_one_made_for_it_only() -> None:
    """The BLS calls tensorrt_llm as `<client id>#<32 hex digits>`; a stop for `job` must not end `job#1` or the BLS
    request of a client whose id is `job#1`."""
    from serving.triton.contract import engine_request_id, made_for

    assert made_for("job", "job") and made_for(engine_request_id("job"), "job")
    assert made_for(engine_request_id("job#1"), "job#1") and not made_for(engine_request_id("job#1"), "job")
    assert not made_for("job#1", "job") and not made_for("jobs", "job") and not made_for("job", "jo")
    assert not made_for("job#" + "A" * 32, "job") and not made_for("job#" + "a" * 31, "job")
