"""Where the CUDA form's time goes at small M: the kernel timed with one stage left out (METHOD.md: time variants
that leave a stage out, and take differences). Needs a GPU with the CUDA form (sm_89+).

    python -m benchmarks.diag_fp4_decode_cost [--shapes 4096x14336,14336x4096] [--ms 1,16]

Variants of ``kernels/_fp4_cuda.SOURCE``'s ``pair`` (the decode of two codes into a bf16 pair, times the block
scale), each built by NVRTC as the real one is and run at the default config:
- ``as built``: the kernel as committed;
- ``no decode``: the word itself (plus T, so the four pairs differ) times the block scale in place of the
  decoded pair: the decode's three integer instructions a pair become one add; the scales are loaded,
  converted and multiplied as before;
- ``no decode, no scales``: the word plus T alone. The scales then feed nothing, so the compiler drops their
  loads and conversion too (about 11% of the bytes at NVFP4: the TB/s column still counts them).
The outputs of the variants are wrong by design; only their times mean anything. If ``no decode`` is much
faster than ``as built``, the decode's instructions, not the memory, bound the kernel at that shape.
Session 32's first run (``...-s32-fp4-decode-cost-cdbf354.md``) had ``no scale`` (the pair not multiplied) and
``no decode`` as ``no decode, no scales`` is here: in both the scales fed nothing.
"""

from __future__ import annotations

import argparse

import torch

from kpt_compiler.bench import timing_ms
from kpt_compiler.kernels import _fp4_cuda
from kpt_compiler.kernels import _fp4_format as fmt

from .bench_fp4 import rotating

LINE = "  return fma_bf16x2((v * ((T & 1) ? 0x104u : 0x1040u)) & 0x81C081C0u, s);"
VARIANTS = {
    "as built": LINE,
    "no decode": "  return fma_bf16x2(w + T, s);",
    "no decode, no scales": "  return w + T;",
}


def build(variant: str) -> None:
    assert LINE in _ORIGINAL, "kernels/_fp4_cuda.py's pair() changed: update this script"
    _fp4_cuda.SOURCE = _ORIGINAL.replace(LINE, VARIANTS[variant])
    _fp4_cuda._kernel.cache_clear()
    _fp4_cuda._COMPILED.clear()


_ORIGINAL = _fp4_cuda.SOURCE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="4096x14336,14336x4096")
    p.add_argument("--ms", default="1,16")
    p.add_argument("--rep-ms", type=float, default=30)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA-graph replays, median [p20, p80], "
          f"4 weights rotated")
    print("| N x K | M | config | variant | us | weight TB/s |\n| --- | --- | --- | --- | --- | --- |")
    for shape in a.shapes.split(","):
        n, k = map(int, shape.split("x"))
        qs = [fmt.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02, fmt.NVFP4) for _ in range(4)]
        for m in map(int, a.ms.split(",")):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            cfg = _fp4_cuda.config(m, n, k, sms)
            for variant in VARIANTS:
                build(variant)
                fn = rotating(lambda q: _fp4_cuda.fp4_linear_cuda(x, q.packed, q.scales, q.global_scale, cfg), qs)
                fn()
                t = timing_ms(fn, "cuda", warmup_ms=a.rep_ms / 5, rep_ms=a.rep_ms, cuda_graph=True)
                label = ",".join(f"{key}={v}" for key, v in sorted(cfg.items()) if key != "cuda")
                print(f"| {shape} | {m} | {label} | {variant} | {t.median * 1e3:.2f} [{t.p20 * 1e3:.2f}, "
                      f"{t.p80 * 1e3:.2f}] | {qs[0].nbytes() / (t.median * 1e-3) / 1e12:.2f} |", flush=True)
    build("as built")


if __name__ == "__main__":
    main()
