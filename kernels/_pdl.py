"""Programmatic dependent launch (PDL, sm_90+) for the NVRTC kernels of this folder.

A kernel launched with CUDA's programmatic-stream-serialization attribute may start before the kernel ahead of it
in the stream has finished: once every block of that kernel has exited (or asked for it early), the next one's
blocks are placed and run up to its ``griddepcontrol.wait``, which returns when the kernel ahead is complete and
its writes are visible. A decode step is a chain of short kernels, each of which waits for the last one's launch
and for the first loads of its weights; a GEMV whose weights do not depend on the kernel ahead loads them before
the wait and reads its activations after it (kernels/_fp4_cuda.py).

``torch.cuda._compile_kernel``'s launcher calls ``cuLaunchKernel``, which takes no attributes; ``launch`` calls
``cuLaunchKernelEx`` through ctypes with the same arguments. Used only while a CUDA graph is being captured
(``wanted``): inside a captured forward the weights are constants, so nothing the kernel reads before its wait is
written by the kernel ahead of it. Outside a capture a weight may have just been written by the kernel ahead
(``kpt_compiler.refresh_weights``), and the saving (a microsecond or two a launch) is lost in the host's launch
costs anyway.
"""

from __future__ import annotations

import ctypes

import torch

from ._launch import capability

DEVICE_SOURCE = r"""
__device__ __forceinline__ void wait_prior_grid() {  // PDL: from here the kernel ahead's writes are visible
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");  // returns at once in a launch without PDL
#endif
}
"""  # C++ for a kernel's source: call wait_prior_grid() before the first read of anything the kernel ahead wrote

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION

ENABLED = True  # a switch for diagnostics (benchmarks/diag_fp4_pdl.py): False launches as torch's launcher does


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


def wanted(device: torch.device) -> bool:
    """Whether a launch on ``device`` now takes PDL: sm_90 or newer, a driver with ``cuLaunchKernelEx``, and the
    current stream being captured into a CUDA graph."""
    if not ENABLED or capability(device) < (9, 0) or not torch.cuda.is_current_stream_capturing():
        return False
    return hasattr(torch.cuda._utils._get_gpu_runtime_library(), "cuLaunchKernelEx")


def launch(kernel, grid: tuple, block: tuple, shared_mem: int, args: list, stream: torch.cuda.Stream) -> None:
    """``kernel`` (from ``torch.cuda._compile_kernel``) launched as its own ``__call__`` would, with PDL: tensors
    pass their data pointers, ints as C ints."""
    keep, params = [], (ctypes.c_void_p * len(args))()
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            value = ctypes.c_void_p(a.data_ptr())
        elif isinstance(a, int):
            value = ctypes.c_int(a)
        else:
            raise TypeError(f"_pdl.launch: a tensor or an int, not {type(a).__name__}")
        keep.append(value)
        params[i] = ctypes.cast(ctypes.byref(value), ctypes.c_void_p)
    attr = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _Config(*grid, *block, shared_mem, ctypes.c_void_p(stream.cuda_stream), ctypes.pointer(attr), 1)
    lib = torch.cuda._utils._get_gpu_runtime_library()
    result = lib.cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None)
    if result != 0:
        raise RuntimeError(f"cuLaunchKernelEx with programmatic stream serialization failed: CUresult {result}")
