"""Which data-parallel replica serves a request: prefix affinity, then least outstanding tokens.

A prompt's affinity key is the chained hash of its first full KV blocks, computed as the block
manager computes them (`hash_block`), so two prompts with the same key share those blocks' K/V.
The router remembers which replica each key was last sent to; a request goes to the replica holding
its longest known prefix, where those blocks are likely still cached, unless that replica is
overloaded: then, as a request without a known prefix, to the replica with the fewest outstanding
tokens (ties taken in turn, so that an idle server spreads its requests). The table is an LRU of
bounded size; a restarted replica's keys are forgotten (its cache is empty).
"""
from collections import OrderedDict

from nanoinfer.engine.block_manager import hash_block

AFFINITY_BLOCKS = 4          # prefix blocks hashed per request: enough to tell shared system prompts apart
TABLE_SIZE = 1 << 16         # prefix keys remembered
BALANCE_ABS_TOKENS = 16384   # the affine replica is overloaded when it has this many more outstanding
BALANCE_REL = 2.0            # tokens than the least loaded one, and this many times as many


def prefix_token_ids(prompt) -> list[int] | None:
    """The token ids of a server prompt (a list of ids, or a {"prompt_token_ids": ...} dict); None
    for anything else (text, malformed): such a request has no affinity."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
    return ids if isinstance(ids, list) else None


class PrefixAffinityRouter:
    def __init__(self, num_replicas: int, block_size: int, depth: int = AFFINITY_BLOCKS,
                 table_size: int = TABLE_SIZE, balance_abs_tokens: int = BALANCE_ABS_TOKENS,
                 balance_rel: float = BALANCE_REL):
        self.num_replicas, self.block_size, self.depth = num_replicas, block_size, depth
        self.table_size, self.balance_abs_tokens, self.balance_rel = table_size, balance_abs_tokens, balance_rel
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica, least recently used first
        self._turn = 0  # where the next tie among the least loaded replicas starts

    def prefix_keys(self, token_ids: list[int] | None) -> list[int]:
        """The chained hashes of the prompt's first `depth` full blocks, as the block manager hashes
        them; the block holding the last token is left out, as a prefix hit leaves it out."""
        if not token_ids:
            return []
        bs = self.block_size
        keys, prev = [], None
        try:
            for b in range(min(self.depth, (len(token_ids) - 1) // bs)):
                prev = hash_block(token_ids[b * bs:(b + 1) * bs], prev)
                keys.append(prev)
        except (TypeError, OverflowError):  # not token ids: the engine rejects the request
            return []
        return keys

    def choose(self, keys: list[int], loads: list[int | None]) -> int | None:
        """The replica for a request with these prefix keys; loads: each replica's outstanding
        tokens, None for one not serving. None if no replica serves."""
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            return None
        n = self.num_replicas
        least = min(live, key=lambda i: (loads[i], (i - self._turn) % n))
        for key in reversed(keys):  # the longest prefix some replica was sent
            owner = self._owner.get(key)
            if owner is not None and loads[owner] is not None:
                if not self._overloaded(loads[owner], loads[least]):
                    return owner
                break
        self._turn = (least + 1) % n
        return least

    def _overloaded(self, load: int, least: int) -> bool:
        return load - least > self.balance_abs_tokens and load > self.balance_rel * least

    def record(self, keys: list[int], replica: int):
        """The request with these keys was sent to `replica`: its prefix is (about to be) cached there."""
        owner = self._owner
        for key in keys:
            owner[key] = replica
            owner.move_to_end(key)
        while len(owner) > self.table_size:
            owner.popitem(last=False)

    def forget(self, replica: int):
        """The replica restarted with an empty cache: its keys go (O(table), on a rare event)."""
        for key in [k for k, r in self._owner.items() if r == replica]:
            del self._owner[key]


class RoundRobinRouter:
    """The baseline (benchmarks): replicas in turn, skipping those not serving."""

    def __init__(self, num_replicas: int, block_size: int = 16):
        self.num_replicas, self.block_size, self._next = num_replicas, block_size, 0

    def prefix_keys(self, token_ids) -> list[int]:
        return []

    def choose(self, keys: list[int], loads: list[int | None]) -> int | None:
        for step in range(self.num_replicas):
            i = (self._next + step) % self.num_replicas
            if loads[i] is not None:
                self._next = i + 1
                return i
        return None

    def record(self, keys: list[int], replica: int):
        pass

    def forget(self, replica: int):
        pass
