"""What this GPU can do at best, measured in the same run as a kernel benchmark (CUDA only).

    python -m benchmarks.ceilings

``benchmarks/bench_<kernel>.py`` scripts call these and report their kernel as a fraction of the ceiling:
a memory-bound kernel against the copy bandwidth, a matmul against cuBLAS. ANCHORS.md has an H100's figures
(3.0 TB/s, 739 TFLOP/s at 8192^3); measuring here keeps the fraction honest on whatever card runs it.
"""

from __future__ import annotations

import sys

import torch

from kpt_compiler.bench import copy_bandwidth as _copy_bandwidth
from kpt_compiler.bench import timing_ms

__all__ = ["copy_bandwidth", "gemm_tflops"]


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("the ceilings are GPU figures: torch.cuda.is_available() is False")


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy in TB/s, counting the bytes read and the bytes written."""
    _require_cuda()
    return _copy_bandwidth(nbytes, "cuda")


def gemm_tflops(m: int = 8192, n: int = 8192, k: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """cuBLAS (torch.mm) at m x k @ k x n, in TFLOP/s (2*m*n*k flops)."""
    _require_cuda()
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    ms = timing_ms(lambda: torch.mm(a, b), "cuda").median
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def main() -> int:
    if not torch.cuda.is_available():
        print("error: the ceilings are GPU figures and torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    print(f"device-to-device copy (read + write): {copy_bandwidth():.2f} TB/s")
    for m, n, k in ((8192, 8192, 8192), (8192, 14336, 4096)):
        print(f"bf16 GEMM {m}x{n}x{k} (cuBLAS): {gemm_tflops(m, n, k):.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
