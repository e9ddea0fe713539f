"""The scheduler's orders for scheduling_policy "priority" and "fcfs" (the latter refusing a
non-zero `priority`, as vLLM), and the check of the requests' `priority` option."""
from bisect import insort
from numbers import Integral

from nanoinfer.engine.wait_queue import FifoOrder
from nanoinfer.priority.preemption import preempt_for_waiting
from nanoinfer.priority.wait_queue import PriorityWaitQueue, priority_key


def check_priorities(priority, num_prompts: int, policy: str) -> list[int]:
    """One int per prompt (vLLM's `priority`: None is 0 for all, an int is that for all); with
    scheduling_policy="fcfs" only 0 is allowed, as vLLM."""
    if priority is None:
        return [0] * num_prompts
    one = isinstance(priority, Integral) and not isinstance(priority, bool)
    if not one and not isinstance(priority, (list, tuple)):
        raise ValueError(f"priority must be an int or a list of ints (one per prompt), got {type(priority).__name__}")
    values = [priority] * num_prompts if one else list(priority)
    if len(values) != num_prompts:
        raise ValueError(f"got {len(values)} priority values for {num_prompts} prompts; give one per prompt")
    for i, p in enumerate(values):
        if not isinstance(p, Integral) or isinstance(p, bool):
            raise ValueError(f"priority[{i}] must be an int, got {type(p).__name__}")
    if policy != "priority" and any(values):
        raise ValueError("priority is set but scheduling_policy is 'fcfs'; make the LLM with "
                         "scheduling_policy='priority'")
    return [int(p) for p in values]


class FcfsOrder(FifoOrder):
    """First come, first served; a request's `priority` may only be 0."""

    def priorities(self, priority, num_prompts: int) -> list[int]:
        return check_priorities(priority, num_prompts, "fcfs")


class PriorityOrder(FifoOrder):
    """The waiting queue by (priority, arrival); `running` kept in that order too, so the sequence
    preempted for memory, `running[-1]`, is the lowest-priority one; before each step a waiting
    sequence of a strictly higher priority that cannot be admitted preempts lower-priority ones."""

    def queue(self):
        return PriorityWaitQueue()

    def place(self, running: list, seq) -> None:
        insort(running, seq, key=priority_key)

    def start_step(self, scheduler) -> None:
        if scheduler.waiting and scheduler.running:
            preempt_for_waiting(scheduler)

    def priorities(self, priority, num_prompts: int) -> list[int]:
        return check_priorities(priority, num_prompts, "priority")


def order_for(config) -> FifoOrder:
    """The order the config's scheduling_policy names."""
    return PriorityOrder() if config.scheduling_policy == "priority" else FcfsOrder()
