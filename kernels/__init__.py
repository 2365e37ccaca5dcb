"""kernelpytorch's Triton kernels, one file each (installed as ``kpt_compiler.kernels``).

Each kernel file reads top to bottom: the math, autotune configs, the @triton.jit kernel, the launcher, the
eager reference, and the torch.library custom op (with its fake implementation and autograd) that passes
insert into graphs.
A new kernel file uses the shared plumbing, not its own: ``_launch`` (triton, dispatch, launching),
``_tma_gemm`` (the persistent TMA GEMM), ``_gemm_common``, ``_norm_common`` and ``_op_forms`` (the op forms).
"""

if __name__ == "kernels":
    # Imported as a top-level package: Python runs from the repository root, which is then first on sys.path,
    # and something asked for another distribution's ``kernels`` (Hugging Face's, which transformers 5.25
    # imports when it loads). That name is not ours: hand it to the installed package, found past this folder.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(
        __name__, [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _here])
    if _spec is not None and _spec.loader is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules[__name__] = _module  # the import statement returns what sys.modules holds after this file
        _spec.loader.exec_module(_module)
    # else none is installed: an empty module with no version (transformers 5.17 imports it to ask for one, and
    # takes "N/A" as not installed), and none of the kernels' own set-up, which is kpt_compiler.kernels'
else:
    from . import _tuned_cache

    _tuned_cache.install()  # autotuning choices kept on disk across restarts (issue 20)
