"""The fp4 kernels' small-M launches, to run under Nsight Compute (ncu reads hardware counters on the lent
Firecracker machines; METHOD.md: leave the clocks alone):

    ncu --clock-control none --kernel-name regex:"_fp4_(mma|linear|gemv_h2)_kernel" --launch-count 6 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats --section MemoryWorkloadAnalysis python -m benchmarks.diag_fp4_ncu

Three forms on NVFP4 4096x14336 (bf16 activations), each launched twice: the bf16-pair MMA form at M=16 (the
default there), the dot form with decode=2 at M=16, and the fp16-pair GEMV at M=1. What ncu says about
occupancy, stalls and bandwidth is its output's, not this script's.
"""

from __future__ import annotations

import torch

from kpt_compiler.kernels import _fp4_format as fmt
from kpt_compiler.kernels.fp4_linear import fp4_linear


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = fmt.quantize(torch.randn(4096, 14336, device="cuda", generator=g) * 0.02, fmt.NVFP4)
    x16 = torch.randn(16, 14336, device="cuda", generator=g).bfloat16()
    for name, x, cfg in (("mma M=16", x16, None), ("dot decode=2 M=16", x16, {"decode": 2}),
                         ("gemv M=1", x16[:1].contiguous(), None)):
        for _ in range(2):
            fp4_linear(x, q, config=cfg)
        torch.cuda.synchronize()
        print(name, flush=True)


if __name__ == "__main__":
    main()
