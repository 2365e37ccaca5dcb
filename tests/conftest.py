import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (read when a kernel is decorated, so before the
# kernels are imported). The interpreter's bf16 dot is wrong: kernel tests on the CPU use fp32 and fp16.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # torch_xla must register its device before autograd's engine starts (the first .backward())
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    torch_xla.device()
except ImportError:
    pass

import kpt_compiler
import kpt_test_passes  # noqa: F401  (registers the test-only passes)

# Keep CPU tests quick and deterministic.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Tests read what each pass did; an artifact from Inductor's caches (an earlier run) would skip the passes.
# test_cache.py turns the FX graph cache back on to test the cache keys.
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


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
