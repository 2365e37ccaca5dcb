"""fp4_linear's CUDA C++ form (``config={"cuda": True}``): NVFP4 weights, bf16 activations, M up to 16,
through ``mma.sync`` with the weights decoded in registers; compiled at first use by NVRTC
(``torch.cuda._compile_kernel``) for the device at hand.

Design notes (why a hand-written kernel, the fragment layout and its decode, the memory pipeline, the async
ring): docs/fp4-cuda-kernel.md. ``config`` picks the launch settings (H200 sweeps of s29-s33); ``prepare``
loads a weight's kernels when the fp4 pass compiles, since loading one inside a CUDA graph capture would break
it, and fp4_linear's default takes a Triton form in a capture where the kernel is not loaded. Requirements
(checked by the caller): K a multiple of 128, NVFP4, bf16 x, compute capability 8.9 or newer (``cvt`` from E4M3).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._fp4_cuda_source import SOURCE, chunk_from_shared, edited  # noqa: F401  (the diagnoses use them)
from ._launch import _index, capability, sm_count

CHUNK = 128  # K elements per lane-group step: 4 lanes x 32 elements
MAX_M = 16  # two 8-token MMA column tiles
SM90_SHARED = 227 * 1024  # a block's shared memory with the opt-in on sm_90 (config's default)


@functools.lru_cache(maxsize=4096)  # a call per layer and step: the same few shapes (read only: callers copy)
def config(m: int, n: int, k: int, sms: int = 132, shared: int = SM90_SHARED) -> dict:
    """The launch settings for M x N x K: the register pipeline up to M=8 (the async ring with 2 row tiles a warp
    past 8 SMs' worth of row tiles), the ring from M=9 (H200, s29-s33; docs/fp4-cuda-kernel.md, "config"), with x
    copied into it too and 12 warps along K where a block an SM covers the rows and K has 48 chunks or more (H100,
    s47-s48: 4096x14336 at M=16, 0.0178 ms against 0.0205 for the ring of x in registers at 8 warps); at M=1 the
    ring at 12 warps along K where two blocks an SM cover the rows and K is as long (H100, s45-s48: 0.0148-0.0150
    ms against 0.0150-0.0153 for the register pipeline at 8 warps, six runs). ``shared``: a block's most shared
    memory on the device (the x ring's pick takes 168 KB: not on sm_89 or sm_120, 99 KB)."""
    chunks = k // CHUNK
    tiles = -(-n // 16)
    rt = 4 if -(-tiles // 4) >= sms else 2
    groups = -(-tiles // rt)
    if m > 8 and groups * 8 >= 4 * sms:  # two token tiles: RT row tiles a warp through the async ring
        xring = ring_bytes(1, 12, 2, 2, 2, 2) + static_bytes(2, 1, 12, 2)
        if rt == 2 and groups <= sms and chunks >= 4 * 12 and xring <= shared:  # a block an SM, K long: 12 warps
            return dict(cuda=True, nt=2, rw=1, wk=12, depth=2, split_k=1, rt=2, **{"async": 2})
        wk = 1
        while wk < 8 and groups * wk * 2 <= 8 * sms and chunks >= 4 * wk:
            wk *= 2
        rw = 2 if wk == 2 else 1  # 2 warps along K (rows for no more; or K under 1024, not swept): 2 row groups
        return dict(cuda=True, nt=2, rw=rw, wk=wk, depth=2, split_k=1, rt=rt, **{"async": True})
    wk = 1
    while wk < 8 and tiles * wk * 2 <= 16 * sms and chunks >= 4 * wk:
        wk *= 2
    if wk == 1 and tiles * 2 > 16 * sms and chunks >= 8:  # one warp a row tile along all of K: rows enough
        return dict(cuda=True, nt=1, rw=1, wk=2, depth=2, split_k=1, rt=2, **{"async": True})
    split = 1
    while tiles * split * wk < 8 * sms and chunks // (split * 2) >= 2 * wk:
        split *= 2
    if m == 1 and wk == 8 and split == 1 and tiles <= 2 * sms and chunks >= 4 * 12:  # two blocks an SM, K long
        return dict(cuda=True, nt=1, rw=1, wk=12, depth=2, split_k=1, rt=1, **{"async": True})  # s45-s48, H100
    return dict(cuda=True, nt=1 if m <= 8 else 2, rw=1, wk=wk, depth=2, split_k=split)


@functools.lru_cache(maxsize=None)
def _shared_optin(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def shared_optin(device: torch.device) -> int:
    """The most shared memory a block may have on a CUDA device, in bytes, the driver's opt-in past 48 KB included
    (227 KB on sm_90 and sm_100, 99 KB on sm_89 and sm_120)."""
    return _shared_optin(_index(device))


def pick(m: int, n: int, k: int, device: torch.device) -> dict:
    """``config`` for ``device``: its SMs and a block's most shared memory."""
    return config(m, n, k, sm_count(device), shared_optin(device))


def _key(cfg: dict, device_index: int) -> tuple:
    return (cfg["nt"], cfg["rw"], cfg["wk"], cfg["depth"], int(cfg.get("async", False)), cfg.get("rt", 1), device_index)


class CompileError(RuntimeError):
    """NVRTC, the module load or the launch settings of one config failed."""


_FAILED: dict = {}  # device index -> why the form is not offered there (``disable``: a default config failed)


def disable(device: torch.device, why: str) -> None:
    """No CUDA form by default on ``device`` from now on (a default config failed to build: the environment's
    fault, no headers or an old driver, not the config's); ``available`` says why."""
    _FAILED[device.index or 0] = why


@functools.lru_cache(maxsize=None)
def _kernel(nt: int, rw: int, wk: int, depth: int, asynchronous: int, rt: int, device_index: int):
    try:
        return _build(nt, rw, wk, depth, asynchronous, rt, device_index)
    except (RuntimeError, OSError, AttributeError) as e:  # no headers, an old driver, no libnvrtc, a config
        raise CompileError(f"its NVRTC build failed on cuda:{device_index} "
                           f"({type(e).__name__}: {str(e)[:200]})") from e


def static_bytes(nt: int, rw: int, wk: int, rt: int) -> int:
    """The kernel's static shared memory: the warps' sums, added up across WK (none at WK=1)."""
    return wk * rw * rt * nt * 4 * 32 * 4 if wk > 1 else 0


def _build(nt: int, rw: int, wk: int, depth: int, asynchronous: int, rt: int, device_index: int):
    with torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(
            SOURCE, f"fp4_mma_sync<{nt}, {rw}, {wk}, {depth}, {asynchronous}, {rt}>", nvcc_options=["-std=c++17"])
        ring = ring_bytes(rw, wk, depth, asynchronous, rt, nt)
        if ring >= 48 * 1024:  # torch's launcher asks for this from 48 KB of dynamic shared memory on
            kernel.set_shared_memory_config(ring)
        elif ring + static_bytes(nt, rw, wk, rt) > 48 * 1024:  # past 48 KB in all: the driver's opt-in
            lib = torch.cuda._utils._get_gpu_runtime_library()
            if lib.cuFuncSetAttribute(kernel.func, 8, ring) != 0:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                raise RuntimeError(f"cuFuncSetAttribute({ring} bytes of dynamic shared memory) failed")
        # loaded now, not at its first launch (CUDA's lazy loading), which may fall inside a CUDA graph capture
        lib = torch.cuda._utils._get_gpu_runtime_library()
        if hasattr(lib, "cuFuncLoad") and lib.cuFuncLoad(kernel.func) != 0:
            raise RuntimeError("fp4_linear's CUDA form: cuFuncLoad failed")
    _COMPILED.add((nt, rw, wk, depth, asynchronous, rt, device_index))
    return kernel


def ring_bytes(rw: int, wk: int, depth: int, asynchronous: int, rt: int = 1, nt: int = 1) -> int:
    """The async form's shared memory: DEPTH chunks of RT row tiles' two rows, 16 bytes a lane, a warp each; at
    async 2 also DEPTH chunks of x's NT token tiles (8 tokens x 256 bytes) a warp."""
    return rw * wk * depth * (rt * 2 * 32 * 16 + (nt * 2048 if asynchronous == 2 else 0)) if asynchronous else 0


_COMPILED: set = set()


def compiled(cfg: dict, device: torch.device) -> bool:
    """Whether ``cfg``'s kernel is loaded on ``device``: loading one (NVRTC, then a module load) inside a CUDA
    graph capture would break the capture, so the default path takes a Triton form there instead."""
    return _key(cfg, device.index or 0) in _COMPILED


def prepare(n: int, k: int, device: torch.device) -> None:
    """Compile the kernels the default config picks for an N x K weight at every M up to MAX_M (M=1, which may
    have its own, and one and two 8-token tiles): the fp4 pass calls this when it compiles a graph, outside any
    capture."""
    for m in (1, 8, MAX_M):
        _kernel(*_key(pick(m, n, k, device), device.index or 0))


def available(device: torch.device) -> tuple[bool, str]:
    """Whether the CUDA form can run on ``device``, and why not."""
    if device.type != "cuda" or torch.version.cuda is None:
        return False, "the CUDA form runs on NVIDIA GPUs only"
    if capability(device) < (8, 9):
        return False, "the CUDA form converts E4M3 scales with sm_89's cvt"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return False, f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
    if (device.index or 0) in _FAILED:
        return False, _FAILED[device.index or 0]
    return True, ""


def _dense(t: Tensor, align: int) -> Tensor:
    """``t`` contiguous at an address that is a multiple of ``align`` bytes (a view at an odd offset is copied)."""
    t = t.contiguous()
    return t if t.data_ptr() % align == 0 else t.clone()


def fp4_linear_cuda(x2: Tensor, packed: Tensor, scales: Tensor, global_scale: Tensor, cfg: dict) -> Tensor:
    """``x2`` [M, K] bf16 (K-contiguous) times the NVFP4 weight (packed [N, K/2] uint8, scales [N, K/16]
    E4M3 bytes, both row-major) transposed: [M, N] bf16."""
    (m, k), n = x2.shape, packed.shape[0]
    if k % CHUNK or m > MAX_M or m > 8 * cfg["nt"]:
        raise ValueError(f"fp4_linear's CUDA form takes K a multiple of {CHUNK} and M up to {8 * cfg['nt']} "
                         f"(nt={cfg['nt']}); got M={m}, K={k}")
    x2 = _dense(x2, 16)  # 16-byte loads of x and of the words; 2-byte loads of the scales
    w = _dense(packed, 16).view(torch.int32)
    s = _dense(scales, 2)
    chunks = k // CHUNK
    split = min(cfg["split_k"], chunks)
    per_split = -(-chunks // split)
    split = -(-chunks // per_split)
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else torch.bfloat16, device=x2.device)
    kernel = _kernel(*_key(cfg, x2.device.index or 0))
    gs = global_scale.reshape(1).float()
    rt = cfg.get("rt", 1)
    with torch.cuda.device(x2.device):  # the kernel's context and x's stream, whatever device is current
        kernel(grid=(-(-n // (16 * rt * cfg["rw"])), split, 1), block=(32 * cfg["rw"] * cfg["wk"], 1, 1),
               shared_mem=ring_bytes(cfg["rw"], cfg["wk"], cfg["depth"], int(cfg.get("async", False)), rt,
                                     cfg["nt"]),
               args=[x2, w, s, gs, out, m, n, k, per_split, x2.stride(0), w.stride(0), s.stride(0),
                     out.stride(0), out.stride(1), int(split > 1)], stream=torch.cuda.current_stream(x2.device))
    return out[0] if split == 1 else out.sum(0).to(torch.bfloat16)
