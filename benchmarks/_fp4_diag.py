"""What the fp4 CUDA-form diagnoses (diag_fp4_splitk, diag_fp4_xring) share: an N x K NVFP4 weight with enough
copies to overflow L2 (as bench_fp4), rows of configs timed in CUDA-graph replays and checked against a reference
output, bf16 cuBLAS beside them, the table; and building a kernel-source variant with its shared memory."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from kpt_compiler.bench import relative_error, timing_ms
from kpt_compiler.kernels import _fp4_cuda
from kpt_compiler.kernels import _fp4_format as fmt
from kpt_compiler.kernels._fp4_cuda import edited  # noqa: F401  (the diagnoses' edits, as the kernel's own)
from kpt_compiler.kernels._launch import sm_count

from .bench_fp4 import copies_for, rotating


class Rows:
    """Timed rows (M, name, ms, relative error against the reference) over one weight's copies."""

    def __init__(self, n: int, k: int, rep_ms: float, device: str = "cuda"):
        self.n, self.k, self.rep_ms, self.device = n, k, rep_ms, device
        torch.manual_seed(0)
        w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
        q0 = fmt.quantize(w, fmt.NVFP4)
        self.qs = [q0] + [fmt.quantize(w, fmt.NVFP4) for _ in range(copies_for(q0.nbytes(), device) - 1)]
        self.ws = [w] + [w.clone() for _ in range(copies_for(2 * n * k, device) - 1)]
        self.sms = sm_count(torch.device(device))
        self.rows: list[dict] = []

    def _ms(self, fn, items) -> float:
        return timing_ms(rotating(fn, items), self.device, warmup_ms=self.rep_ms / 5, rep_ms=self.rep_ms,
                         cuda_graph=True).median

    def row(self, m: int, name: str, fn, ref):
        """``fn(q)`` timed over the copies; its output (None where it failed: printed, no row) for later rows."""
        try:
            out = fn(self.qs[0])
            err = relative_error(out.float(), ref.float()) if ref is not None else 0.0
            ms = self._ms(fn, self.qs)
        except Exception as e:  # noqa: BLE001 - a config that does not build or fit: on record, skipped
            print(f"  M={m} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return None
        self.rows.append(dict(M=m, name=name, ms=ms, rel_err=err))
        return out

    def bf16(self, m: int, x: torch.Tensor) -> None:
        self.rows.append(dict(M=m, name="bf16 cuBLAS", ms=self._ms(lambda w_: F.linear(x, w_), self.ws), rel_err=0.0))

    def default(self, m: int, x: torch.Tensor):
        """The CUDA form's own pick at this M, the reference of the rows after it."""
        pick = _fp4_cuda.config(m, self.n, self.k, self.sms)
        return self.row(m, f"default {pick}", lambda q: _fp4_cuda.fp4_linear_cuda(x, q.packed, q.scales,
                                                                                 q.global_scale, pick), None)

    def each_m(self, ms: str):
        """For each M of ``ms`` (comma-separated): (M, x, the default's output), after bf16's and the default's rows."""
        for m in (int(v) for v in ms.split(",")):
            x = torch.randn(m, self.k, device=self.device).to(torch.bfloat16)
            self.bf16(m, x)
            yield m, x, self.default(m, x)

    def finish(self, top: int | None, out: str | None) -> None:
        """The table (``print``), and every row as JSON in ``out`` where given."""
        self.print(top)
        if out:
            with open(out, "w") as f:
                json.dump(self.rows, f, indent=1)

    def print(self, top: int | None) -> None:
        """A table a M: the fastest ``top`` rows (all with None), then the default and bf16 where not among them."""
        print(f"{torch.cuda.get_device_name(0)}, {self.sms} SMs, torch {torch.__version__}; {self.n}x{self.k}, "
              f"NVFP4, CUDA-graph replays over {len(self.qs)} copies of the weight")
        for m in sorted({r["M"] for r in self.rows}):
            mine = sorted((r for r in self.rows if r["M"] == m), key=lambda r: r["ms"])
            bf16 = next(r["ms"] for r in mine if r["name"] == "bf16 cuBLAS")
            print(f"\n| M={m}: config | ms | vs bf16 | rel. err vs default |\n| --- | --- | --- | --- |")
            shown = mine if top is None else mine[:top] + [r for r in mine[top:]
                                                           if r["name"].startswith(("default", "bf16"))]
            for r in shown:
                print(f"| {r['name']} | {r['ms']:.4f} | {bf16 / r['ms']:.2f}x | {r['rel_err']:.1e} |")


def arguments(doc: str, ms: str, registers: bool = True) -> argparse.ArgumentParser:
    """The options every fp4 diagnosis takes: --shape (N x K), --ms, --rep-ms, --out, and --registers (no GPU)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--shape", default="4096x14336", help="N x K")
    p.add_argument("--ms", default=ms)
    p.add_argument("--rep-ms", type=float, default=30.0)
    if registers:
        p.add_argument("--registers", action="store_true", help="nvcc's registers of each config (no GPU)")
    p.add_argument("--out", default=None, help="write every row as JSON here")
    return p


def build(source: str, name: str, cfg: dict, dynamic_bytes: int, extra_static: int = 0):
    """NVRTC's build of ``name`` in ``source``, allowed ``dynamic_bytes`` of dynamic shared memory (as _fp4_cuda's
    own builds: past 48 KB in all, the driver's opt-in); ``extra_static``: static shared memory the variant adds to
    the kernel's own."""
    kernel = torch.cuda._compile_kernel(source, name, nvcc_options=["-std=c++17"])
    static = _fp4_cuda.static_bytes(cfg["nt"], cfg["rw"], cfg["wk"], cfg.get("rt", 1)) + extra_static
    if dynamic_bytes >= 48 * 1024:
        kernel.set_shared_memory_config(dynamic_bytes)
    elif dynamic_bytes + static > 48 * 1024:
        lib = torch.cuda._utils._get_gpu_runtime_library()
        if lib.cuFuncSetAttribute(kernel.func, 8, dynamic_bytes) != 0:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE
            raise RuntimeError(f"cuFuncSetAttribute({dynamic_bytes} bytes of dynamic shared memory) failed")
    return kernel


def launch(kernel, x2: torch.Tensor, q, cfg: dict, dynamic_bytes: int, split: int = 1) -> torch.Tensor:
    """``fp4_linear_cuda``'s launch of a variant's ``kernel``, into a new bf16 output: ``split`` blocks along the
    grid's second axis, each 1/split of K, for a variant that adds their sums itself (no split: 1)."""
    (m, k), n = x2.shape, q.packed.shape[0]
    chunks = k // _fp4_cuda.CHUNK
    if chunks % split:
        raise ValueError(f"K={k}: {chunks} chunks do not split {split} ways")
    w, s = q.packed.view(torch.int32), q.scales.view(torch.uint8)
    y = torch.empty((1, m, n), dtype=torch.bfloat16, device=x2.device)
    kernel(grid=(-(-n // (16 * cfg.get("rt", 1) * cfg["rw"])), split, 1), block=(32 * cfg["rw"] * cfg["wk"], 1, 1),
           shared_mem=dynamic_bytes, args=[x2, w, s, q.global_scale.reshape(1).float(), y, m, n, k, chunks // split,
                                           x2.stride(0), w.stride(0), s.stride(0), y.stride(0), y.stride(1), 0],
           stream=torch.cuda.current_stream())
    return y[0]


KERNEL_ARGS = "const u16*, const u32*, const unsigned char*, const float*, void*" + ", int" * 10
NT_COMMENT = "\n// NT: 8-token column tiles"  # the kernel's comment above its template: where variants add functions


def sm90_cubin(source: str, targs: str, folder: str) -> tuple[str, int]:
    """nvcc's (on PATH) sm_90 build of ``fp4_mma_sync<targs>`` in ``source`` into ``folder``: the cubin's path and
    ptxas's registers."""
    (Path(folder) / "k.cu").write_text(source + f"template __global__ void fp4_mma_sync<{targs}>({KERNEL_ARGS});\n")
    built = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o",
                            f"{folder}/k.cubin", f"{folder}/k.cu"], check=True, capture_output=True, text=True)
    return f"{folder}/k.cubin", int(re.search(r"Used (\d+) registers", built.stderr).group(1))


SM_SHARED = 228 * 1024  # an sm_90 SM's shared memory; a block may have 227 KB of it, and 1 KB more is reserved a block


def warps_an_sm(registers: int, warps: int, shared_bytes: int) -> int:
    """The warps an SM holds of blocks of ``warps`` warps at ``registers`` registers a thread and ``shared_bytes``
    of shared memory a block (0: the block cannot launch)."""
    by_registers = 65536 // (warps * 32 * ((registers + 7) // 8 * 8))
    by_shared = SM_SHARED // (shared_bytes + 1024) if shared_bytes <= SM_SHARED - 1024 else 0
    return min(by_registers, by_shared) * warps


def sm90_registers(source: str, targs: str) -> int:
    """ptxas's registers for sm_90 of ``fp4_mma_sync<targs>`` in ``source``."""
    with tempfile.TemporaryDirectory() as d:
        return sm90_cubin(source, targs, d)[1]
