"""The fp4 weight GEMM (kernels/fp4_linear.py, issue 18) under Triton's interpreter on the CPU: against the
dequantized weight's matmul in float64, at small and odd shapes, both formats, fp32 and fp16 activations (the
interpreter's bf16 dot is unreliable)."""

import pytest
import torch

from kpt_compiler.kernels import _fp4_format as fmt
from kpt_compiler.kernels import _fp4_mma, _launch
from kpt_compiler.kernels.fp4_linear import fp4_linear

if not torch.cuda.is_available() and not _launch.kernel_runs(torch.empty(0), needs_3_6_interpreter=True):
    pytest.skip("the kernel runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1 before import)",
                allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("f", [fmt.NVFP4, fmt.MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("M, N, K", [(1, 32, 64), (5, 48, 128), (17, 33, 96), (3, 7, 160)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_matches_the_dequantized_matmul(f, M, N, K, dtype, tol):
    if K % f.block:
        pytest.skip(f"K={K} is not a multiple of {f.name}'s block")
    g = torch.Generator().manual_seed(M * N + K)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    q = fmt.quantize(w.to(DEVICE), f)
    y = fp4_linear(x.to(DEVICE, dtype), q)
    ref = x.double() @ fmt.dequantize(q).double().cpu().T
    assert y.dtype == dtype and y.shape == (M, N)
    assert (y.double().cpu() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("f", [fmt.NVFP4, fmt.MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("split_k, block_k", [(2, 32), (3, 32), (4, 64)])
def test_split_k_partial_sums_add_up(f, split_k, block_k):
    # K = 160 or 192 split in uneven shares: the last program's share is shorter, or empty
    k = 192 if f is fmt.MXFP4 else 160
    block_k = max(block_k, f.block)
    g = torch.Generator().manual_seed(split_k)
    q = fmt.quantize(torch.randn(40, k, generator=g).to(DEVICE), f)
    x = torch.randn(3, k, generator=g).to(DEVICE)
    y = fp4_linear(x, q, config={"split_k": split_k, "block_k": block_k, "block_n": 32})
    ref = x.double() @ fmt.dequantize(q).double().T
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("M, N, K, split_k", [(1, 32, 64, 1), (5, 48, 128, 2), (17, 33, 192, 3)])
def test_mxfp4_through_triton_scaled_dot(M, N, K, split_k):
    # bf16 activations (the scaled dot's own bf16 product was exact in the interpreter, unlike tl.dot's)
    g = torch.Generator().manual_seed(M + N)
    q = fmt.quantize(torch.randn(N, K, generator=g).to(DEVICE), fmt.MXFP4)
    x = torch.randn(M, K, generator=g).to(DEVICE, torch.bfloat16)
    y = fp4_linear(x, q, config={"scaled_dot": True, "split_k": split_k, "block_k": 64, "block_n": 32})
    ref = x.double() @ fmt.dequantize(q).double().T
    assert y.dtype == torch.bfloat16 and (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
    with pytest.raises(ValueError, match="scaled_dot takes MXFP4 weights"):
        fp4_linear(x, fmt.quantize(torch.randn(N, K, generator=g).to(DEVICE)), config={"scaled_dot": True})


def test_small_m_splits_k_so_every_sm_has_work():
    from kpt_compiler.kernels.fp4_linear import SMS, config_for

    cfg = config_for(8, 4096, 4096, 16)  # the dot form: 64 tiles of 64 rows, K split 8 ways
    assert cfg["split_k"] > 1 and (4096 // cfg["block_n"]) * cfg["split_k"] >= 2 * SMS
    gemv = config_for(1, 4096, 4096, 16)  # the GEMV form: 8 rows a program are 512 programs, no split
    assert gemv["gemv"] and gemv["split_k"] == 1 and 4096 // gemv["block_n"] >= 2 * SMS
    assert config_for(2048, 4096, 4096, 16)["split_k"] == 1


def test_leading_dims_and_a_strided_input():
    g = torch.Generator().manual_seed(3)
    q = fmt.quantize(torch.randn(24, 64, generator=g).to(DEVICE))
    x = torch.randn(2, 3, 128, generator=g).to(DEVICE)[..., ::2]  # K stride 2
    y = fp4_linear(x, q)
    ref = x.double() @ fmt.dequantize(q).double().T
    assert y.shape == (2, 3, 24) and (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_bad_input_names_what_is_wrong():
    q = fmt.quantize(torch.randn(8, 32).to(DEVICE))
    with pytest.raises(ValueError, match="K=16, the weight 32"):
        fp4_linear(torch.randn(2, 16).to(DEVICE), q)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fp4_linear(torch.randn(2, 32, dtype=torch.float64).to(DEVICE), q)
    with pytest.raises(ValueError, match="multiple of the format's 16"):
        fp4_linear(torch.randn(2, 32).to(DEVICE), q, config={"block_k": 24})
    with pytest.raises(ValueError, match="decode=4"):  # an unknown decode would scale the result by 2^15
        fp4_linear(torch.randn(2, 32).to(DEVICE), q, config={"decode": 4})
    with pytest.raises(ValueError, match="cannot go with gemv=True"):
        fp4_linear(torch.randn(1, 32).to(DEVICE), q, config={"gemv": True, "scaled_dot": True})
    with pytest.raises(ValueError, match="gemv_math='f64'"):
        fp4_linear(torch.randn(1, 32).to(DEVICE), q, config={"gemv": True, "gemv_math": "f64"})


def test_the_form_asked_for_gets_its_own_tiles():
    from kpt_compiler.kernels.fp4_linear import config_for

    assert config_for(1, 4096, 4096, 16)["gemv"]
    dot = config_for(1, 4096, 4096, 16, gemv=False)  # the dot form at M=1: its tiles, not the GEMV's
    assert not dot["gemv"] and dot["block_m"] == 16 and dot["num_stages"] > 1
    assert not config_for(1, 4096, 4096, 32, scaled_dot=True)["gemv"]
    g = torch.Generator().manual_seed(4)
    q = fmt.quantize(torch.randn(40, 96, generator=g).to(DEVICE))
    x = torch.randn(1, 96, generator=g).to(DEVICE)
    ref = x.double() @ fmt.dequantize(q).double().T
    assert (fp4_linear(x, q, config={"gemv": False}).double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("f", [fmt.NVFP4, fmt.MXFP4], ids=lambda f: f.name)
def test_the_op_form_matches_and_passes_opcheck(f):
    from kpt_compiler.kernels.fp4_linear import op_args

    g = torch.Generator().manual_seed(5)
    q = fmt.quantize(torch.randn(24, 64, generator=g).to(DEVICE), f)
    x = torch.randn(3, 64, generator=g).to(DEVICE)
    y = torch.ops.kpt.fp4_linear(x, *op_args(q))
    assert torch.allclose(y, fp4_linear(x, q))
    torch.library.opcheck(torch.ops.kpt.fp4_linear.default, (x, *op_args(q)))
    compiled = torch.compile(lambda x: torch.ops.kpt.fp4_linear(x, *op_args(q)), backend="aot_eager", fullgraph=True)
    assert torch.allclose(compiled(x), y)


@pytest.mark.parametrize("config", [{"gemv": True, "block_n": 16, "block_k": 32},
                                    {"gemv": True, "gemv_math": "f16x2", "block_n": 16, "block_k": 32},
                                    {"gemv": False, "decode": 2, "block_n": 16, "block_k": 64},
                                    {"gemv": False, "decode": 1, "block_n": 16, "block_k": 64}],
                         ids=["gemv", "gemv-f16x2", "dot-words", "dot-bytes"])
def test_every_code_at_every_position_of_a_word_decodes_exactly(config):
    # y = x @ w.T with x the identity: the weight itself, every code (the signs, the subnormal 0.5) at every
    # nibble of a 32-bit word, where the words' decode takes them apart (on the GPU the same bit operations in
    # inline PTX: tests/gpu/test_fp4_gpu.py)
    r, j = torch.arange(16)[:, None], torch.arange(64)[None, :]
    codes = ((r + j) % 16).to(torch.uint8)
    q = fmt.Fp4Weight(fmt.MXFP4, fmt.pack(codes).to(DEVICE), torch.full((16, 2), 127, dtype=torch.uint8,
                      device=DEVICE), torch.ones((), device=DEVICE), (16, 64))
    got = fp4_linear(torch.eye(64, device=DEVICE), q, config=config)
    torch.testing.assert_close(got, fmt.dequantize(q).T, rtol=0, atol=0)


@pytest.mark.parametrize("f", [fmt.NVFP4, fmt.MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("M", [1, 2, 5])
def test_the_gemv_form_by_default_at_m_1_and_right_at_any_m_with_split_k(f, M):
    from kpt_compiler.kernels.fp4_linear import config_for

    assert config_for(1, 4096, 14336, f.block)["gemv"] and not config_for(2, 4096, 14336, f.block)["gemv"]
    g = torch.Generator().manual_seed(M)
    q = fmt.quantize(torch.randn(24, 256, generator=g).to(DEVICE), f)
    x = torch.randn(M, 256, generator=g).to(DEVICE)
    ref = x.double() @ fmt.dequantize(q).double().T
    for cfg in ({"gemv": True}, {"gemv": True, "split_k": 3, "block_k": 64}):
        y = fp4_linear(x, q, config=cfg)
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("f", [fmt.NVFP4, fmt.MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype, scale", [(torch.bfloat16, 1e-36), (torch.bfloat16, 1e-30), (torch.bfloat16, 1.0),
                                          (torch.bfloat16, 3e4), (torch.bfloat16, 1e30), (torch.float16, 1e-3),
                                          (torch.float16, 1.0), (torch.float16, 20.0)])
def test_the_fp16_pair_gemv_takes_activations_of_any_magnitude(f, dtype, scale):
    # the GEMV's default for 16-bit activations multiplies and sums in fp16 pairs (kernels/_fp4_gemv.py): each
    # word's 8 values of x are brought by a power of two to where fp16 neither overflows nor underflows (clamped
    # for the smallest). Activations from 1e-36 to 1e30 (bf16; fp16 within its range), a row spanning 8 decades,
    # and a row whose words mix 1 and 1e-6, must come out as the dequantized matmul in float64 does, to the
    # output dtype's rounding; whole and ragged shares of K (split-K, a step past K's end)
    g = torch.Generator().manual_seed(int(abs(torch.log10(torch.tensor(scale)))))
    q = fmt.quantize(torch.randn(24, 256, generator=g).to(DEVICE), f)
    x = torch.randn(3, 256, generator=g) * scale
    x[1] *= 10 ** torch.linspace(-4, 4, 256) if dtype == torch.bfloat16 else 10 ** torch.linspace(-2, 2, 256)
    x[2, ::2] *= 1e-6 if dtype == torch.bfloat16 else 1e-3
    x = x.to(DEVICE, dtype)
    ref = x.double().cpu() @ fmt.dequantize(q).double().cpu().T
    for cfg in ({"gemv": True}, {"gemv": True, "split_k": 3, "block_k": 64, "block_n": 16}):
        y = fp4_linear(x, q, config=cfg)  # f16x2: the default for 16-bit activations
        assert y.dtype == dtype and torch.isfinite(y).all()
        err = (y.double().cpu() - ref).norm(dim=1) / ref.norm(dim=1)
        f32 = fp4_linear(x, q, config={**cfg, "gemv_math": "f32"})  # the same output rounding, fp32 inside
        err_f32 = (f32.double().cpu() - ref).norm(dim=1) / ref.norm(dim=1)
        assert (err < 1e-2).all() and (err <= 1.5 * err_f32 + 1e-3).all(), (cfg, err, err_f32)


@pytest.mark.parametrize("dtype, kernel", [(torch.bfloat16, "_fp4_gemv_h2_kernel"),
                                           (torch.float16, "_fp4_gemv_h2_kernel"),
                                           (torch.float32, "_fp4_gemv_kernel")])
def test_the_gemv_arithmetic_follows_the_activation_dtype(monkeypatch, dtype, kernel):
    # fp16 pairs for 16-bit activations (exact for their values), fp32 for fp32 ones, unless asked otherwise
    from kpt_compiler.kernels import fp4_linear as mod

    launched = []

    class Spy:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(mod, name)

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in ("_fp4_gemv_h2_kernel", "_fp4_gemv_kernel"):
        monkeypatch.setattr(mod, name, Spy(name))
    q = fmt.quantize(torch.randn(16, 64).to(DEVICE))
    fp4_linear(torch.randn(1, 64).to(DEVICE, dtype), q)
    assert launched == [kernel]
    other = "f32" if kernel == "_fp4_gemv_h2_kernel" else "f16x2"
    fp4_linear(torch.randn(1, 64).to(DEVICE, dtype), q, config={"gemv_math": other})
    assert launched[-1] != kernel


@pytest.mark.parametrize("f", [fmt.NVFP4, fmt.MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("M, N, K, split_k", [(1, 32, 64, 1), (5, 48, 128, 2), (17, 33, 96, 1), (3, 7, 160, 3)])
def test_the_bf16_pair_mma_form_matches_to_bf16_rounding(f, M, N, K, split_k):
    # decode=3 (kernels/_fp4_mma.py), the default for bf16 activations up to M=16: here its tl twin (same bits,
    # built in fp32) with the dot in fp32; each output within one bf16 step of the float64 product (triton 3.9's
    # interpreter rounds fp32 -> bf16 toward zero; the GPU to nearest: tests/gpu/test_fp4_gpu.py)
    if K % f.block:
        pytest.skip(f"K={K} is not a multiple of {f.name}'s block")
    g = torch.Generator().manual_seed(M + N + K)
    q = fmt.quantize(torch.randn(N, K, generator=g).to(DEVICE), f)
    x = torch.randn(M, K, generator=g).to(DEVICE, torch.bfloat16)
    y = fp4_linear(x, q, config={"gemv": False, "decode": 3, "block_n": 16, "block_k": 2 * f.block,
                                 "split_k": split_k})
    ref = x.double().cpu() @ fmt.dequantize(q).double().cpu().T
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    err = (y.double().cpu() - ref).abs()
    assert (err <= 2.0**-7 * ref.abs() + 1e-6 * ref.abs().max()).all(), err.max()


@pytest.mark.parametrize("f", [fmt.NVFP4, fmt.MXFP4], ids=lambda f: f.name)
def test_the_bf16_pair_mma_form_is_exact_over_its_scale_range(f):
    # I @ w.T = w: every code at every nibble, block scales across the form's range (E8M0 2^-117..2^9, every
    # E4M3, a power-of-two tensor scale) exactly as the dequantized weight in bf16; past 2^9, inf
    n, k = 16, 256
    r, j = torch.arange(n)[:, None], torch.arange(k)[None, :]
    codes = ((r + j) % 16).to(torch.uint8)
    blocks = k // f.block
    if f is fmt.MXFP4:
        raw, gs = torch.linspace(127 - 117, 127 + 9, n * blocks).round(), torch.ones(())
    else:
        raw, gs = torch.arange(1, 127).repeat(3)[:n * blocks], torch.tensor(2.0**-9)
    raw = raw.to(torch.uint8).reshape(n, blocks)
    q = fmt.Fp4Weight(f, fmt.pack(codes).to(DEVICE), (raw if f is fmt.MXFP4 else raw.view(torch.float8_e4m3fn))
                      .to(DEVICE), gs.to(DEVICE), (n, k))
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEVICE)
    cfg = {"gemv": False, "decode": 3, "block_n": 16, "block_k": 64}
    torch.testing.assert_close(fp4_linear(eye, q, config=cfg).float(), fmt.dequantize(q, torch.bfloat16).float().T,
                               rtol=0, atol=0)
    if f is fmt.MXFP4:  # bytes 137 (the first past), 138 and 255: s' capped at inf, not wrapped into other bits
        for byte in (_fp4_mma.E8M0_MAX + 1, _fp4_mma.E8M0_MAX + 2, 255):
            big = fmt.Fp4Weight(f, q.packed, torch.full_like(q.scales, byte), q.global_scale, (n, k))
            assert not fp4_linear(eye, big, config=cfg).isfinite().any(), byte


def test_nvfp4_with_bf16_activations_up_to_m_16_takes_the_mma_form_and_only_it_may():
    from kpt_compiler.kernels.fp4_linear import config_for

    assert config_for(16, 4096, 4096, 16, dtype=torch.bfloat16)["decode"] == 3
    for m, dtype, e8m0 in ((1, torch.bfloat16, False), (17, torch.bfloat16, False), (8, torch.float16, False),
                           (8, None, False), (8, torch.bfloat16, True)):  # MXFP4: only when asked (its range)
        assert config_for(m, 4096, 4096, 16, dtype=dtype, e8m0=e8m0).get("decode", 2) != 3, (m, dtype, e8m0)
    assert config_for(8, 4096, 4096, 32, scaled_dot=True, dtype=torch.bfloat16).get("decode", 0) == 0
    q = fmt.quantize(torch.randn(8, 32).to(DEVICE))
    bf16 = torch.randn(2, 32).to(DEVICE, torch.bfloat16)
    for x, extra in ((torch.randn(2, 32, dtype=torch.float16).to(DEVICE), {}), (torch.randn(2, 32).to(DEVICE), {}),
                     (bf16, {"gemv": True}), (bf16, {"scaled_dot": True})):
        with pytest.raises(ValueError, match="decode=3 is a dot form for bfloat16 activations"):
            fp4_linear(x, q, config={"decode": 3, **extra})


@pytest.mark.skipif(DEVICE == "cuda", reason="the refusal on the CPU (tests/gpu has the GPU's)")
def test_the_cuda_form_is_asked_for_only_where_it_runs_and_says_why_not():
    # kernels/_fp4_cuda.py runs on NVIDIA GPUs (sm_89+, NVRTC) with NVFP4 weights, bf16 x, M <= 16 and K a
    # multiple of 128; asked for elsewhere it names each reason, and by default it is never picked here
    from kpt_compiler.kernels.fp4_linear import cuda_form_fits

    q = fmt.quantize(torch.randn(8, 256))
    x = torch.randn(4, 256).to(torch.bfloat16)
    why = []
    assert not cuda_form_fits(x, q, why) and len(why) == 1 and "NVIDIA GPUs" in why[0]
    with pytest.raises(ValueError, match="config cuda=True cannot run this call: the CUDA form runs on NVIDIA"):
        fp4_linear(x, q, config={"cuda": True})
    why = []
    assert not cuda_form_fits(torch.randn(17, 416), fmt.quantize(torch.randn(8, 416), fmt.MXFP4), why)
    for i, part in enumerate(("NVIDIA GPUs", "NVFP4", "bfloat16", "1 to 16 rows", "multiple of 128")):
        assert part in why[i], why
    ref = x.float() @ fmt.dequantize(q).T
    torch.testing.assert_close(fp4_linear(x, q).float(), ref, rtol=2**-7, atol=1e-4)  # a Triton form


def test_the_cuda_forms_config_follows_the_h200_sweep_and_its_keys_are_checked(monkeypatch):
    # kernels/_fp4_cuda.config: the picks that s29's and s31's sweeps found fastest (or within 2.4%) on an H200 at
    # bench_fp4's shapes, a split of K for few rows; and fp4_linear's checks of a CUDA config, reached here by
    # letting the form "fit" on the CPU (each raises before any launch)
    from kpt_compiler.kernels import _fp4_cuda
    from kpt_compiler.kernels import fp4_linear as kernel

    pick = {(n, k): _fp4_cuda.config(4, n, k, 132) for n, k in ((4096, 4096), (4096, 14336), (14336, 4096))}
    assert [(c["wk"], c["split_k"], c["rw"], c["depth"], c["nt"]) for c in pick.values()] == [
        (8, 1, 1, 2, 1), (8, 1, 1, 2, 1), (2, 1, 1, 2, 1)]
    assert _fp4_cuda.config(16, 4096, 4096, 132)["nt"] == 2 and _fp4_cuda.config(8, 4096, 4096, 132)["nt"] == 1
    # M=1 where two blocks an SM cover the rows and K has 48 chunks: the ring at 12 warps along K (s45-s48, H100);
    # prepare builds it beside M=8's and M=16's, so a capture finds it loaded
    one = _fp4_cuda.config(1, 4096, 14336, 132)
    assert (one["wk"], one["async"], one["rt"], one["split_k"]) == (12, True, 1, 1)
    assert _fp4_cuda.config(1, 4096, 4096, 132) == _fp4_cuda.config(4, 4096, 4096, 132)
    built = []
    monkeypatch.setattr(_fp4_cuda, "_kernel", lambda *key: built.append(key))
    monkeypatch.setattr(_fp4_cuda, "sm_count", lambda device: 132)
    for shared, x_ring in ((227 * 1024, [1, 0, 2]), (99 * 1024, [1, 0, 1])):  # sm_90; sm_89 and sm_120
        built.clear()
        monkeypatch.setattr(_fp4_cuda, "shared_optin", lambda device, b=shared: b)
        _fp4_cuda.prepare(4096, 14336, torch.device("cuda", 0))
        assert [k[2] for k in built] == [12, 8, 12 if x_ring[2] == 2 else 8] and [k[4] for k in built] == x_ring
    # the x ring's pick takes 168 KB of shared memory: where a block may not have it, the ring with x in registers
    assert _fp4_cuda.config(16, 4096, 14336, 132, 99 * 1024) == _fp4_cuda.config(16, 4096, 4096, 132)
    assert _fp4_cuda.ring_bytes(1, 12, 2, 2, 2, 2) + _fp4_cuda.static_bytes(2, 1, 12, 2) == 168 * 1024
    # M=9-16: the async ring with RT row tiles a warp, s31's fastest at each shape; too few rows keep one tile;
    # where a block an SM covers the rows and K has 48 chunks, x through the ring too at 12 warps along K (s48, H100)
    nine = {(n, k): _fp4_cuda.config(9, n, k, 132) for n, k in ((4096, 4096), (4096, 14336), (14336, 4096))}
    assert [(c["rt"], c["wk"], c["async"], c["split_k"]) for c in nine.values()] == [
        (2, 8, True, 1), (2, 12, 2, 1), (4, 4, True, 1)]
    assert _fp4_cuda.config(16, 4096, 128 * 47, 132)["async"] is True  # K short of 48 chunks: x in registers
    assert _fp4_cuda.config(16, 4096 + 16 * 2 * 132, 14336, 132)["async"] is True  # more than a block an SM
    # async 2's shared memory: the weights' ring and x's, DEPTH chunks of NT token tiles a warp
    assert _fp4_cuda.ring_bytes(1, 12, 2, 2, 2, 2) == 12 * 2 * (2 * 1024 + 2 * 2048)
    assert _fp4_cuda.ring_bytes(1, 12, 2, 1, 2, 2) == 12 * 2 * 2 * 1024
    assert "rt" not in _fp4_cuda.config(16, 1024, 4096, 132) and "rt" not in _fp4_cuda.config(8, 14336, 4096, 132)
    # ... and where rows leave room for only 2 warps along K (gate and up as one group, an LM head), 2 row groups a
    # block (s33's sweep: 27.3-28.9 us against 32.9-34.2 with one)
    assert all(_fp4_cuda.config(m, n, 4096, 132)["rw"] == 2 for m in (9, 16) for n in (28672, 32000))
    assert all(c["rw"] == 1 for c in nine.values())
    # M<=8 past 8 SMs' worth of row tiles (gate and up as one group, an LM head): the ring, 2 row tiles a warp, 2
    # warps along K (s32's sweep: 1.2-1.26x one warp a row tile); a row tile short of that keeps the registers
    big = [_fp4_cuda.config(m, n, 4096, 132) for m in (1, 8) for n in (28672, 32000)]
    assert all((c["rt"], c["wk"], c["async"], c["nt"]) == (2, 2, True, 1) for c in big), big
    assert "rt" not in _fp4_cuda.config(1, 16 * 1056, 4096, 132)
    assert _fp4_cuda.config(1, 16 * 1057, 4096, 132)["rt"] == 2 and "rt" not in _fp4_cuda.config(1, 16 * 1057, 896, 132)
    few = _fp4_cuda.config(1, 1024, 4096, 132)
    assert few["split_k"] > 1 and 64 * few["wk"] * few["split_k"] >= 8 * 132 // 2, few
    monkeypatch.setattr(kernel, "cuda_form_fits", lambda x2, q, why=None: True)
    q = fmt.quantize(torch.randn(16, 256))
    x = torch.randn(9, 256).to(torch.bfloat16)
    for cfg, what in (({"depth": 3}, "depth 2, 4, 6 or 8"), ({"nt": 1}, r"8 nt >= M=9"),
                      ({"rw": 8, "wk": 8}, "at most 32"), ({"rw": -1, "wk": -1}, "at least 1"),
                      ({"split_k": 0}, "at least 1"), ({"block_n": 64}, "Triton forms' keys"),
                      ({"async": 3}, "async False, True or 2")):
        with pytest.raises(ValueError, match=what):
            fp4_linear(x, q, config={"cuda": True, **cfg})


def test_x_through_the_ring_reads_what_it_copied_from_a_conflict_free_swizzle():
    """kernels/_fp4_cuda.py at async 2: its chunk_mma_shx is chunk_mma's decode with x from shared memory, the warp
    meets before reading others' copies and before overwriting a slot, and the layout it writes is the one it
    reads: copy i of lane l puts unit l % 16 of token 2 i + l / 16 at ``stored(token, u)``, lane (g, t) reads step
    j of token g at ``4 t + (j ^ c)``; within a token that is a permutation, each lane finds its own unit 4 t + j,
    and the 8 lanes of each phase of a 16-byte read (lanes 8p..8p+7: two tokens, four t) hit 8 different groups of
    4 banks."""
    from kpt_compiler.kernels import _fp4_cuda

    s = _fp4_cuda.SOURCE
    assert s.count("chunk_mma_shx<NT>(") == 1 and s.count("if (ASYNC == 2) __syncwarp();") == 2
    start = s.index("void chunk_mma_shx(")
    shx, plain = s[start:s.index("\n}\n", start)], s[s.index("void chunk_mma("):start]
    assert [ln for ln in shx.splitlines() if "pair<" in ln or "mma(acc[nt]" in ln] == [
        ln for ln in plain.splitlines() if "pair<" in ln or "mma(acc[nt]" in ln]
    assert "if (ASYNC != 2 && i0" in s  # x's register loads only where x does not come through the ring
    # the C expressions the Python below mirrors
    assert "((xu ^ ((xu >> 3) << 1) ^ (lane >> 4)) << 4)" in s and "xc[nt] = ((t >> 1) << 1) ^ (tok & 1);" in s
    assert "xa[nt] + off + 16 * ((j + 1) ^ xc[nt])" in s and "xa[nt] = xbase + tok * 256 + 64 * t;" in s

    def stored(tok, u):  # the 16-byte unit of the token's 256 bytes where unit u lies
        return u ^ ((u >> 3) << 1) ^ (tok & 1)

    def read(tok, t, j):  # where lane (g, t) of token tok reads step j
        return 4 * t + (j ^ (((t >> 1) << 1) ^ (tok & 1)))

    for tok in range(16):
        assert sorted(stored(tok, u) for u in range(16)) == list(range(16))
        for t in range(4):
            for j in range(4):
                assert read(tok, t, j) == stored(tok, 4 * t + j)
    for phase in range(4):  # 16-byte reads: lanes 8p..8p+7 (g = 2p, 2p + 1) together; token rows 256 bytes apart
        for j in range(4):
            for tile in range(2):
                groups = {(256 * (8 * tile + g) + 16 * read(8 * tile + g, t, j)) // 16 % 8
                          for g in (2 * phase, 2 * phase + 1) for t in range(4)}
                assert len(groups) == 8, (phase, j, groups)


@pytest.mark.parametrize("nt, rw, wk, depth, rt",
                         [(2, 1, 12, 2, 2), (1, 1, 12, 2, 1), (2, 2, 4, 4, 1), (1, 1, 3, 6, 4)])
def test_async_2_copies_and_reads_end_inside_the_ring_bytes_the_launch_asks_for(nt, rw, wk, depth, rt):
    """Every shared-memory address the async-2 kernel writes (cp.async of weights and of x) or reads lies inside
    ``ring_bytes``, the dynamic shared memory the launch asks for, and the last warp's x region ends at its end (the
    kernel's address expressions, mirrored below, are checked against the source first)."""
    from kpt_compiler.kernels import _fp4_cuda

    s = _fp4_cuda.SOURCE
    for expr in ("shared_address(ring_all + (threadIdx.x >> 5) * DEPTH * RT * 64 + lane)",
                 "shared_address(ring_all + RW * WK * DEPTH * RT * 64 + (threadIdx.x >> 5) * DEPTH * NT * 128)",
                 "xdst = xbase + (lane >> 4) * 256 + ((xu ^ ((xu >> 3) << 1) ^ (lane >> 4)) << 4)",
                 "cp_async16(ring + ((slot) * RT + rt) * 1024 + 512,",
                 "cp_async16(xdst + (slot) * NT * 2048 + i * 512,",
                 "for (int i = 0; i < NT * 4; ++i)", "xa[nt] = xbase + tok * 256 + 64 * t;",
                 "xa[nt] + off + 16 * ((j + 1) ^ xc[nt])", "xa, xc, p * NT * 2048);",
                 "load_shared(ring + (p * RT + rt) * 1024 + 512)"):
        assert expr in s, expr
    ends = []  # one past the last byte of each 16-byte access
    for warp in range(rw * wk):
        ring = warp * depth * rt * 64 * 16
        xbase = rw * wk * depth * rt * 64 * 16 + warp * depth * nt * 128 * 16
        for lane in range(32):
            xu, g, t = lane & 15, lane >> 2, lane & 3
            xdst = xbase + (lane >> 4) * 256 + ((xu ^ ((xu >> 3) << 1) ^ (lane >> 4)) << 4)
            for slot in range(depth):
                for r in range(rt):
                    ends += [ring + 16 * lane + (slot * rt + r) * 1024 + half + 16 for half in (0, 512)]
                ends += [xdst + slot * nt * 2048 + i * 512 + 16 for i in range(nt * 4)]
                for n in range(nt):
                    tok = n * 8 + g  # the most tokens: M = 8 NT
                    xc = ((t >> 1) << 1) ^ (tok & 1)
                    ends += [xbase + tok * 256 + 64 * t + slot * nt * 2048 + 16 * (j ^ xc) + 16 for j in range(4)]
    assert min(ends) >= 16 and max(ends) == _fp4_cuda.ring_bytes(rw, wk, depth, 2, rt, nt)
