"""scheduling_policy="priority": a waiting sequence of a strictly higher priority that cannot be
admitted now preempts running ones of lower priority to take their place (vLLM's rule)."""
from nanoinfer.step.sequence import Sequence


def preempt_for_waiting(scheduler) -> None:
    """While the first waiting sequence ranks strictly above the lowest-priority running one and
    cannot be admitted now (no sequence slot, or too few free blocks for its prompt, less the
    prefix-cache hits running sequences hold, and this step's decode tokens), preempt that running
    one (`running` is kept in priority order: the lowest is last)."""
    head, bm, running = scheduler.waiting[0], scheduler.block_manager, scheduler.running

    def needs_block(s: Sequence) -> bool:  # its next decode token starts a block
        return s.num_tokens + s.num_inflight > len(s.block_table) * bm.block_size

    growth = sum(map(needs_block, running))
    while running and not head.num_inflight and head.priority < running[-1].priority:
        hits = bm.prefix_hits(head) if scheduler.uses_cache(head) else []
        if len(running) < scheduler.max_num_seqs and bm.num_free_blocks >= bm.blocks_taken(head, hits) + growth:
            return
        victim = running[-1]
        growth -= needs_block(victim)
        scheduler.preempt(victim)
