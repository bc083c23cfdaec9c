"""The Triton deployment: `launch_triton_server` (launcher), `make_model_repo` (model_repo, with fill_template and
the two flavours' settings: engine_parameters for the legacy models' config.pbtxt, llmapi_config for the llmapi
model's model.yaml), `triton_client` (client), and the logic the Triton python models of triton_repo/ and
triton_repo_llmapi/ import: their parameters, contract and request readers (legacy_request, llmapi_request), the
engine model both flavours share (engine_model), the BLS (bls), preprocessing and postprocessing (text_processing),
the engine's published limits (engine_limits), perf metrics and responses. Its modules are imported by absolute name
(`serving.triton.<module>`) and nothing here puts `serving/` on sys.path, so it does not shadow the `triton` language
package of the GPU kernels (runtime/model/fp8_triton.py); a process started in `serving/` as its working directory
would, as Python and the Triton python stubs put the working directory first on sys.path."""
