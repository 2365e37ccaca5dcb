"""kernelpytorch's graph passes, one file each (installed as ``kpt_compiler.passes``).

Importing this package registers every pass below, and the fusion group (``_fusion_common``), with the
registry; the order they run in is ``kpt_compiler.pipeline.DEFAULT_PIPELINE``. Modules whose names start with
an underscore hold what several passes share. The rules a pass must keep are in README.md beside this file.
"""

from . import (  # noqa: F401  (importing registers them)
    attention,
    bucketing,
    cudagraphs,
    fold_conv_bn,
    fp4,
    fp8,
    fuse_add_norm,
    fuse_gated_linear,
    fuse_linear_epilogue,
    merge_parallel_linears,
    sparsity_2_4,
)
