"""Fixed-size KV blocks with reference counts and an xxhash prefix cache.

A full block's hash chains the previous block's hash with its token ids (and the content hashes of
the images it covers), so it names the whole prefix up to that block; the first block chains from
the sequence's adapter, if any (`chain_start`). Hashes are registered only once a block's K/V are
computed (`commit`), so a hit never reads K/V a chunked prefill has not written yet. Freed blocks
keep their hash and can be hit until evicted, least recently freed first. Every hot-path operation
is O(1) per block.
"""
from array import array
from collections import OrderedDict, deque

import xxhash

from nanoinfer.step.sequence import Sequence


def hash_block(token_ids: list[int], prev_hash: int | None, keys: tuple[int, ...] = ()) -> int:
    """keys: what else the block's K/V depend on (Sequence.block_keys: image content hashes)."""
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if keys:
        h.update(array("Q", keys).tobytes())
    return h.intdigest()


def chain_start(seq: Sequence) -> int | None:
    """The hash the first block chains from: none for the base model, the adapter's id otherwise,
    so K/V computed under one adapter is never served to another (or to the base)."""
    lora_id = seq.lora_int_id
    return None if not lora_id else xxhash.xxh64_intdigest(b"lora" + lora_id.to_bytes(8, "little"))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: list[int] | None = None  # kept for hashed blocks: the collision guard


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching  # off: no hash is registered, so nothing is ever hit
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.num_hits = 0  # blocks served by the prefix cache so far
        self.num_queried_tokens = 0  # prompt tokens looked up in it so far (metrics/stats.py)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    def _take_free_block(self) -> int:
        if self.free_uncached:
            block_id = self.free_uncached.popleft()
        else:  # evict the least recently freed cached block
            block_id, _ = self.free_cached.popitem(last=False)
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = block.token_ids = None
        self.blocks[block_id].ref_count = 1
        return block_id

    def prefix_hits(self, seq: Sequence) -> list[tuple[int, int]]:
        """(block_id, hash) of the leading blocks served by the cache. The block holding the last
        token is never served: a prefill must compute at least one token to produce logits."""
        hits, prev = [], chain_start(seq)
        for i in range((seq.num_tokens - 1) // self.block_size):
            token_ids = seq.block(i)
            h = hash_block(token_ids, prev, seq.block_keys(i))
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append((block_id, h))
            prev = h
        return hits

    def allocate(self, seq: Sequence, use_cache: bool = True) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks if `use_cache`.
        Returns False (and changes nothing) when the pool cannot hold it now."""
        assert not seq.block_table
        hits = self.prefix_hits(seq) if use_cache else []
        if self.blocks_taken(seq, hits) > self.num_free_blocks:
            return False
        self.num_hits += len(hits)
        self.num_queried_tokens += seq.num_tokens if use_cache and self.prefix_caching else 0
        for block_id, h in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_cached[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
        for _ in range(seq.num_blocks - len(hits)):
            seq.block_table.append(self._take_free_block())
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        return True

    def blocks_taken(self, seq: Sequence, hits: list[tuple[int, int]]) -> int:
        """How many free blocks `allocate` takes for a waiting sequence with these prefix-cache hits
        (a hit on a free cached block takes it)."""
        revived = sum(1 for block_id, _ in hits if self.blocks[block_id].ref_count == 0)
        return seq.num_blocks - len(hits) + revived

    def free(self, seq: Sequence):
        # Tail blocks are freed first so they are evicted before the prefix blocks they extend.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.free_cached[block_id] = None
                else:
                    self.free_uncached.append(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Make sure the block table covers the sequence's newest token (in-flight ones included) and
        `lookahead` more (blocks beyond what is accepted stay, unhashed, for later tokens). Returns
        False (and changes nothing) when that needs more blocks than are free."""
        end = len(seq.token_ids) + seq.num_inflight + lookahead  # (num_tokens, read once per row and step)
        needed = -(-end // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def commit(self, seq: Sequence, num_computed: int):
        """Register the hashes of the sequence's blocks full within its first `num_computed` tokens
        (whose K/V a finished step has written)."""
        if not self.prefix_caching:
            return
        for i in range(len(seq.block_hashes), num_computed // self.block_size):
            token_ids = seq.block(i)
            h = hash_block(token_ids, seq.block_hashes[-1] if seq.block_hashes else chain_start(seq), seq.block_keys(i))
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block and block.hash is None:
                block.hash, block.token_ids = h, token_ids
                self.hash_to_block[h] = block.block_id
