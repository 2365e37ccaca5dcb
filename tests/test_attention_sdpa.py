"""The attention pass on SDPA calls already in the graph (transformers' default path, timm, user code): a mask
that depends on no input is computed at compile time and dropped, made ``is_causal`` or a FlexAttention form;
a mask from the inputs stays exact; and the profit gate declines a call SDPA would run with its math backend."""

import pytest
import torch
import torch.nn.functional as F

import kpt_compiler
import kpt_compiler.backend as backend_module
from kpt_compiler.bench import relative_error
from kpt_compiler.passes import _attention_gate as gate
from kpt_compiler.target import Target

B, H, L, D = 2, 3, 9, 16
TOL = 1e-5


def _qkv(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, L, D, generator=g).requires_grad_(requires_grad) for _ in range(3)]


def _run(fn, *extra, options=None, train=True):
    """Compile ``fn(q, k, v, *extra)`` (the rewritten graph runs eagerly), compare output and gradients with
    float64 eager, and return the attention pass's record and the SDPA/FlexAttention calls left in the graph."""
    q, k, v = _qkv(train)
    out = torch.compile(fn, backend="kernelpytorch",
                        options={"codegen": "eager", "fusion": False, **(options or {})})(q, k, v, *extra)
    ref_in = [t.detach().double().requires_grad_(train) for t in (q, k, v)]
    # the math backend: torch 2.13's CPU flash kernel, given float64 q, k, v and a float32 mask made inside fn,
    # returns neither the masked nor the unmasked attention on some CPUs (seen on this project's dev machine)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = fn(*ref_in, *[e.double() if e.is_floating_point() else e for e in extra])
    assert relative_error(out, ref) < TOL
    if train:
        out.square().sum().backward()
        ref.square().sum().backward()
        for t, r in zip((q, k, v), ref_in):
            assert relative_error(t.grad, r.grad) < TOL
    report = kpt_compiler.last_report()
    return report.pass_record("attention"), report.stages["pre_aot"].ops_after


def _expanded_all_true(q):  # transformers 5.17's bidirectional mask for BERT and ViT: last-dimension stride 0
    return (torch.arange(q.shape[-2], device=q.device)[None, None, :, None] >= 0).expand(q.shape[0], 1, L, L)


def test_no_mask_is_looked_at_and_left_alone():
    rec, _ = _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    assert rec.stats["sdpa_calls"] == 1 and rec.matches == 0 and rec.status == "unchanged"
    assert any("no mask" in n and "nothing to prove" in n for n in rec.notes), rec.notes


def test_a_constant_all_true_mask_is_dropped():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_expanded_all_true(q), scale=0.3)

    rec, ops = _run(fn)
    assert rec.matches == 1 and rec.stats["sdpa_calls"] == 1, rec.notes
    assert any("masks nothing: dropped" in n for n in rec.notes), rec.notes
    assert ops.get("arange", 0) == 0 and ops.get("expand", 0) == 0  # the mask's computation went with it


def test_a_constant_lower_triangular_mask_becomes_is_causal():
    def fn(q, k, v):
        i = torch.arange(L, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=i[None, :] <= i[:, None])

    rec, _ = _run(fn)
    assert rec.matches == 1 and rec.stats["causal"] == 1, rec.notes
    assert any("is_causal=True" in n for n in rec.notes), rec.notes


def test_a_constant_additive_causal_mask_becomes_is_causal():
    def fn(q, k, v):
        i = torch.arange(L, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(i[None, :] <= i[:, None], 0.0,
                                                                               float("-inf")))

    rec, _ = _run(fn)
    assert rec.matches == 1 and rec.stats["causal"] == 1, rec.notes


def test_a_padding_mask_from_an_input_stays_exact():
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[0, ..., 5:] = False

    def fn(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    rec, _ = _run(fn, keep)
    assert rec.matches == 0 and rec.stats["sdpa_calls"] == 1, rec.notes
    assert any("from the inputs (kept exact)" in n for n in rec.notes), rec.notes


def test_a_constant_sliding_window_goes_to_flex_attention():
    def fn(q, k, v):
        i = torch.arange(L, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4))

    rec, ops = _run(fn)
    assert rec.matches == 1 and rec.stats["window"] == 1, rec.notes
    assert ops.get("flex_sdpa", 0) == 1 and ops.get("scaled_dot_product_attention", 0) == 0, ops


def test_a_constant_mask_with_no_structure_stays():
    def fn(q, k, v):
        i = torch.arange(L, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(i[None, :] + i[:, None]) % 3 != 0)

    rec, _ = _run(fn)
    assert rec.matches == 0 and any("no structure" in n for n in rec.notes), rec.notes


# ------------------------------------------------------------------------------------------------- the gate


@pytest.fixture
def as_if_on_an_h100(monkeypatch):
    """The compile believes it targets an H100 (the graph still runs on the CPU); the dispatcher's answer is
    what the test says it is."""
    h100 = Target("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setattr(backend_module, "detect_target", lambda *a, **k: h100)
    picked = {"backend": "CUDNN_ATTENTION", "seen": []}

    def fake_backend(call, device, order):
        picked["seen"].append(call.describe())
        return picked["backend"](call) if callable(picked["backend"]) else picked["backend"]

    monkeypatch.setattr(gate, "backend", fake_backend)
    return picked


def test_the_expanded_mask_that_sends_sdpa_to_math_is_dropped_on_cuda(as_if_on_an_h100):
    # the stride-0 mask sends SDPA to its math backend; without it the call is fused
    as_if_on_an_h100["backend"] = lambda call: "MATH" if call.mask is not None else "CUDNN_ATTENTION"
    rec, _ = _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_expanded_all_true(q)),
                  train=False)
    assert rec.matches == 1, rec.notes
    assert any("dropped" in n and "cudnn kernel" in n for n in rec.notes), rec.notes


def test_a_mask_from_the_inputs_with_a_broadcast_last_dimension_is_read_contiguous_on_cuda(as_if_on_an_h100):
    # T5 lays its relative-position bias out [L, S, H] and permutes it: last-dimension stride H, not 1
    bias = torch.randn(L, L, H).permute(2, 0, 1)[None]

    def fn(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    rec, ops = _run(fn, bias, train=False)
    assert rec.matches == 1 and ops.get("contiguous", 0) == 1, (rec.notes, ops)
    assert any(f"stride {H}" in n and "contiguous copy" in n for n in rec.notes), rec.notes
    assert "strides [1, 1, 1, 1]" not in " ".join(as_if_on_an_h100["seen"])  # the probe saw the copy's layout
    assert f"strides [{H * L * L}, {L * L}, {L}, 1]" in as_if_on_an_h100["seen"][0]


def test_hand_written_attention_sdpa_would_run_as_math_is_declined_with_its_reason(as_if_on_an_h100):
    as_if_on_an_h100["backend"] = "MATH"

    def fn(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v

    rec, ops = _run(fn, train=False)
    assert rec.matches == 0 and rec.stats["near_misses"] == 1 and rec.status == "unchanged", rec.notes
    assert any("not faster here" in n and "math backend" in n and "decide='measure'" in n for n in rec.notes)
    assert ops.get("scaled_dot_product_attention", 0) == 0 and ops.get("softmax", 0) == 1
    rec, ops = _run(fn, train=False, options={"attention": {"decide": "always"}})
    assert rec.matches == 1 and ops.get("scaled_dot_product_attention", 0) == 1


def test_the_backend_probe_asks_the_dispatcher():
    # on the CPU, real tensors: the fused CPU kernel takes float32 attention with or without a mask
    import torch.fx as fx

    q = torch.randn(B, H, L, D)

    graph = fx.Graph()
    nodes = [graph.placeholder(n) for n in "qkvm"]
    for n, t in zip(nodes, (q, q, q, torch.ones(L, L, dtype=torch.bool))):
        n.meta["example_value"] = t
    call = gate.Call(*nodes, dropout=0.0, causal=False, scale=None)
    assert gate.backend(call, torch.device("cpu"), None) == torch.nn.attention.SDPBackend(
        torch._fused_sdp_choice(q, q, q, torch.ones(L, L, dtype=torch.bool), 0.0, False, scale=None)).name


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_a_mask_of_dynamic_length_is_read_through_rows_padded_to_8_on_cuda(as_if_on_an_h100, monkeypatch, codegen):
    # Inductor's SDPA lowering guards a dynamic mask's row stride % 8 (a graph per residue); rows padded to a
    # multiple of 8 are aligned at every length. The values the call reads are the mask's own, under Inductor
    # too (a view of Inductor's own padded buffer read a layout Inductor had chosen otherwise: wrong values).
    from torch._dynamo.utils import counters

    from kpt_compiler.passes import attention

    made = []
    aligned_rows = attention._aligned_rows
    monkeypatch.setattr(attention, "_aligned_rows", lambda *a: made.append(aligned_rows(*a)) or made[-1])

    def fn(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="kernelpytorch", options={"codegen": codegen, "fusion": False})
    g = torch.Generator().manual_seed(1)
    for n in (L, 16, 13, 8, 21):  # the second length makes Dynamo compile a graph dynamic in it, at 16
        q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
        bias = torch.randn(B, 1, n, n, generator=g)
        if n != L:  # dynamic from the second length on (torch 2.9's Dynamo kept recompiling static otherwise)
            for t in (q, k, v):
                torch._dynamo.mark_dynamic(t, 2)
            torch._dynamo.mark_dynamic(bias, 2)
            torch._dynamo.mark_dynamic(bias, 3)
        out = compiled(q, k, v, bias)
        ref = fn(*(t.double() for t in (q, k, v, bias)))
        assert relative_error(out, ref) < TOL, n
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # the first length, then every other
    report = kpt_compiler.last_report()
    rec, ops = report.pass_record("attention"), report.stages["pre_aot"].ops_after
    assert rec.matches == 1 and ops.get("narrow", 0) == 1, (rec.notes, ops)
    assert any("padded to a multiple of 8" in n for n in rec.notes), rec.notes
    assert len(made) == 1 and made[0].args[0].target is torch.ops.kpt.pad_rows_inference.default
    strides = made[0].meta["example_value"].stride()
    assert all(isinstance(s, torch.SymInt) for s in strides[:-1]), strides
    for n in (5, 8, 13, 100):  # every stride but the last is a multiple of 8 at any length
        assert all(int(s.node.expr.subs({sym: n for sym in s.node.expr.free_symbols})) % 8 == 0
                   for s in strides[:-1]), strides


def test_pad_rows_keeps_the_values_and_the_gradient():
    from kpt_compiler.kernels.aligned_rows import aligned_rows

    for n in (1, 7, 8, 9, 16):
        x = torch.randn(2, 3, n, n, dtype=torch.float64, requires_grad=True)
        y = aligned_rows(x)
        assert torch.equal(y, x) and y.stride(-2) % 8 == 0 and y.stride(-2) > n and y.stride(-1) == 1
        w = torch.randn_like(y)
        (g,) = torch.autograd.grad((y * w).sum(), x)
        assert torch.equal(g, w)
    torch.library.opcheck(torch.ops.kpt.pad_rows.default, (torch.randn(2, 5, 11, requires_grad=True),))


def _aot_cache_checked(monkeypatch) -> list[str]:
    """What AOTAutograd's cache check says of each graph the eager emitter gets (our pre_aot rewrite), with our
    own functions marked cacheable as the Inductor emitter marks them."""
    from torch._functorch._aot_autograd.autograd_cache import check_cacheable
    from torch._inductor import config as inductor_config

    from kpt_compiler import emitters

    reasons, real = [], emitters.EMITTERS["eager"]

    def eager(gm, example_inputs, pm):
        try:
            with inductor_config.patch(fx_graph_cache=True,
                                       unsafe_marked_cacheable_functions=emitters._cacheable_functions(gm, pm)):
                check_cacheable(gm)
            reasons.append("ok")
        except Exception as e:  # noqa: BLE001 - the reason is the result
            reasons.append(f"{type(e).__name__}: {e}")
        return real(gm, example_inputs, pm)

    monkeypatch.setitem(emitters.EMITTERS, "eager", eager)
    return reasons


def test_the_nodes_the_mask_rewrites_insert_keep_the_graph_in_aotautograds_cache(as_if_on_an_h100, monkeypatch):
    # torch.Tensor.contiguous / .to as call_function targets made AOTAutograd's cache check raise
    # ('method_descriptor' object has no attribute '__module__'): T5's warm restart on the H200 traced its graph
    # again (1.8-2.2x cold/warm, s22-s23). The rewrites now insert ATen ops.
    reasons = _aot_cache_checked(monkeypatch)
    bias = torch.randn(L, L, H).permute(2, 0, 1)[None]  # read through a contiguous copy
    rec, ops = _run(lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b), bias, train=False)
    assert rec.matches == 1 and any("contiguous copy" in n for n in rec.notes), rec.notes
    narrow = torch.zeros(1, 1, L, L, dtype=torch.bfloat16)  # cast to the scores' dtype
    narrow[..., -2:] = -1e4
    torch._dynamo.reset()
    rec, ops = _run(lambda q, k, v, m: F.softmax(q @ k.transpose(-2, -1) + m, -1) @ v, narrow, train=False)
    assert rec.matches == 1, rec.notes
    assert reasons == ["ok", "ok"], reasons
