"""Instructions a code in the fp4 GEMVs' main loops, read from sm_90 machine code compiled on the CPU (no GPU).

    PYTHONPATH=<site-packages of triton 3.6> python -m benchmarks.diag_fp4_sass [--out FILE]
    python -m benchmarks.diag_fp4_sass --cuda [--out FILE]     (the CUDA form only: nvcc on PATH, and triton for
                                                               its nvdisasm)

Triton lays tiles out differently from one version to the next (s27: 3.9 and 3.6 differed), so compile with the
GPU machine's (3.6: ``python3 -m venv /tmp/v36 && /tmp/v36/bin/pip install triton==3.6.0``, then its
site-packages first on PYTHONPATH). For each kernel and tile (NVFP4, bf16 activations, whole steps, unit
strides as the launch specializes them): the longest loop of the SASS (nvdisasm over the cubin), its
instructions over the codes a thread decodes per step, and the commonest opcodes. A count, not a time: what
the card does with them (latency, pipes) is bench_fp4's to measure. ``--cuda``: the CUDA C++ form
(kernels/_fp4_cuda.py) at the configs its heuristic picks (and DEPTH 4 beside them), compiled by nvcc for sm_90,
with ptxas's register counts; its loop runs DEPTH chunks of 64 codes a thread. The GPU builds it otherwise (NVRTC
to PTX, the driver to SASS), so these counts stand in for the card's, not read there.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kpt_compiler.kernels import _fp4_cuda, _fp4_gemv, _fp4_mma, fp4_linear

from ._fp4_diag import sm90_cubin

KERNELS = {"f16x2": _fp4_gemv._fp4_gemv_h2_kernel, "f32": fp4_linear._fp4_gemv_kernel,
           "mma (decode=3)": _fp4_mma._fp4_mma_kernel, "dot (decode=2)": fp4_linear._fp4_linear_kernel}
TILES = [(8, 2048, 4), (16, 1024, 4), (32, 1024, 4), (32, 512, 4)]  # block_n, block_k, warps
DOT_TILES = [(64, 128, 4), (64, 256, 4), (128, 256, 8)]  # the dot forms: block_m 16, 3 stages
DIVISIBLE = ("x_ptr", "w_ptr", "s_ptr", "gs_ptr", "y_ptr", "stride_wn", "stride_sn", "stride_xm", "K", "N",
             "K_PER_SPLIT")


def sass(math: str, block_n: int, block_k: int, warps: int) -> str:
    k = KERNELS[math]
    const = {"stride_xk": 1, "stride_wk": 1, "stride_sk": 1, "stride_yn": 1, "E8M0": False, "BLOCK": 16,
             "BLOCK_N": block_n, "BLOCK_K": block_k, "ASM": True}
    if math == "f16x2":
        const["EVEN_K"] = True
    dot = math.startswith(("mma", "dot"))
    if dot:
        const["BLOCK_M"] = 16
    if math.startswith("dot"):
        const.update(PRECISION="ieee", SCALED_DOT=False, DECODE=2)
    types = ["*bf16", "*i32", "*u8", "*fp32", "*bf16"] + ["i32"] * 13
    sig = dict(zip(k.arg_names, types + ["constexpr"] * (len(k.arg_names) - len(types))))
    sig.update({c: "constexpr" for c in const})
    src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()},
                    attrs={(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": 3 if dot else 1})
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], check=True, capture_output=True, text=True).stdout


# nt, rw, wk, depth, async, rt (the last five: not picked by the heuristic)
CUDA_CONFIGS = [(1, 1, 8, 2, 0, 1), (1, 1, 2, 2, 0, 1), (2, 1, 8, 2, 0, 1), (1, 1, 8, 4, 0, 1), (1, 1, 8, 4, 1, 1),
                (2, 1, 8, 4, 1, 1), (1, 1, 2, 6, 1, 1), (2, 1, 4, 4, 1, 2), (2, 1, 2, 4, 1, 4),
                # s44: more warps along K (bench_fp4's wk 12/16 sweep configs), and the M=16 default
                (1, 1, 12, 2, 0, 1), (1, 1, 12, 2, 1, 1), (1, 1, 12, 4, 1, 1), (1, 1, 16, 2, 1, 1), (2, 1, 8, 2, 1, 2),
                (2, 1, 12, 2, 1, 2)]


def cuda_sass(nt: int, rw: int, wk: int, depth: int, asynchronous: int, rt: int) -> tuple[str, int]:
    """The SASS of one config and its registers (ptxas -v)."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as d:
        cubin, registers = sm90_cubin(_fp4_cuda.SOURCE, f"{nt}, {rw}, {wk}, {depth}, {asynchronous}, {rt}", d)
        return subprocess.run([str(nvdisasm), "-c", cubin], check=True, capture_output=True, text=True).stdout, registers


def loop_counts(text: str) -> tuple[int, collections.Counter]:
    """The longest backward branch's body: its instruction count and opcodes."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    best = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    ops = collections.Counter(m.group(1) for line in lines[best[0]:best[1] + 1]
                              if (m := re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9]+)", line)))
    return sum(ops.values()), ops


def cuda_rows() -> list:
    from kpt_compiler.bench import git_commit

    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    rows = [f"# The CUDA form's loop, compiled on the CPU ({datetime.date.today()}, commit {git_commit()})", "",
            "- command: `python -m benchmarks.diag_fp4_sass --cuda`",
            f"- {nvcc}, sm_90, NVFP4, bf16 x; loop = the longest loop's instructions (DEPTH chunks)", "",
            "| nt, rw, wk, depth, async, rt | registers | loop instructions | codes a thread a loop | "
            "instructions a code | commonest opcodes |", "| --- | --- | --- | --- | --- | --- |"]
    for cfg in CUDA_CONFIGS:
        text, registers = cuda_sass(*cfg)
        n, ops = loop_counts(text)
        codes = 64 * cfg[3] * cfg[5]
        rows.append(f"| {', '.join(map(str, cfg))} | {registers} | {n} | {codes} | {n / codes:.2f} | "
                    + ", ".join(f"{o} {c}" for o, c in ops.most_common(6)) + " |")
    return rows


def triton_rows() -> list:
    rows = [f"triton {triton.__version__}, sm_90, NVFP4, bf16 x; loop = the longest loop's instructions",
            "| form | block_n, block_k, warps | loop instructions | codes a thread a step | instructions a code | "
            "commonest opcodes |", "| --- | --- | --- | --- | --- | --- |"]
    for math in KERNELS:
        for bn, bk, warps in DOT_TILES if math.startswith(("mma", "dot")) else TILES:
            n, ops = loop_counts(sass(math, bn, bk, warps))
            codes = bn * bk // (32 * warps)
            rows.append(f"| {math} | {bn}, {bk}, {warps} | {n} | {codes} | {n / codes:.2f} | "
                        + ", ".join(f"{o} {c}" for o, c in ops.most_common(6)) + " |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.add_argument("--cuda", action="store_true", help="the CUDA form only (nvcc)")
    args = p.parse_args(argv)
    rows = cuda_rows() if args.cuda else triton_rows()
    table = "\n".join(rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
