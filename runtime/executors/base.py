"""What every executor is: the contract the native executor and the TensorRT-LLM adapter keep and the settings
they share (`ExecutorConfig`: its limits and draft length rules are here for both; the native executor resolves it
against an engine once, into a `ServingPlan`). The choice between them is runtime.executors.backends'."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from runtime.core.draft_policy import check_speculation
from runtime.core.sampling_params import RelaxedAcceptance, SamplingParams
from runtime.core.scheduler import ServingLimits
from runtime.executors.handles import RequestHandle
from runtime.executors.outputs import RequestOutput
from runtime.io.engine_format import FREE_MEMORY_FRACTION, MAX_DRAFT_LEN, MIN_SEQ_LEN, BuildConfig, check_model_limits
from runtime.io.tokenizer import Tokenizer
from runtime.model.config import ModelConfig, is_bool, is_int, is_number


DEFAULT_DRAFT_TOKENS = 3  # when num_draft_tokens is not given and the model can draft


@dataclass
class ExecutorStats:
    """What an executor reports of its load, cache and speculation (`stats()`)."""

    running: int
    queued: int
    kv_blocks_used: int
    kv_blocks_free: int  # cached blocks no request holds included (evicted when new content needs them)
    requests_finished: int
    generated_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    current_draft_len: int
    acceptance_estimate: float
    kv_blocks_cached: int = 0  # blocks holding reusable prefix content, held by a request or free
    world_size: int = 1  # processes running the model (tensor/expert-parallel ranks)
    rank_memory_bytes: list[int] = field(default_factory=list)  # resident memory of each, rank 0 first
    kv_reused_blocks: int = 0  # prompt blocks found in the prefix cache, over every sequence admitted (n / best_of's
    # outputs count the blocks they share with their first; each output's stats count what its request found)
    kv_missed_blocks: int = 0  # and those not found

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class ServingPlan:
    """What the native executor serves an engine with: its ExecutorConfig resolved against the engine once
    (`ExecutorConfig.resolve`)."""

    limits: ServingLimits
    draft_len: int  # drafts per sequence and step at most (0: plain decoding)
    world_size: int  # processes running the model (one per tensor-parallel rank, or 1)


@dataclass(frozen=True)
class ExecutorConfig:
    """Serving settings; limits left as None come from the engine and may not exceed it."""

    num_draft_tokens: int | None = None  # None: DEFAULT_DRAFT_TOKENS (at most the engine's), 0 without MTP
    speculation: str = "adaptive"  # "off" | "fixed" | "adaptive"; "off" when num_draft_tokens is 0
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    # cache capacity in tokens (default: max_batch_size x max_seq_len, within free_memory_fraction)
    kv_cache_tokens: int | None = None
    # share of the memory free once the weights are loaded that the KV cache may take, as TensorRT-LLM's
    # kv_cache_config.free_gpu_memory_fraction (on CPU: of MemAvailable, within a container's limit)
    free_memory_fraction: float = FREE_MEMORY_FRACTION
    device: str = "cpu"
    dtype: str | None = None
    relaxed_acceptance: RelaxedAcceptance | None = None
    cpu_kernels: bool = True  # on CPU in float32: C++ kernels, weights as stored (runtime.model.kernels.modules)
    # in bfloat16, FP8-stored weights stay FP8 (runtime.model.fp8_linear): None where an FP8 product runs,
    # True everywhere, False never
    fp8_weights: bool | None = None
    cuda_graphs: bool = True  # on CUDA: forwards of <= 512 new tokens per sequence replay graphs (decodes': at start)
    # prefix caching: requests reuse the KV blocks of prefixes computed before (runtime.core.prefix_cache), as
    # TensorRT-LLM's kv_cache_config.enable_block_reuse
    enable_block_reuse: bool = True
    # processes to run an engine's tensor-parallel ranks in: None, its tp_size (one process per rank, started by
    # the executor, runtime.executors.ranks); 1, its rank files joined in this process
    world_size: int | None = None
    # load shedding, as SGLang's --max-queued-requests: a submit while this many requests wait to be scheduled is
    # refused (QueueFull: a server's 503 / UNAVAILABLE, for the client to retry); None: no bound, as vLLM
    max_queued_requests: int | None = None
    # a --backend trtllm engine: the LLM-API options to run it with instead of its own (an llmapi model.yaml's, as
    # upstream's llmapi model passes them to LLM()); refused for a native engine
    llm_api_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        if k is not None and (not is_int(k) or k < 0):
            raise ValueError(f"num_draft_tokens must be an integer >= 0, got {k!r}")
        check_speculation(self.speculation)
        if k == 0:  # drafting nothing is plain decoding, whatever the mode
            object.__setattr__(self, "speculation", "off")
        for name, low in (("max_batch_size", 1), ("max_num_tokens", 1), ("max_seq_len", MIN_SEQ_LEN),
                          ("kv_cache_tokens", 1), ("max_queued_requests", 1)):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("enable_block_reuse", "cpu_kernels", "cuda_graphs"):
            if not is_bool(getattr(self, name)):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not (is_number(self.free_memory_fraction) and 0 < self.free_memory_fraction <= 1):
            raise ValueError(f"free_memory_fraction must be in (0, 1], got {self.free_memory_fraction!r}")
        if self.fp8_weights is not None and not is_bool(self.fp8_weights):
            raise ValueError(f"fp8_weights must be true, false or unset, got {self.fp8_weights!r}")
        try:
            device = torch.device(self.device) if isinstance(self.device, str) else None
        except (RuntimeError, TypeError):
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:index], got {self.device!r}")
        if self.llm_api_options is not None and not isinstance(self.llm_api_options, dict):
            raise ValueError(f"llm_api_options must be a mapping of LLM-API options, got {self.llm_api_options!r:.80}")
        if self.world_size is not None and (not is_int(self.world_size) or self.world_size < 1):
            raise ValueError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        # numpy's values as Python's (a config is pickled to engine processes and compared)
        for name in ("num_draft_tokens", "max_batch_size", "max_num_tokens", "max_seq_len", "kv_cache_tokens",
                     "max_queued_requests", "world_size"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "free_memory_fraction", float(self.free_memory_fraction))
        for name in ("enable_block_reuse", "cpu_kernels", "cuda_graphs", "fp8_weights"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, bool(getattr(self, name)))

    def world_size_for(self, build: BuildConfig, source: str) -> int:
        """How many processes serve an engine of `build`: world_size, or its tp_size by default; ValueError
        naming world_size where that cannot run it."""
        world = build.tp_size if self.world_size is None else self.world_size
        if world not in (1, build.tp_size):
            raise ValueError(f"world_size {world}: {source} has tp_size {build.tp_size}; " + (
                "it runs in one process (world_size 1)" if build.tp_size == 1 else
                f"run it with world_size {build.tp_size} (a process per rank) or 1 (its ranks joined in one process)"))
        if world > 1 and torch.device(self.device).type != "cpu":
            raise ValueError(f"world_size {world} on {self.device}: ranks run on CPU (gloo) in this version; "
                             "use world_size=1 to join the ranks on one device")
        return world

    def resolve(self, build: BuildConfig, model: ModelConfig, source: str, built: bool = True, loaded: bool = False
                ) -> ServingPlan:
        """What the native executor serves an engine with (limits, draft length, processes), from engine.json /
        config.json alone, so a setting it refuses is refused before a weight loads (ValueError naming it). built
        False: a plain checkpoint, whose limits are defaults; loaded: the engine is loaded in this process already
        (one process, whatever its tp_size)."""
        world = 1 if loaded else self.world_size_for(build, source)
        if self.llm_api_options is not None:
            raise ValueError(f"llm_api_options: {source} is a native engine (LLM-API options run a --backend trtllm "
                             "engine on TensorRT-LLM); leave them unset")
        limits = self.limits_for(build, model, source, built)
        k = self.draft_len(build.max_draft_len, model.num_nextn_predict_layers, source, built)
        if k + 1 > limits.max_num_tokens:  # a step verifies a sequence's k drafts and one more token at once
            if self.num_draft_tokens is not None:
                raise ValueError(f"num_draft_tokens {k} needs max_num_tokens >= {k + 1} (a verification step runs the "
                                 f"drafts and one more token), got {limits.max_num_tokens}")
            k = limits.max_num_tokens - 1
        if self.relaxed_acceptance is not None:
            self.relaxed_acceptance.check_tokens(model.vocab_size)
        return ServingPlan(limits, k, world)

    def draft_len(self, max_draft_len: int, mtp_layers: int, source: str, built: bool = True) -> int:
        """The draft length to serve with (0: plain decoding): num_draft_tokens, or by default as many as the
        engine allows up to DEFAULT_DRAFT_TOKENS; ValueError naming num_draft_tokens where the model cannot."""
        if self.speculation == "off":
            return 0
        k = self.num_draft_tokens
        if k is None:
            return min(DEFAULT_DRAFT_TOKENS, max_draft_len) if mtp_layers else 0
        if k and mtp_layers == 0:
            raise ValueError(f"num_draft_tokens {k}: {source} has no MTP layer to draft with (num_nextn_predict_layers "
                             "is 0, or the checkpoint stores no MTP weights); use num_draft_tokens=0")
        if k > max_draft_len and built:
            raise ValueError(f"num_draft_tokens {k} exceeds the engine's max_draft_len {max_draft_len} ({source})")
        if k > MAX_DRAFT_LEN:  # a checkpoint has no max_draft_len of its own; an engine's is at most this
            raise ValueError(f"num_draft_tokens {k} exceeds {MAX_DRAFT_LEN}, the most the MTP module is re-run for "
                             f"({source})")
        return k

    def limits_for(self, build: BuildConfig, model: ModelConfig, source: str, built: bool = True) -> ServingLimits:
        """max_batch_size, max_num_tokens and max_seq_len to serve with: as asked, else as built; more than an
        engine was built for is refused naming the flag to rebuild with (a plain checkpoint's are defaults), and a
        max_seq_len past the model's max_position_embeddings is refused for both."""
        values = {}
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len"):
            asked, most = getattr(self, name), getattr(build, name)
            if asked is not None and asked > most and built:
                raise ValueError(f"{name} {asked} exceeds the engine's {name} {most} ({source}); "
                                 f"rebuild the engine with --{name} {asked}")
            values[name] = most if asked is None else asked
        if values["max_seq_len"] > build.max_seq_len:  # a plain checkpoint's (an engine's are checked at load)
            check_model_limits(model, dataclasses.replace(build, max_seq_len=values["max_seq_len"]), source)
        return ServingLimits(**values)


class ExecutorProtocol(Protocol):
    """What Session, the Triton models and the servers use of an executor."""

    config: ExecutorConfig | None
    model_config: ModelConfig
    limits: ServingLimits
    tokenizer: Tokenizer
    kv_block_size: int  # tokens per KV block (0: the backend does not say)
    # the most drafts a request's num_draft_tokens may ask for (the native executor's draft length); None: the backend
    # checks it by a rule of its own (TensorRT-LLM takes none but its own draft length)
    request_draft_len: int | None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None,
               request_id: str | None = None, bounded: bool = True) -> RequestHandle: ...

    def cancel(self, request_id: str, handle: RequestHandle | None = None) -> None: ...

    def stats(self) -> ExecutorStats: ...

    def health(self, timeout_s: float) -> str | None: ...

    def shutdown(self, timeout: float | None = 30) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...


def submit_all(executor: ExecutorProtocol, prompts: list[list[int]], params: SamplingParams,
               request_ids: list[str] | None = None) -> list[RequestHandle]:
    """Submit several prompts as one call of a client's: every one is validated before any is submitted (submit
    validates one), and the queue bound (max_queued_requests) decides on the first alone: a request is taken or
    refused whole (bounding each prompt would refuse a request of more prompts than the batch and the bound hold
    even from an idle server, every time it is sent)."""
    if len(prompts) > 1:
        for ids in prompts:
            executor.validate(ids, params)
    handles: list[RequestHandle] = []
    try:  # a later submit can still fail (the executor stopped): those submitted are cancelled
        for i, ids in enumerate(prompts):
            handles.append(executor.submit(ids, params, request_id=None if request_ids is None else request_ids[i],
                                           bounded=i == 0))
    except BaseException:
        for h in handles:
            h.cancel()
        raise
    return handles
