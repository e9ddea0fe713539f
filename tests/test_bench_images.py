"""bench.py --images runs end to end on CPU at a tiny size (its numbers are the H200's business)."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_bench_images_tiny_cpu():
    pytest.importorskip("PIL")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "bench.py", "--images", "3", "--vl-config", "tiny", "--image-size", "112",
                          "--image-input-len", "8", "--image-output-len", "4", "--max-model-len", "512"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Throughput:" in out.stdout and "vision encoder: 3 images" in out.stdout, out.stdout
