"""Prefix caching: full KV blocks named by a hash chained over their tokens, reused by later requests.

A block's key is sha256(parent block's key + its token ids): equal keys mean the same tokens at the same
positions after the same prefix, hence the same target KV. Nothing else changes a block's content here (one
model and dtype per executor, no LoRA or multimodal inputs; sampling settings never touch the cache), so
nothing else enters the key. A cryptographic hash because a collision would silently serve another prompt's KV.

The MTP layer's latent rows live in the same blocks (its own cache layer, the same slots) but lag the target's:
the catch-up computes them only when a sequence next drafts, and the row at position p reads token p + 1, one
past the end of the block that holds p. So a block's MTP part is valid only once its owner's catch-up has
passed the block, and only for the next token it read (`BlockAllocator.mark_mtp`: the cache keeps one such block
per next token, for branches that split right after the block). A drafting sequence reuses a
block only with an MTP part valid for its own next token: the catch-up could not rebuild those rows, as it needs
the target's hidden states at those positions, which reuse skips computing. It recomputes them instead, unless
adaptive speculation would not draft now: it then takes the whole chain and stops drafting (`Scheduler`). A
sequence that never drafts reuses blocks for their target KV alone.
"""

from __future__ import annotations

import hashlib
from array import array

from runtime.core.kv_cache import BlockAllocator
from runtime.core.sequence import Sequence


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PrefixCache:
    """Finds a waiting sequence's cached prefix and registers the blocks running sequences fill."""

    def __init__(self, allocator: BlockAllocator, block_size: int, mtp: bool):
        self.allocator, self.block_size = allocator, block_size
        self.mtp = mtp  # the executor drafts

    def drafts(self, seq: Sequence) -> bool:
        """Whether seq's MTP rows matter: the executor drafts and seq has not given up drafting."""
        return self.mtp and not seq.mtp_dropped

    def match(self, seq: Sequence) -> tuple[list[int], int]:
        """The longest chain of cached blocks `seq` can start from, and how many of them, from the first, have MTP
        rows it can use (all of them where it does not draft). At least its last token is left to compute (it must
        produce logits), and prompt logprobs not computed yet are not skipped. A drafting sequence also computes
        the token before its last: its first decode step drafts from the MTP layer's output there, which reads the
        target's hidden state there (skipped, that step could not draft)."""
        B = self.block_size
        limit = (seq.num_tokens - 1) // B
        if seq.params.prompt_logprobs is not None:
            limit = min(limit, seq.num_prompt_logprobs // B)
        keys = self._keys(seq, limit)
        blocks: list[int] = []
        with_mtp = 0
        for i in range(limit):
            next_token = seq.token_ids[(i + 1) * B]
            block = self.allocator.lookup(keys[i], next_token)
            if block is None:
                break
            if with_mtp == i and (i + 1) * B <= seq.num_tokens - 2 and self.allocator.mtp_next(block) == next_token:
                with_mtp += 1
            blocks.append(block)
        return blocks, with_mtp if self.drafts(seq) else len(blocks)

    def commit(self, seq: Sequence) -> None:
        """Register the blocks `seq` has filled since the last call (KV valid and tokens kept), and mark those
        its MTP rows now cover."""
        B = self.block_size
        full = min(seq.num_cached, seq.num_tokens) // B
        keys = self._keys(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.allocator.register(seq.block_table[i], keys[i])
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)
        if self.drafts(seq):
            covered = min(seq.num_mtp // B, full)
            for i in range(seq.num_mtp_blocks, covered):
                self.allocator.mark_mtp(seq.block_table[i], keys[i], seq.token_ids[(i + 1) * B])
            seq.num_mtp_blocks = max(seq.num_mtp_blocks, covered)

    def _keys(self, seq: Sequence, n: int) -> list[bytes]:
        """Keys of seq's first n full blocks (at least; computed once per sequence and kept)."""
        keys, B = seq.block_keys, self.block_size
        while len(keys) < n:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else b"", seq.token_ids[i * B : (i + 1) * B]))
        return keys
