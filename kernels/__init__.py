"""kernelpytorch's Triton kernels, one file each (installed as ``kpt_compiler.kernels``).

Each kernel file reads top to bottom: the math, autotune configs, the @triton.jit kernel, the launcher, the
eager reference, and the torch.library custom op (with its fake implementation and autograd) that passes
insert into graphs.
"""
