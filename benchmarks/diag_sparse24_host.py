"""What one 2:4 call costs the host (issue 19): kernels/sparse24_linear.py's cuSPARSELt call against the dense
``F.linear``, issued 50 times without a CUDA graph (host ms per call: the time to issue them; wall: until the
device is done) and as a CUDA-graph replay (device time).

    python -m benchmarks.diag_sparse24_host      (CUDA)

Written after the zoo's BERT and ViT ran 3-7x slower with the pass on (2026-11-27-s16-zoo-2_4-d8e0d67-dirty.md):
torch's ``_cslt_sparse_mm`` sets up cuSPARSELt's plan on every call, which costs the host about 0.5 ms, so a
graph of them outside a CUDA graph is bound by the host.
"""

import time

import torch
import torch.nn.functional as F

from kpt_compiler.bench import median_ms
from kpt_compiler.kernels import sparse24_linear as kernel
from kpt_compiler.passes._sparse24 import prune_2_4

SHAPES = [(16384, 768, 3072), (8192, 4096, 14336), (16, 4096, 4096)]  # M, K, N: BERT's MLP up, Llama's down, decode


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for M, K, N in SHAPES:
        w = prune_2_4(torch.randn(N, K, device="cuda", dtype=torch.bfloat16))
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        s = kernel.compress(w, "cusparselt")
        s.alg_id = kernel.search_alg(s, M, x.dtype)
        row = []
        for name, fn in (("dense", lambda: F.linear(x, w)), ("2:4", lambda: kernel.sparse24_linear(x, s))):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                fn()
            host = (time.perf_counter() - t) / 50 * 1e3
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / 50 * 1e3
            row.append(f"{name}: host {host:.3f} ms/call, wall {wall:.3f}, graph {median_ms(fn, 'cuda', cuda_graph=True):.4f}")
        print(f"M,K,N={M},{K},{N}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
