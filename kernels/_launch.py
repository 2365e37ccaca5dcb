"""Launch plumbing for every kernel in this folder: triton itself, whether a kernel runs here, device facts,
and launching with a config autotuned once.

- ``triton``, ``tl``: the one import of triton. Where it is absent (torch 2.9's environment) a stand-in takes
  its place, so that ``@triton.jit``, ``triton.Config``, ``triton.autotune`` and ``tl.constexpr`` still define
  the kernels (which then never run: the ops run their eager references). ``HAVE_TRITON`` says which.
- ``INTERPRETED``: TRITON_INTERPRET=1 when this module was imported. triton.jit picks the interpreter when it
  decorates, so the flag at import time is what counts. ``INTERPRETER_OK``: triton 3.6 or later, whose
  interpreter runs the GEMM kernels (3.5's fails on them with a numpy scalar conversion).
- ``kernel_runs(t)``: whether the Triton kernel runs for tensor t here (else the op's eager reference).
- ``sm_count``, ``capability``, ``has_tma``: cached device facts (CUDA answers cost microseconds a call).
- ``launch_tuned``: autotune on a key's first call, then launch the chosen config directly;
  ``inductor_autotuner`` and ``wrapped_launch``: the same kernels launched from a ``torch.library.triton_op``;
  ``input_precision`` and ``launch_grid``: tl.dot's precision and the grid of a tiled GEMM.
"""

import functools
import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # torch 2.9's environment has no triton: the ops run their eager references there
    HAVE_TRITON = False

    class _NoTriton:
        """Stands in for triton and triton.language so the kernels still define (and never run)."""

        constexpr = None

        @staticmethod
        def jit(fn):
            return fn

        @staticmethod
        def Config(*args, **kwargs):
            return None

        @staticmethod
        def autotune(*args, **kwargs):
            return lambda fn: fn

    triton = tl = _NoTriton()

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # triton < 3.4, or no triton: no TMA kernels
    TensorDescriptor = None
HAVE_TMA = HAVE_TRITON and TensorDescriptor is not None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _interpreter_ok() -> bool:
    try:
        return tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 6)
    except (AttributeError, ValueError):
        return False


INTERPRETER_OK = HAVE_TRITON and _interpreter_ok()


def kernel_runs(t: torch.Tensor, dtypes: Optional[tuple] = None, needs_3_6_interpreter: bool = False) -> bool:
    """Whether a Triton kernel runs for tensors like ``t`` here (else the op runs its eager reference): CUDA
    tensors unless the kernels were decorated for the interpreter; CPU tensors only in the interpreter
    (TRITON_INTERPRET=1 at import and still set), and only in triton >= 3.6's where ``needs_3_6_interpreter``
    (the GEMMs); only ``dtypes``, where given. Never without triton."""
    if not HAVE_TRITON or (dtypes is not None and t.dtype not in dtypes):
        return False
    if t.is_cuda:
        return not INTERPRETED
    return (t.device.type == "cpu" and INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1"
            and (INTERPRETER_OK or not needs_3_6_interpreter))


# ---------------------------------------------------------------------------------------------------------
# Device facts, cached per device index
# ---------------------------------------------------------------------------------------------------------
def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device; 1 elsewhere (the interpreter: tests see several rows per tile)."""
    if device.type != "cuda":
        return 1
    return _sm_count(_index(device))


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device."""
    return _capability(_index(device))


def has_tma(device: torch.device) -> bool:
    """Whether TMA kernels run on ``device``: a CUDA device of compute capability 9.0 and up (Hopper), and a
    triton with host-side tensor descriptors (``TensorDescriptor``, triton 3.4 and later)."""
    return HAVE_TMA and device.type == "cuda" and capability(device)[0] >= 9


# ---------------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------------
def input_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: TF32 for float32 only where torch's matmul precision allows it."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def launch_grid(M: int, N: int):
    """The grid of a tiled GEMM: one program per BLOCK_M x BLOCK_N tile of the [M, N] output."""
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


# (kernel, the autotuner's key) -> the launch keywords of the config it chose. Triton's Autotuner rebuilds its
# key, looks it up and merges the config's keywords on every call: on the H100 machine's host our launcher
# issued a decode-size call in 39-43 us through the autotuner and 28-30 us with the config passed in (the
# first benchmarks/bench_dispatch.py run, commit ef9723f). After the first call with a key, ``launch_tuned``
# launches the kernel with the chosen config directly.
_chosen: dict = {}


def launch_tuned(autotuned, kernel, key: tuple, grid, args: tuple, meta: dict, config: Optional[dict] = None,
                 prepare=None) -> dict:
    """``autotuned[grid](*args, **meta)``: the first call with ``key`` autotunes, later ones launch ``kernel``
    with the config chosen then. ``key`` must hold everything the autotuner keys on (its key arguments and the
    tensors' dtypes), or a config tuned for one case would run another. ``config`` (launch keywords) skips the
    autotuner and the cache. ``prepare(config)`` runs before a launch with a config, as the configs'
    ``pre_hook`` does under the autotuner. Returns the config's keywords."""
    config = config or _chosen.get((kernel, key))
    if config is None:
        autotuned[grid](*args, **meta)
        config = _chosen[(kernel, key)] = autotuned.best_config.all_kwargs()
        return config
    if prepare is not None:
        prepare(config)
    kernel[grid(config) if callable(grid) else grid](*args, **meta, **config)
    return config


# The triton_op forms (linear_epilogue_triton, gated_linear_triton; why: linear_epilogue's docstring) launch
# the pointer GEMMs through torch.library.wrap_triton, which Inductor traces and launches as its own kernel.
_inductor_autotuners: dict = {}


def inductor_autotuner(kernel, configs, M: int, dtype: torch.dtype):
    """The autotuner Inductor sees for ``kernel`` at M rows of ``dtype``: the configs ``prune_configs`` keeps
    (Inductor autotunes a traced kernel over its ``configs`` and skips ``prune_configs_by``)."""
    from ._gemm_common import kept_configs  # imported here: _gemm_common imports this module

    key = (kernel, M <= 64, dtype.itemsize)
    if key not in _inductor_autotuners:
        kept = kept_configs(configs, M, dtype.itemsize)
        _inductor_autotuners[key] = triton.autotune(configs=kept, key=["M", "N", "K"])(kernel)
    return _inductor_autotuners[key]


def wrapped_launch(kernel, configs, M: int, dtype: torch.dtype, grid, args: tuple, meta: dict) -> None:
    """Launch a pointer kernel from a triton_op: on CUDA its Inductor autotuner (see ``inductor_autotuner``),
    on the CPU's interpreter ``INTERPRETER_META``."""
    from ._gemm_common import INTERPRETER_META  # imported here: _gemm_common imports this module

    wrap = torch.library.wrap_triton
    if args[0].is_cuda:
        wrap(inductor_autotuner(kernel, configs, M, dtype))[grid](*args, **meta)
    else:
        wrap(kernel)[grid(INTERPRETER_META)](*args, **meta, **INTERPRETER_META)
