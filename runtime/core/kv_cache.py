"""Paged latent KV cache: fixed-size blocks, a free list, one block table per sequence.

MLA caches only normalized c_kv and the roped shared key, (kv_lora_rank + qk_rope_head_dim) values
per token per layer, for every target layer and every MTP layer (the MTP layer attends over its
own cache at the same positions, through the same block table).
"""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.model.config import ModelConfig


class OutOfBlocks(RuntimeError):
    """The allocator cannot satisfy a request; the scheduler waits or preempts."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are reused first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return out[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def all_free(self) -> bool:
        """Every block is on the free list exactly once (no leak, no double free)."""
        return sorted(self._free) == list(range(self.num_blocks))


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

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
        """(kv_lora_rank + qk_rope_head_dim) x element size x (target layers + MTP layers)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return cfg.latent_dim * elem * cfg.num_cache_layers

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
