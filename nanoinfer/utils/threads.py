"""How many torch threads a rank uses when the engine runs on CPU."""
import os

MAX_CPU_THREADS = 8  # a step is many small ops: more threads add barrier cost, not speed


def _usable_cores() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (a container's
    --cpus), both of which torch's default (one thread per core of the machine) ignores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def cpu_threads(world_size: int) -> int:
    """Threads per rank for torch.set_num_threads: the usable cores split across the world_size ranks,
    less one core left for everything else, between 1 and MAX_CPU_THREADS.

    Why not torch's default: its OpenMP threads meet at a barrier after every op (they spin, then
    sleep). When another process, or another rank, holds one of "their" cores, every op of every
    layer waits for the descheduled thread. On a loaded 2-core machine a run of the tiny model then
    took from about as long as with one thread to many times longer; with one thread it is steady."""
    return max(1, min(MAX_CPU_THREADS, (_usable_cores() - 1) // max(1, world_size)))
