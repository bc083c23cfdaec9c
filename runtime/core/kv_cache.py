"""Paged latent KV cache: fixed-size blocks, a pool of free (and cached) ones, one block table per sequence.

MLA caches only normalized c_kv and the roped shared key, (kv_lora_rank + qk_rope_head_dim) values
per token per layer, for every target layer and every MTP layer (the MTP layer attends over its
own cache at the same positions, through the same block table).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from pathlib import Path

import torch

from runtime.model.config import ModelConfig


class OutOfBlocks(RuntimeError):
    """The allocator cannot satisfy a request; the scheduler waits or preempts."""


class BlockAllocator:
    """Hands out KV blocks and takes them back, counting each block's holders (a reused prefix block is shared).

    A block whose content was registered under a prefix hash (runtime.core.prefix_cache) stays cached when its
    last holder frees it: a later request with that prefix takes it back as is, until the allocator needs it
    for new content. Free blocks are handed out in order: those caching nothing first, then cached ones least
    recently freed first (a sequence frees its tail first, so its prefix outlives its ending)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # first: handed out first
        self._hash: list[bytes | None] = [None] * num_blocks
        self._mtp_next: list[int | None] = [None] * num_blocks  # see mark_mtp
        # prefix hash -> {its block's mtp_next: the block}: one block without valid MTP rows (None), or blocks
        # whose MTP rows read different next tokens (branches that split right after the block)
        self._cached: dict[bytes, dict[int | None, int]] = {}
        self._num_cached = 0  # kept rather than counted: stats() reads it from other threads

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding registered prefix content, held or free."""
        return self._num_cached

    def allocate(self, n: int) -> list[int]:
        """n blocks for new content, evicting cached ones (least recently freed first) where needed."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one hold on each block (a block table's order: its tail becomes the first cached block to go)."""
        for block, n in Counter(blocks).items():  # all checked before any is freed
            if self._refs[block] < n:
                raise RuntimeError(f"KV block {block} freed while no sequence holds it")
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def take(self, blocks: list[int]) -> None:
        """Hold cached blocks (free or already held by other sequences) for a sequence that reuses them."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def free_after_taking(self, blocks: list[int]) -> int:
        """num_free once `blocks` are taken (the free ones among them stop being free)."""
        return len(self._free) - sum(self._refs[b] == 0 for b in blocks)

    def register(self, block: int, key: bytes) -> None:
        """Record that `block` holds the content hashed to `key`; a second block with the same content (two
        sequences computed it at once) stays unregistered, and is handed out again once freed, unless mark_mtp
        registers it."""
        if key not in self._cached and self._hash[block] is None:
            self._index(block, key, None)

    def lookup(self, key: bytes, next_token: int | None = None) -> int | None:
        """A block caching the content hashed to `key`: the one whose MTP rows read `next_token` where one does."""
        blocks = self._cached.get(key)
        if not blocks:
            return None
        return blocks.get(next_token, next(iter(blocks.values())))

    def mark_mtp(self, block: int, key: bytes, next_token: int) -> None:
        """The MTP layer's rows of `block`, which holds the content hashed to `key`, are all computed; its last one
        read `next_token`, the token after the block (the MTP input at position p is the target's hidden state at
        p and token p + 1). The block is cached for that next token beside the blocks whose MTP rows read others
        (where none caches it already), so each branch splitting right after it is reused with its MTP rows; it
        replaces a block caching that content without valid MTP rows, so a prefix first cached by a request that
        never drafted still becomes reusable by drafting ones."""
        target_only = self._cached.get(key, {}).get(None)
        if target_only is not None:
            self._evict(target_only)
            if self._refs[target_only] == 0:
                self._free.move_to_end(target_only, last=False)
        if self._hash[block] is None and next_token not in self._cached.get(key, {}):
            self._index(block, key, next_token)

    def mtp_next(self, block: int) -> int | None:
        """The token after the block its MTP rows were computed with; None: its MTP rows are not valid."""
        return self._mtp_next[block]

    def _index(self, block: int, key: bytes, next_token: int | None) -> None:
        self._cached.setdefault(key, {})[next_token] = block
        self._hash[block], self._mtp_next[block] = key, next_token
        self._num_cached += 1

    def _evict(self, block: int) -> None:
        key = self._hash[block]
        if key is not None:
            blocks = self._cached[key]
            del blocks[self._mtp_next[block]]
            if not blocks:
                del self._cached[key]
            self._hash[block] = self._mtp_next[block] = None
            self._num_cached -= 1

    def all_free(self) -> bool:
        """Every block is back in the pool, free or cached (no leak), and the cache's index is consistent."""
        indexed = [(key, t, b) for key, blocks in self._cached.items() for t, b in blocks.items()]
        return (len(self._free) == self.num_blocks and not any(self._refs)
                and all(blocks and (None not in blocks or len(blocks) == 1) for blocks in self._cached.values())
                and all(self._hash[b] == key and self._mtp_next[b] == t for key, t, b in indexed)
                and sum(h is not None for h in self._hash) == self._num_cached == len(indexed))


class KVCache:
    """[cache layers, (num_blocks + 1) * block_size, latent_dim] plus the allocator that hands out
    blocks 0 .. num_blocks - 1. The last block is scratch that no sequence owns: the padding rows of
    fixed-shape batches (CUDA graphs) write there."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.block_size = block_size
        self.num_layers = cfg.num_cache_layers
        self.scratch_block = num_blocks
        self.tensor = torch.zeros(self.num_layers, (num_blocks + 1) * block_size, cfg.latent_dim, dtype=dtype,
                                  device=device)
        self.allocator = BlockAllocator(num_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend a block table in place so it covers num_tokens positions (raises OutOfBlocks)."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need > 0:
            block_table.extend(self.allocator.allocate(need))

    def shrink(self, block_table: list[int], num_tokens: int) -> None:
        """Give back the blocks past num_tokens positions (after rejected drafts)."""
        keep = self.blocks_for(num_tokens)
        if len(block_table) > keep:
            self.allocator.free(block_table[keep:])
            del block_table[keep:]

    def reuse(self, block_table: list[int], blocks: list[int]) -> None:
        """Start an empty block table with cached prefix blocks, shared with whoever else holds them."""
        self.allocator.take(blocks)
        block_table.extend(blocks)

    def release(self, block_table: list[int]) -> None:
        self.allocator.free(block_table)
        block_table.clear()


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory this process can still take on `device`: CUDA's free memory; on CPU, the kernel's MemAvailable,
    lowered to what the cgroup (a container's limit, where its OOM killer acts) leaves; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    free = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")), None)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return free
    return free if limit == "max" or free is None else min(free, int(limit) - used)
