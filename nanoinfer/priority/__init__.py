"""scheduling_policy="priority": requests with a lower `priority` run first, ties by arrival; a
higher-priority arrival may preempt lower-priority running sequences (vLLM's rule). Attached as the
scheduler's order (engine/wait_queue.py's FifoOrder interface) by the composition place."""
