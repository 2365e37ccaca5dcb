"""The three forms of a kernel's op, registered by one call (``register_op_forms``).

- ``torch.ops.kpt.<name>``: a ``torch.library.custom_op`` with a fake implementation and autograd. One opaque
  call that works on every device, in eager, under CUDA graphs and under every torch.compile backend;
  Inductor calls it as an extern kernel, a Python call per launch.
- ``torch.ops.kpt.<name>_inference``: the same forward without autograd, for calls no gradient flows
  through. A custom_op runs a Python autograd layer in front of the kernel even under torch.no_grad(): at
  decode sizes that is about half of the op's host time on the H100 machine (benchmarks/bench_dispatch.py,
  "op" against "launch"), and a model compiled without CUDA graphs is bound by host time there. Defined with
  torch.library.Library and no autograd kernel, so PyTorch's C++ autograd fallback stands in front (it warns
  if a gradient is asked for). Its schema is the custom op's, inferred from the forward's annotations.
- ``torch.ops.kpt.<name>_triton``, where triton is installed and the kernel gives a triton forward: a
  ``torch.library.triton_op``, which Inductor traces and launches as one of its own kernels (why, and where
  the fusion pass emits each form: linear_epilogue's docstring).
"""

import torch

from ._launch import HAVE_TRITON

_libraries = []  # the inference ops' libraries: a Library's registrations go when it is collected


def register_op_forms(name: str, forward, fake, setup_context, backward, triton_forward=None):
    """Register ``kpt::<name>`` (``forward``, ``fake``, autograd by ``setup_context`` and ``backward``),
    ``kpt::<name>_inference`` (``forward`` and ``fake``, no autograd) and, where triton is installed and
    ``triton_forward`` is given, ``kpt::<name>_triton``. Returns the custom op."""
    op = torch.library.custom_op(f"kpt::{name}", mutates_args=())(forward)
    op.register_fake(fake)
    op.register_autograd(backward, setup_context=setup_context)

    lib = torch.library.Library("kpt", "FRAGMENT")
    lib.define(f"{name}_inference{torch.library.infer_schema(forward, mutates_args=())}")
    lib.impl(f"{name}_inference", forward, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kpt::{name}_inference", fake, lib=lib)
    _libraries.append(lib)

    if HAVE_TRITON and triton_forward is not None:
        torch.library.triton_op(f"kpt::{name}_triton", mutates_args=())(triton_forward)
    return op
