"""Adapter-aware prefix cache: content hashes of full KV blocks -> block ids.

The KV of a block depends on every token before it, on the base weights and on the
adapter that produced it (LoRA changes k/v projections and every hidden state). So
block i of a sequence is keyed by a hash chain

    h_{-1} = sha256("lorafleet-kv" | base_id | adapter name | adapter version)   (no adapter: name = version = "")
    h_i    = sha256(h_{i-1} | tokens[i*B : (i+1)*B])                              (B = block size)

Two sequences share block i only if their bases, adapter names, adapter versions and
first (i+1)*B tokens are all equal. A hot update changes the version, hence h_{-1},
hence every h_i: KV is never shared across adapters or across versions of one name.
Only full blocks are cached; the block that holds the last prompt token is always
recomputed so the step has logits to sample from.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

from runtime.request import AdapterRef


class PrefixCache:
    """hash -> block id for full, computed blocks (the block manager owns block lifetimes)."""

    def __init__(self, base_id: str) -> None:
        self.base_id = base_id
        self._by_hash: dict[bytes, int] = {}
        self._hash_of_block: dict[int, bytes] = {}
        # Hit statistics, once per request at its first admission (``BlockManager.count_prefix_lookup``):
        # its full prompt blocks but the last token's, and how many of them were reused from the cache.
        # A readmission after a preemption is not counted again: it would mostly hit the request's own
        # blocks, and preemptions would then raise the hit rate.
        self.queried_blocks = 0
        self.hit_blocks = 0

    def seed(self, adapter: Optional[AdapterRef]) -> bytes:
        name, version = (adapter.name, adapter.version) if adapter is not None else ("", "")
        text = "\x00".join(("lorafleet-kv", self.base_id, name, version))
        return hashlib.sha256(text.encode("utf-8")).digest()

    @staticmethod
    def chain(seed: bytes, token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
        """h_0 .. h_{num_blocks-1} for the first num_blocks full blocks of ``token_ids``."""
        hashes: list[bytes] = []
        parent = seed
        for i in range(num_blocks):
            chunk = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
            parent = hashlib.sha256(parent + chunk).digest()
            hashes.append(parent)
        return hashes

    @staticmethod
    def extend_chain(parent: bytes, token_ids: Sequence[int]) -> bytes:
        return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()

    def lookup(self, block_hash: bytes) -> Optional[int]:
        return self._by_hash.get(block_hash)

    def insert(self, block_hash: bytes, block: int) -> bool:
        """Register ``block`` under ``block_hash``; False if the hash already has a block."""
        if block_hash in self._by_hash or block in self._hash_of_block:
            return False
        self._by_hash[block_hash] = block
        self._hash_of_block[block] = block_hash
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of_block

    def forget_block(self, block: int) -> None:
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None:
            del self._by_hash[block_hash]

    def __len__(self) -> int:
        return len(self._by_hash)
