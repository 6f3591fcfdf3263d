"""Paged KV block manager: a fixed pool of blocks, one block table per sequence.

Sequence s with n tokens of KV owns blocks ``table[s][0 .. ceil(n / B) - 1]``; token j
lives in block ``table[s][j // B]`` at offset ``j % B`` (B = block size). Blocks are
reference counted: with the prefix cache on, a full block can sit in several tables.

Block states:
    free       refcount 0, not cached             -> handed out first
    evictable  refcount 0, cached (hash known)    -> reused by a later identical prefix,
                                                     or evicted (least recently freed first)
    in use     refcount >= 1

Allocation never partially succeeds: ``ensure`` either grows a table to the requested
size or changes nothing and returns False, so the scheduler can preempt and retry.

In-flight prefixes: the full prompt blocks a sequence will publish but has not computed yet
are recorded by hash, so ``prefix_in_flight`` can tell the scheduler that a waiting request
would compute the same block at the same time (``n`` choices of one prompt, a burst of
requests with one system prompt); it waits for the block to be published and reuses it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Optional, Sequence

from runtime.kv.prefix_cache import PrefixCache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: Optional[PrefixCache] = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"block manager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: "OrderedDict[int, None]" = OrderedDict()
        self._tables: dict[str, list[int]] = {}
        # Per sequence: the hash chain of its leading full blocks that are known (hit or committed).
        self._hashes: dict[str, list[bytes]] = {}
        self._seeds: dict[str, bytes] = {}
        self._lookups: dict[str, tuple[int, int]] = {}  # seq -> (queried, hit) blocks of a lookup not yet counted
        # Prompt blocks a sequence will publish, not computed yet: seq -> hashes in order, and hash -> how many such sequences.
        self._to_publish: dict[str, deque[bytes]] = {}
        self._in_flight: dict[bytes, int] = {}
        # seq -> (seed, tokens, hash chain of its full prompt blocks but the last token's): hashed once
        # while it waits (``prefix_in_flight`` asks every step) and again at admission.
        self._chains: dict[str, tuple[bytes, int, list[bytes]]] = {}

    # ---- sizes -------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    def table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    @property
    def total_refcount(self) -> int:
        return sum(self._refcount)

    # ---- prefix cache --------------------------------------------------------------
    def acquire_prefix(self, seq_id: str, seed: Optional[bytes], token_ids: Sequence[int], reuse: bool = True) -> int:
        """Start ``seq_id``'s table with cached blocks of its prefix; returns the tokens reused.

        At most ``len(token_ids) - 1`` tokens are reused, so at least one token runs and
        produces logits. ``seed`` is the prefix cache's per-(base, adapter, version) seed.
        ``reuse=False``: reuse nothing (a request that needs every prompt position's logits),
        but still publish the blocks it computes for later requests.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        self._tables[seq_id] = []
        self._hashes[seq_id] = []
        if self.prefix_cache is None or seed is None:
            return 0
        self._seeds[seq_id] = seed
        cacheable = (len(token_ids) - 1) // self.block_size
        hashes = self._chain(seq_id, seed, token_ids)
        if reuse:
            for block_hash in hashes:
                block = self.prefix_cache.lookup(block_hash)
                if block is None:
                    break
                self._take(block)
                self._tables[seq_id].append(block)
                self._hashes[seq_id].append(block_hash)
            # Counted by ``count_prefix_lookup`` once the admission holds, so a retried admission counts once.
            self._lookups[seq_id] = (cacheable, len(self._hashes[seq_id]))
        # Each hash is recorded for ``free`` only once counted: an interrupt half-way leaves the two balanced.
        to_publish = self._to_publish[seq_id] = deque()
        for block_hash in hashes[len(self._hashes[seq_id]) :]:
            self._in_flight[block_hash] = self._in_flight.get(block_hash, 0) + 1
            to_publish.append(block_hash)
        return len(self._hashes[seq_id]) * self.block_size

    def prefix_in_flight(self, seq_id: str, seed: Optional[bytes], token_ids: Sequence[int]) -> bool:
        """Would waiting sequence ``seq_id`` compute a block another sequence is computing now?

        True when the first of its full prompt blocks that the cache does not hold is one a
        running sequence will publish (``acquire_prefix`` recorded it); waiting for it costs at
        most that sequence's prefill and saves computing the block twice."""
        if self.prefix_cache is None or seed is None or not self._in_flight:
            return False
        for block_hash in self._chain(seq_id, seed, token_ids):
            if self.prefix_cache.lookup(block_hash) is None:
                return block_hash in self._in_flight
        return False

    def _chain(self, seq_id: str, seed: bytes, token_ids: Sequence[int]) -> list[bytes]:
        """The hash chain of ``token_ids``' full blocks but the one with the last token, kept
        per sequence until ``free``. A sequence's tokens only ever grow (a preempted one comes
        back with its output appended), so the seed and the token count identify them."""
        kept = self._chains.get(seq_id)
        if kept is None or kept[0] != seed or kept[1] != len(token_ids):
            kept = (seed, len(token_ids), PrefixCache.chain(seed, token_ids, self.block_size, (len(token_ids) - 1) // self.block_size))
            self._chains[seq_id] = kept
        return kept[2]

    def count_prefix_lookup(self, seq_id: str) -> None:
        """Add ``seq_id``'s prefix lookup to the cache's hit statistics (its admission went through)."""
        queried, hit = self._lookups.pop(seq_id, (0, 0))
        if self.prefix_cache is not None:
            self.prefix_cache.queried_blocks += queried
            self.prefix_cache.hit_blocks += hit

    def has_blocks_to_commit(self, seq_id: str, num_computed: int) -> bool:
        """Whether ``commit`` would publish a block now (one became full and computed): the caller
        then builds the token list it needs, once per block rather than every step."""
        if self.prefix_cache is None or seq_id not in self._seeds:
            return False
        return len(self._hashes[seq_id]) < min(num_computed // self.block_size, len(self._tables[seq_id]))

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Publish every newly full, computed block of ``seq_id`` in the prefix cache."""
        if self.prefix_cache is None or seq_id not in self._seeds:
            return
        hashes = self._hashes[seq_id]
        table = self._tables[seq_id]
        full = min(num_computed // self.block_size, len(table))
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else self._seeds[seq_id]
            block_hash = PrefixCache.extend_chain(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(block_hash)
            # If another sequence already published this content, keep ours private.
            self.prefix_cache.insert(block_hash, table[i])
            pending = self._to_publish.get(seq_id)
            if pending and pending[0] == block_hash:
                self._done_in_flight(pending.popleft())

    # ---- allocation ------------------------------------------------------------------
    def ensure(self, seq_id: str, num_tokens: int) -> bool:
        """Grow ``seq_id``'s table to hold ``num_tokens``; all or nothing."""
        table = self._tables.setdefault(seq_id, [])
        self._hashes.setdefault(seq_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            table.append(self._allocate())
        return True

    def free(self, seq_id: str) -> None:
        """Drop ``seq_id``'s table. Cached blocks stay reusable until evicted."""
        table = self._tables.pop(seq_id, [])
        self._hashes.pop(seq_id, None)
        self._seeds.pop(seq_id, None)
        self._lookups.pop(seq_id, None)  # a lookup whose admission failed is not counted
        self._chains.pop(seq_id, None)
        for block_hash in self._to_publish.pop(seq_id, ()):
            self._done_in_flight(block_hash)
        # Release tail first: the evictable LRU then evicts the sequence's last blocks
        # before its first ones, which are the ones other prompts are likeliest to share.
        for block in reversed(table):
            self._refcount[block] -= 1
            if self._refcount[block] < 0:
                raise AssertionError(f"block {block} refcount went negative")
            if self._refcount[block] == 0:
                if self.prefix_cache is not None and self.prefix_cache.is_cached(block):
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def _done_in_flight(self, block_hash: bytes) -> None:
        left = self._in_flight[block_hash] - 1
        if left:
            self._in_flight[block_hash] = left
        else:
            del self._in_flight[block_hash]

    def _take(self, block: int) -> None:
        if self._refcount[block] == 0:
            self._evictable.pop(block, None)
        self._refcount[block] += 1

    def _allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            assert self.prefix_cache is not None
            self.prefix_cache.forget_block(block)
        self._refcount[block] = 1
        return block
