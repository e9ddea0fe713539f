"""What a timed region compiles and allocates (bench.py --log-compiles): Triton JIT compiles
(kernel, seconds; a compile found in Triton's disk cache counts too, it is still a load) and the
CUDA caching allocator's new device segments. A run that steady state would repeat exactly should
show none."""
import time

import torch


class CompileLog:
    """Context manager: while active, records Triton compiles through its JIT hooks."""

    def __init__(self):
        self.compiles: list[tuple[str, float]] = []
        self.new_segments = 0
        self._started = None

    def __enter__(self):
        from triton import knobs  # (Triton >= 3.4: the JIT hooks live in knobs.runtime)
        self._knobs = knobs.runtime
        self._saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
        self._segments = self._segment_count()
        return self

    def __exit__(self, *exc):
        self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._saved
        self.new_segments = self._segment_count() - self._segments
        return False

    @staticmethod
    def _segment_count() -> int:
        if not torch.cuda.is_available():
            return 0
        return torch.cuda.memory_stats().get("segment.all.allocated", 0)

    def _before(self, *args, **kwargs):
        self._started = time.perf_counter()
        return None  # (a true value would skip the compile)

    def _after(self, *args, repr: str = "?", **kwargs):
        took = time.perf_counter() - self._started if self._started is not None else 0.0
        self.compiles.append((repr, took))
        return None

    def report(self, name: str) -> str:
        total = sum(s for _, s in self.compiles)
        lines = [f"{name}: {len(self.compiles)} Triton compiles ({total:.2f} s), "
                 f"{self.new_segments} new CUDA allocator segments"]
        lines += [f"    {s * 1e3:8.1f} ms  {r[:300]}" for r, s in self.compiles]
        return "\n".join(lines)
