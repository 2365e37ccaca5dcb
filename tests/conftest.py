import os

import pytest
import torch

import kpt_compiler
import kpt_test_passes  # noqa: F401  (registers the test-only passes)

# Keep CPU tests quick and deterministic.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _fresh_compiler_state():
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    have_cuda = torch.cuda.is_available()
    try:
        import torch_xla  # noqa: F401
        have_xla = True
    except ImportError:
        have_xla = False
    for item in items:
        if "gpu" in item.keywords and not have_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the H100 machine: pytest -m gpu)"))
        if "xla" in item.keywords and not have_xla:
            item.add_marker(pytest.mark.skip(reason="needs torch_xla (scripts/test.sh runs these in .venv-xla)"))
