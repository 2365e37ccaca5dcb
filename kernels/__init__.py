"""kernelpytorch's Triton kernels, one file each (installed as ``kpt_compiler.kernels``).

Each kernel file reads top to bottom: the math, autotune configs, the @triton.jit kernel, the launcher, the
eager reference, and the torch.library custom op (with its fake implementation and autograd) that passes
insert into graphs.
A new kernel file uses the shared plumbing, not its own: ``_launch`` (triton, dispatch, launching),
``_tma_gemm`` (the persistent TMA GEMM), ``_gemm_common``, ``_norm_common`` and ``_op_forms`` (the op forms).
"""

from . import _tuned_cache

_tuned_cache.install()  # autotuning choices kept on disk across restarts (issue 20)
