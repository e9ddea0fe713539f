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
