"""Upstream's per-request perf metrics as the Triton models return them: what each value is (PerfMetrics) and, once
for both flavours and the BLS that passes the legacy ones on, the output each goes out as (name and dtype)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PerfMetrics:
    """Upstream's per-request perf metrics. KV blocks: all a request holds (the blocks its tokens so far fill; 0
    where the backend's block size is unknown), of which `reused_blocks` came from the prefix cache and the rest
    are new; `missed_blocks` are its prompt's blocks not found there. First scheduled: arrival plus the executor's
    queueing time (0 when the backend does not report it, as upstream's unset times)."""

    acceptance_rate: float
    accepted_draft_tokens: int
    draft_tokens: int
    kv_blocks: int
    new_blocks: int
    reused_blocks: int
    missed_blocks: int
    kv_cache_hit_rate: float
    arrival_ns: int
    first_scheduled_ns: int
    first_token_ns: int
    last_token_ns: int


# (PerfMetrics field, dtype, the legacy tensorrt_llm model's output, the llmapi model's; None: not in that flavour),
# as upstream's config.pbtxt files name them (the legacy kv_cache_reused_blocks is the llmapi kv_cache_reused_block)
_OUTPUTS: tuple[tuple[str, type, str | None, str | None], ...] = (
    ("acceptance_rate", np.float32, "acceptance_rate", "acceptance_rate"),
    ("accepted_draft_tokens", np.int32, "total_accepted_draft_tokens", "total_accepted_draft_tokens"),
    ("draft_tokens", np.int32, "total_draft_tokens", "total_draft_tokens"),
    ("new_blocks", np.int32, "kv_cache_alloc_new_blocks", "kv_cache_alloc_new_blocks"),
    ("reused_blocks", np.int32, "kv_cache_reused_blocks", "kv_cache_reused_block"),
    ("missed_blocks", np.int32, None, "kv_cache_missed_block"),
    ("kv_blocks", np.int32, "kv_cache_alloc_total_blocks", "kv_cache_alloc_total_blocks"),
    ("kv_cache_hit_rate", np.float32, None, "kv_cache_hit_rate"),
    ("arrival_ns", np.int64, "arrival_time_ns", "arrival_time_ns"),
    ("first_scheduled_ns", np.int64, "first_scheduled_time_ns", "first_scheduled_time_ns"),
    ("first_token_ns", np.int64, "first_token_time_ns", "first_token_time_ns"),
    ("last_token_ns", np.int64, "last_token_time_ns", "last_token_time_ns"),
)
# flavour -> ((output name, PerfMetrics field, dtype), ...)
PERF_OUTPUTS: dict[str, tuple[tuple[str, str, type], ...]] = {
    flavour: tuple((row[column], row[0], row[1]) for row in _OUTPUTS if row[column] is not None)
    for flavour, column in (("legacy", 2), ("llmapi", 3))}
