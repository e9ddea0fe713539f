import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (must be set before kernels are defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(**kwargs) -> path of a tiny random checkpoint (build_tiny_checkpoint's
    arguments), built once per session for each distinct set of arguments."""
    from nanoinfer.utils.tiny_model import build_tiny_checkpoint

    built = {}

    def make(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in built:
            path = tmp_path_factory.mktemp("ckpt")
            built[key] = build_tiny_checkpoint(str(path), **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_qwen3(make_checkpoint):
    return make_checkpoint()


def _make_llm(path: str, **options):
    """A new LLM. On CUDA, unless the options size the KV pool, it holds max_num_seqs sequences of
    max_model_len (so never preempts) instead of a share of the GPU: engines built side by side then
    fit, and a tiny model does not get millions of blocks, whose bookkeeping takes seconds to build."""
    from nanoinfer import LLM
    from nanoinfer.config import Config

    if torch.cuda.is_available() and not {"num_kvcache_blocks", "gpu_memory_utilization"} & set(options):
        config = Config.from_options(path, **options)
        if config.device == "cuda":
            blocks_per_seq = -(-config.max_model_len // config.kvcache_block_size)
            options["num_kvcache_blocks"] = config.max_num_seqs * blocks_per_seq
    return LLM(path, **options)


@pytest.fixture(scope="session")
def make_llm():
    """make_llm(path, **options) -> a new LLM, its KV pool sized as _make_llm says; the caller exits it."""
    return _make_llm


@pytest.fixture(scope="module")
def shared_llm():
    """shared_llm(path, **options) -> the module's one LLM for this path and these options, made by
    make_llm on first use and exited after the module's last test: tests that build the same engine
    share it. Only for tests that leave it as they found it (every request finished or aborted) and
    assert nothing about its history (step log, counters)."""
    built = {}

    def get(path: str, **options):
        key = (path, tuple(sorted(options.items())))
        if key not in built:
            built[key] = _make_llm(path, **options)
        return built[key]

    yield get
    for llm in built.values():
        llm.exit()


@pytest.fixture(scope="session")
def make_vl_checkpoint(tmp_path_factory):
    """make_vl_checkpoint(**sizes) -> path of a tiny random Qwen2.5-VL checkpoint (2-layer vision
    tower, the PIL image processor, a tokenizer with the vision tokens), built once per set of sizes."""
    pytest.importorskip("PIL")
    from nanoinfer.multimodal.tiny_model import build_tiny_vl_checkpoint

    built = {}

    def make(**sizes):
        key = tuple(sorted(sizes.items()))
        if key not in built:
            built[key] = build_tiny_vl_checkpoint(str(tmp_path_factory.mktemp("vl")), **sizes)
        return built[key]

    return make
