import random

from hypothesis import given, settings, strategies as st

import nanoinfer.engine.block_manager as bm_module
from nanoinfer.engine.block_manager import BlockManager, hash_block
from nanoinfer.step.sequence import Sequence
from nanoinfer.sampling_params import SamplingParams

BS = 16


def seq_of(tokens):
    return Sequence(list(tokens), SamplingParams(), BS)


def compute_all(bm: BlockManager, seq: Sequence):
    """Pretend a forward computed every token of the sequence."""
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq, seq.num_tokens)


def assert_all_free(bm: BlockManager):
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert bm.num_free_blocks == bm.num_blocks
    assert len(set(bm.free_uncached) | set(bm.free_cached)) == bm.num_blocks


def test_allocate_and_free():
    bm = BlockManager(10, BS)
    s = seq_of(range(40))
    assert bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    assert s.num_cached_tokens == 0
    bm.free(s)
    assert_all_free(bm)


def test_prefix_hit_chains_and_reuses_blocks():
    bm = BlockManager(10, BS)
    a = seq_of(range(50))
    assert bm.allocate(a)
    compute_all(bm, a)
    assert len(a.block_hashes) == 3
    # the chain: each hash covers the previous one
    h0 = hash_block(list(range(16)), None)
    assert a.block_hashes[0] == h0 and a.block_hashes[1] == hash_block(list(range(16, 32)), h0)
    b = seq_of(list(range(40)) + [999] * 5)  # shares two full blocks with a
    assert bm.allocate(b)
    assert b.num_cached_tokens == 32 and b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.free(a)
    bm.free(b)
    assert_all_free(bm)


def test_same_suffix_different_prefix_misses():
    bm = BlockManager(10, BS)
    a = seq_of(list(range(16)) + list(range(100, 116)) + [1])
    assert bm.allocate(a)
    compute_all(bm, a)
    b = seq_of(list(range(1, 17)) + list(range(100, 116)) + [1])  # block 1 equal, block 0 not
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_last_prompt_block_never_served_from_cache():
    bm = BlockManager(10, BS)
    a = seq_of(range(32))
    assert bm.allocate(a)
    compute_all(bm, a)
    b = seq_of(range(32))  # exactly two full blocks, both cached
    assert bm.allocate(b)
    assert b.num_cached_tokens == 16 and b.num_computed_tokens < b.num_tokens


def test_cached_blocks_survive_free_and_are_revived():
    bm = BlockManager(4, BS)
    a = seq_of(range(33))
    assert bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    assert_all_free(bm)
    b = seq_of(range(33))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 32
    assert bm.num_free_blocks == 1


def test_eviction_least_recently_freed_first():
    bm = BlockManager(4, BS)
    a, b = seq_of(range(17)), seq_of(range(100, 117))  # two blocks each; block 0 gets hashed
    for s in (a, b):
        assert bm.allocate(s)
        compute_all(bm, s)
    bm.free(a)  # a's cached block is freed before b's
    bm.free(b)
    c = seq_of(range(200, 240))  # 3 blocks: the 2 uncached ones, then evicts a's cached block
    assert bm.allocate(c)
    bm.free(c)
    x = seq_of(range(17))
    assert bm.allocate(x) and x.num_cached_tokens == 0  # a's prefix was evicted
    y = seq_of(range(100, 117))
    assert bm.allocate(y) and y.num_cached_tokens == 16  # b's survived


def test_hash_collision_guard(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda tokens, prev, keys=(): 42)
    bm = BlockManager(10, BS)
    a = seq_of(range(20))
    assert bm.allocate(a)
    compute_all(bm, a)
    b = seq_of(range(100, 120))  # same (forced) hash, different tokens
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table[0] != a.block_table[0]


def test_allocate_refuses_without_changing_state():
    bm = BlockManager(2, BS)
    s = seq_of(range(40))
    assert not bm.allocate(s)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_append_slot():
    bm = BlockManager(3, BS)
    s = seq_of(range(16))
    assert bm.allocate(s)
    s.append_token(7)  # 17 tokens: needs a second block
    assert bm.append_slot(s)
    assert len(s.block_table) == 2
    s.append_token(8)
    assert bm.append_slot(s)
    assert len(s.block_table) == 2
    s.num_inflight = 15  # 33 tokens counting those in flight: a third block
    assert bm.append_slot(s) and len(s.block_table) == 3
    s.num_inflight = 31  # a fourth block: none is free, nothing changes
    assert not bm.append_slot(s) and len(s.block_table) == 3


def test_prefix_caching_off_registers_nothing():
    bm = BlockManager(8, BS, prefix_caching=False)
    a = seq_of(range(40))
    assert bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    b = seq_of(range(40))
    assert bm.allocate(b) and b.num_cached_tokens == 0 and not bm.hash_to_block


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.integers(4, 40), st.integers(1, 60))
def test_random_workload_keeps_accounting(seed, num_blocks, num_ops):
    """Random allocate / compute / append / free: ref counts always equal the number of holders,
    free blocks have ref 0, and everything is free at the end."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 60))] for _ in range(3)]
    live: list[Sequence] = []
    for _ in range(num_ops):
        op = rng.random()
        if op < 0.45:
            s = seq_of(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 20))])
            if bm.allocate(s):
                assert s.num_computed_tokens < s.num_tokens
                live.append(s)
        elif op < 0.7 and live:
            s = rng.choice(live)
            compute_all(bm, s)
            s.append_token(rng.randrange(50))
            if not bm.append_slot(s):
                bm.free(s)
                live.remove(s)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        holders = {}
        for s in live:
            assert len(s.block_table) == s.num_blocks
            for b in s.block_table:
                holders[b] = holders.get(b, 0) + 1
        for block in bm.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)
        free = set(bm.free_uncached) | set(bm.free_cached)
        assert free == {b.block_id for b in bm.blocks if b.ref_count == 0}
        for h, block_id in bm.hash_to_block.items():
            assert bm.blocks[block_id].hash == h
    for s in live:
        bm.free(s)
    assert_all_free(bm)


def test_image_keys_separate_blocks_with_equal_tokens():
    """Blocks whose tokens are equal but whose images differ (Sequence.block_keys) never hit each
    other; the same image does; blocks after the image chain its key."""
    import numpy as np

    from nanoinfer.multimodal.inputs import ImageItem, MultiModalInputs

    def with_image(key):
        s = seq_of([7] * 40)
        image = ImageItem(offset=2, num_tokens=10, key=key, pixel_values=np.zeros((1, 1)), grid_thw=(1, 2, 20))
        s.multi_modal = MultiModalInputs((image,), np.zeros((3, 40), dtype=np.int64), 0)
        return s

    bm = BlockManager(12, BS)
    a = with_image(1)
    assert bm.allocate(a)
    compute_all(bm, a)
    b = with_image(2)
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0
    c = with_image(1)
    assert bm.allocate(c)
    assert c.num_cached_tokens == 2 * BS
