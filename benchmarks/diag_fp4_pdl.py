"""What programmatic dependent launch (PDL, kernels/_pdl.py) gives the fp4 CUDA form, by timing with it on and off
(``_pdl.ENABLED``). Needs a GPU of sm_90 or newer.

    python -m benchmarks.diag_fp4_pdl [--layers 8] [--ms 1,8] [--shapes 4096x14336,4096x4096] [--decode]

- ``gemv``: one fp4 GEMV at a time, as bench_fp4 times it (CUDA-graph replays of back-to-back calls, 4 weights
  rotated): each call's kernel has the last call's kernel ahead of it.
- ``chain``: a decode-like step of ``--layers`` Llama layers (hidden 4096, MLP 14336, q, k and v as one 6144-row
  weight, gate and up as one 28672-row weight, random NVFP4 weights) with the small kernels between the GEMVs
  that a decode step has (an RMS norm, a scale, the residual adds, SiLU times up), eager torch ops, captured in
  a CUDA graph; beside it the same step with bf16 weights through ``torch.nn.functional.linear`` (cuBLAS).
- ``--decode``: bench_decode's step timing of ``kpt[fp4]`` on the zoo's 8-layer Llama at batch 1, in this process,
  PDL on and then off (each compiles afresh), written as ``--out``-pdl-on and -pdl-off.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kpt_compiler.bench import timing_ms
from kpt_compiler.kernels import _fp4_cuda, _pdl
from kpt_compiler.kernels import _fp4_format as fmt
from kpt_compiler.kernels.fp4_linear import fp4_linear

from .bench_fp4 import rotating

LAYER = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def timed(fn, rep_ms: float, pdl: bool):
    _pdl.ENABLED = pdl
    try:
        fn()
        return timing_ms(fn, "cuda", warmup_ms=rep_ms / 5, rep_ms=rep_ms, cuda_graph=True)
    finally:
        _pdl.ENABLED = True


def step_fn(layers: list[dict], x: torch.Tensor, linear):
    def step():
        h = x
        for w in layers:
            a = F.rms_norm(h, (h.shape[-1],))
            q = linear(a, w["qkv"])[:, :4096] * 0.125
            h = h + linear(q, w["o"])
            gate, up = linear(F.rms_norm(h, (h.shape[-1],)), w["gate_up"]).chunk(2, -1)
            h = h + linear(F.silu(gate) * up, w["down"])
        return h
    return step


def cell(t) -> str:
    return f"{t.median * 1e3:.1f} [{t.p20 * 1e3:.1f}, {t.p80 * 1e3:.1f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="4096x14336,4096x4096,28672x4096")
    p.add_argument("--ms", default="1,8")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rep-ms", type=float, default=100)
    p.add_argument("--decode", action="store_true")
    p.add_argument("--out", default="benchmarks/out/pdl")
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA-graph replays, us, median [p20, p80]")
    print("\n| what | M | PDL off | PDL on | off / on |\n| --- | --- | --- | --- | --- |")
    for shape in a.shapes.split(","):
        n, k = map(int, shape.split("x"))
        qs = [fmt.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02, fmt.NVFP4) for _ in range(4)]
        for m in map(int, a.ms.split(",")):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            cfg = _fp4_cuda.config(m, n, k, sms)
            fn = rotating(lambda q: _fp4_cuda.fp4_linear_cuda(x, q.packed, q.scales, q.global_scale, cfg), qs)
            off, on = timed(fn, a.rep_ms, False), timed(fn, a.rep_ms, True)
            print(f"| gemv {shape} | {m} | {cell(off)} | {cell(on)} | {off.median / on.median:.3f} |", flush=True)
    layers, dense = [], []
    for _ in range(a.layers):
        ws = {name: torch.randn(*nk, device="cuda", generator=g).bfloat16() * 0.02 for name, nk in LAYER.items()}
        layers.append({name: fmt.quantize(w.float(), fmt.NVFP4) for name, w in ws.items()})
        dense.append(ws)
    for m in map(int, a.ms.split(",")):
        x = torch.randn(m, 4096, device="cuda", generator=g).bfloat16()
        step = step_fn(layers, x, fp4_linear)
        off, on = timed(step, a.rep_ms, False), timed(step, a.rep_ms, True)
        bf16 = timed(step_fn(dense, x, F.linear), a.rep_ms, True)
        print(f"| chain of {a.layers} layers, fp4 | {m} | {cell(off)} | {cell(on)} | {off.median / on.median:.3f} |")
        print(f"| the same, bf16 F.linear | {m} | {cell(bf16)} | - | bf16 / fp4 with PDL {bf16.median / on.median:.2f},"
              f" without {bf16.median / off.median:.2f} |", flush=True)
    if a.decode:
        from . import bench_decode
        del layers, dense
        torch.cuda.empty_cache()
        for pdl in (True, False):
            _pdl.ENABLED = pdl
            bench_decode.main(["--modes", "kpt[fp4]", "--step", "--repeats", "3", "--batch", "1",
                               "--reference", "kpt[fp4]", "--out", f"{a.out}-pdl-{'on' if pdl else 'off'}"])
        _pdl.ENABLED = True


if __name__ == "__main__":
    main()
