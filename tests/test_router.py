"""The data-parallel router: prefix keys as the block manager hashes them, affinity, overload
fallback, ties taken in turn, dead replicas skipped, a restarted replica's keys forgotten."""
import pytest

from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.step.sequence import Sequence
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.serve.router import PrefixAffinityRouter, RoundRobinRouter, prefix_token_ids

BS = 16


def test_prefix_keys_are_the_block_managers_hashes():
    """A prompt's keys are the hashes its first full blocks get in the prefix cache (the last
    token's block left out, as a prefix hit leaves it out)."""
    router = PrefixAffinityRouter(2, BS, depth=4)
    tokens = list(range(100, 100 + 5 * BS + 3))
    manager = BlockManager(16, BS)
    seq = Sequence(tokens, SamplingParams(), BS)
    assert manager.allocate(seq)
    manager.commit(seq, len(tokens))
    assert router.prefix_keys(tokens) == seq.block_hashes[:4]
    assert PrefixAffinityRouter(2, BS, depth=8).prefix_keys(tokens) == seq.block_hashes[:5]
    assert router.prefix_keys(tokens[:2 * BS + 1]) == seq.block_hashes[:2]
    assert router.prefix_keys(tokens[:2 * BS]) == seq.block_hashes[:1]  # the block with the last token
    assert router.prefix_keys(tokens[:BS]) == router.prefix_keys([]) == router.prefix_keys(None) == []
    assert router.prefix_keys([2**70] * 40) == []  # not token ids: no affinity (the engine rejects it)


def test_prefix_token_ids_of_server_prompts():
    assert prefix_token_ids([1, 2, 3]) == [1, 2, 3]
    assert prefix_token_ids({"prompt": "x", "prompt_token_ids": [4, 5]}) == [4, 5]
    assert prefix_token_ids("text") is None and prefix_token_ids({"prompt": "x"}) is None


def test_affinity_follows_the_longest_known_prefix():
    router = PrefixAffinityRouter(3, BS)
    system_a = list(range(10, 10 + 2 * BS))
    system_b = system_a[:BS] + list(range(500, 500 + BS))  # shares system_a's first block only
    a = router.prefix_keys(system_a + [1, 2, 3])
    b = router.prefix_keys(system_b + [1, 2, 3])
    assert a[0] == b[0] and a[1] != b[1]
    idle = [0, 0, 0]
    first = router.choose(a, idle)
    router.record(a, first)
    second = router.choose(b, idle)  # only its first block is known: it follows it there
    assert second == first
    router.record(b, 2)  # (sent elsewhere, e.g. because `first` was overloaded)
    assert router.choose(b, idle) == 2 and router.choose(a, idle) == first  # each its longest prefix
    assert router.choose(router.prefix_keys(list(range(900, 900 + 3 * BS))), idle) != first  # unknown: in turn


def test_without_affinity_ties_are_taken_in_turn_and_load_decides():
    router = PrefixAffinityRouter(3, BS)
    assert [router.choose([], [0, 0, 0]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert router.choose([], [50, 10, 30]) == 1
    assert router.choose([], [None, 10, None]) == 1
    assert router.choose([], [None, None, None]) is None


def test_an_overloaded_affine_replica_sends_the_request_to_the_least_loaded():
    router = PrefixAffinityRouter(2, BS, balance_abs_tokens=1000, balance_rel=2.0)
    keys = router.prefix_keys(list(range(3 * BS)))
    router.record(keys, 0)
    assert router.choose(keys, [900, 0]) == 0      # within the absolute slack
    assert router.choose(keys, [5000, 3000]) == 0  # under twice the least loaded
    assert router.choose(keys, [7000, 3000]) == 1  # both: overloaded
    assert router.choose(keys, [None, 3000]) == 1  # not serving


def test_forget_and_the_table_bound():
    router = PrefixAffinityRouter(2, BS, table_size=4)
    keys = router.prefix_keys(list(range(5 * BS)))  # 4 keys
    router.record(keys, 1)
    assert router.choose(keys, [0, 100]) == 1
    router.forget(1)
    assert router.choose(keys, [0, 100]) == 0
    router.record(keys, 1)
    router.record(router.prefix_keys(list(range(1000, 1000 + 2 * BS))), 0)  # evicts the oldest key
    assert len(router._owner) == 4
    assert router.choose(keys[:1], [0, 100]) == 0 and router.choose(keys, [0, 100]) == 1


def test_round_robin_skips_replicas_not_serving():
    router = RoundRobinRouter(3)
    assert [router.choose([], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert [router.choose([], [0, None, 0]) for _ in range(3)] == [2, 0, 2]
    assert router.choose([], [None] * 3) is None


@pytest.mark.parametrize("bad", [0, -1])
def test_data_parallel_size_is_checked(bad):
    from nanoinfer.data_parallel.devices import check_data_parallel_size, replica_envs
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        check_data_parallel_size(bad)
    with pytest.raises(TypeError, match="data_parallel_size must be an int"):
        check_data_parallel_size(2.0)
    assert replica_envs(2, {"device": "cpu"}) == [{}, {}]


def test_cuda_replicas_get_their_devices(monkeypatch):
    from nanoinfer.data_parallel.devices import replica_envs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,2")
    assert replica_envs(2, {"device": "cuda", "tensor_parallel_size": 2}) == \
        [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    with pytest.raises(ValueError, match="needs 6 CUDA devices; 5 are visible"):
        replica_envs(3, {"device": "cuda", "tensor_parallel_size": 2})


def test_router_benchmark_affinity_beats_round_robin(capsys):
    """The micro-benchmark's workload (shared system prompts, caches that hold only some of them):
    affinity hits the cache far more often than round robin, and balances the replicas."""
    import argparse
    import random

    from nanoinfer.bench import router as bench
    args = argparse.Namespace(system_prompts=8, system_len=128, user_len=(8, 32), output_len=16, requests=400,
                              block_size=16, cache_blocks=3 * (128 + 32) // 16)
    prompts = bench.make_workload(args, random.Random(0))
    affinity = bench.simulate(PrefixAffinityRouter(2, 16), prompts, 2, args)
    round_robin = bench.simulate(RoundRobinRouter(2, 16), prompts, 2, args)
    assert affinity["hit_rate"] > 1.5 * round_robin["hit_rate"], (affinity, round_robin)
    assert min(affinity["served"]) > 0.3 * len(prompts)
    assert bench.main(["--requests", "50", "--system-len", "64", "--replicas", "2"]) == 0
    assert "round robin" in capsys.readouterr().out
