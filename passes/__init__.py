"""kernelpytorch's graph passes, one file each (installed as ``kpt_compiler.passes``).

Importing this package registers every pass below with the pass manager; the order they run in is
``kpt_compiler.pipeline.DEFAULT_PIPELINE``. The rules a pass must keep are in README.md beside this file.
"""

from . import attention, fusion  # noqa: F401  (importing registers them)
