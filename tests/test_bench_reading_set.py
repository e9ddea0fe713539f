"""The reading-set tool that counts issue 52's core: it follows the imports from LLM, stays out of
the feature folders, and --core keeps only the core's folders."""
from nanoinfer.bench.reading_set import CORE, FEATURE_DIRS, reading_set


def test_the_reading_set_follows_imports_and_skips_features():
    files = reading_set(tp1=False)
    assert "nanoinfer/llm.py" in files and "nanoinfer/engine/scheduler.py" in files
    assert "nanoinfer/config.py" in files  # reached through the engine's imports
    assert not any(f.startswith(FEATURE_DIRS) for f in files)
    assert "nanoinfer/engine/tp_executor.py" in files


def test_tp1_and_core_narrow_the_set():
    whole, tp1, core = reading_set(tp1=False), reading_set(tp1=True), reading_set(tp1=True, core=True)
    assert set(core) < set(tp1) < set(whole)
    assert "nanoinfer/engine/tp_executor.py" not in tp1
    assert all(f.startswith(CORE) for f in core)
    assert "nanoinfer/config.py" not in core and "nanoinfer/sampling/sampler.py" in core
