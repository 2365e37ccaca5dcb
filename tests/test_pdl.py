"""kernels/_pdl.py on the CPU: the ctypes structures match CUDA's ABI (cuda.h, 64-bit), and the fp4 CUDA form's
source waits for the kernel ahead after its first weight loads and before its first read of x (the launch itself
runs in tests/gpu/test_fp4_gpu.py)."""

import ctypes

from kpt_compiler.kernels import _fp4_cuda, _pdl


def test_the_launch_structures_have_cudas_layout():
    # CUlaunchAttribute: id, padding to 8, a 64-byte union; CUlaunchConfig: 7 unsigned, the stream at 32
    assert ctypes.sizeof(_pdl._Attribute) == 72 and _pdl._Attribute.value.offset == 8
    assert (_pdl._Config.stream.offset, _pdl._Config.attrs.offset, _pdl._Config.num_attrs.offset) == (32, 40, 48)
    attr = _pdl._Attribute(id=_pdl._PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    raw = bytes(attr)
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")


def test_the_cuda_form_waits_for_the_kernel_ahead_before_it_reads_x():
    src = _fp4_cuda.SOURCE
    assert src.startswith(_pdl.DEVICE_SOURCE) and "griddepcontrol.wait" in _pdl.DEVICE_SOURCE
    body = src[src.index("fp4_mma_sync("):]
    wait = body.index("wait_prior_grid();")
    first_x = body.index("  LOAD_X(0, 0)\n")
    assert body.index("{ LOAD_W(p, p) }") < wait < first_x
