"""Serving: the two servers over the executor and what they share. `serving.triton` is the Triton deployment (the
launcher, the model-repository writer with fill_template, the gRPC client, and what the Triton python models run);
`serving.openai_server` is the OpenAI-compatible server (dsv3-serve). Both refuse requests through
`request_validation` and take themselves down through `watchdog`; `quickstart` (the README's main job) runs both,
and `check_trtllm` checks the --backend trtllm path through the executor and Triton."""
