"""Grouped-query SDPA over repeat_kv's copies at small query lengths as FlexAttention over k and v as they are
(passes/_attention_gqa.py, ``gqa_kernel``; kernels/flex_attention.py, ``flex_masked_sdpa``). On the CPU the
rewritten graph runs eagerly (the higher-order op's own math) against float64 eager, gradients included."""

import pytest
import torch
import torch.nn.functional as F

import kpt_compiler
from kpt_compiler.bench import relative_error
from kpt_compiler.kernels.flex_attention import flex_masked_sdpa

import test_attention_gqa
from test_attention_gqa import B, D, KVH, L


def repeat_kv(x, n_rep):  # transformers' spelling
    b, kvh, slen, d = x.shape
    return x[:, :, None, :, :].expand(b, kvh, n_rep, slen, d).reshape(b, kvh * n_rep, slen, d)


def _attend(r, causal=False):
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, repeat_kv(k, r), repeat_kv(v, r), attn_mask=mask,
                                              is_causal=causal, scale=0.3)
    return fn


def _run(r, t, mask, train=True, options=None, causal=False):
    opts = {"attention": {"gqa_kernel": "flex"}, **(options or {})}
    return test_attention_gqa._run(_attend(r, causal), t, mask, train, heads=KVH * r, options=opts)


def _keep(shape, t):
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(7)) > 0.3
    keep[..., 0] = True  # no row fully masked
    return keep


@pytest.mark.parametrize("r, t, shape, additive", [
    (4, 1, (B, 1, 1, L), False), (4, 1, (B, 1, 1, L), True), (2, 3, (B, 1, 3, L), False),
    (4, 3, (1, 1, 1, L), True), (2, 1, None, False), (4, 2, (2, L), False),
    (2, 1, (B, 2 * KVH, 1, L), False)])  # a mask per query head too (the packed SDPA form cannot take it)
def test_a_small_query_over_repeated_heads_runs_as_flexattention(r, t, shape, additive):
    mask = None if shape is None else _keep(shape, t)
    if additive and mask is not None:
        mask = torch.zeros(mask.shape).masked_fill(~mask, -1e4)
    rec, ops = _run(r, t, mask)
    assert rec.stats["gqa_flex"] == 1 and rec.stats.get("gqa_packed", 0) == 0 and rec.matches == 1, rec.notes
    assert any("grouped-query attention as FlexAttention" in n for n in rec.notes), rec.notes
    assert "reshape" not in ops and "expand" not in ops, ops  # repeat_kv's copies are gone
    assert "flex_masked_sdpa" in ops, ops


@pytest.mark.parametrize("why, r, t, options", [
    ("not a power-of-two ratio", 3, 1, {}),
    ("causal or dropout", 2, 3, {"causal": True}),
    ("not on the CPU", 2, 1, {"codegen": "inductor"})])
def test_what_flexattention_cannot_take_is_a_near_miss_and_left_to_packing(why, r, t, options):
    causal = options.pop("causal", False)
    mask = None if causal else _keep((B, 1, 1, L), t)
    if options.get("codegen") == "inductor":  # one small Inductor compile: the graph runs through it
        rec, _ = _run(r, t, mask, train=False, options=options)
    else:
        rec, _ = _run(r, t, mask, train=False, causal=causal)
    assert rec.stats.get("gqa_flex", 0) == 0, rec.notes
    said = [n for n in rec.notes if "FlexAttention's decoding form is not made: " in n]
    assert len(said) == 1 and why in said[0], rec.notes
    assert rec.stats.get("gqa_packed", 0) == int(not causal), rec.notes  # the packed SDPA form instead


def test_a_head_size_under_16_is_left_to_packing():
    # Inductor's FlexAttention lowering raises on CUDA under 16 (torch/_inductor/kernel/flex/flex_attention.py)
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask)

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, 2 * KVH, 1, 8, generator=g), *(torch.randn(B, KVH, L, 8, generator=g) for _ in range(2))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="kernelpytorch",
                             options={"codegen": "eager", "fusion": False, "attention": {"gqa_kernel": "flex"}})
    mask = _keep((B, 1, 1, L), 1)
    assert relative_error(compiled(q, k, v, mask), fn(q.double(), k.double(), v.double(), mask)) < 1e-5
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.stats.get("gqa_packed") == 1 and not rec.stats.get("gqa_flex"), rec.notes
    assert any("a head size of 8: Inductor's FlexAttention needs 16 or more" in n for n in rec.notes), rec.notes


def test_the_block_mask_is_the_graphs_constants_once_a_size_and_the_scale_sdpas_default():
    # three calls, two of one size: one set of constants a size (not built in each call); no scale given
    from kpt_compiler.passes import attention
    from kpt_compiler.registry import PassContext
    from kpt_compiler.target import Target

    import test_cudagraphs

    def fn(q, q3, k, v, mask, mask3):
        kr, vr = repeat_kv(k, 4), repeat_kv(v, 4)
        one = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        two = F.scaled_dot_product_attention(q * 2, kr, vr, attn_mask=mask)
        return one + two, F.scaled_dot_product_attention(q3, kr, vr, attn_mask=mask3)

    g = torch.Generator().manual_seed(0)
    q, q3 = torch.randn(B, 4 * KVH, 1, D, generator=g), torch.randn(B, 4 * KVH, 3, D, generator=g)
    k, v = (torch.randn(B, KVH, L, D, generator=g) for _ in range(2))
    inputs = (q, q3, k, v, _keep((B, 1, 1, L), 1), _keep((B, 1, 3, L), 3))
    gm = test_cudagraphs._graph(fn, *inputs)
    ctx = PassContext(options=attention.AttentionOptions(gqa_kernel="flex"), target=Target("cpu", "cpu"),
                      stage="pre_aot", is_inference=True, mode="default", codegen="eager")
    assert attention.fuse_attention(gm, ctx) and ctx.stats["gqa_flex"] == 3, ctx.notes
    gm.recompile()
    consts = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    per_size = {size: [c for c in consts if c.startswith(f"_kpt_flex_blocks_{size}_cpu_")]
                for size in ("1x11", "3x11")}
    assert len(per_size["1x11"]) == len(per_size["3x11"]) > 0 and len(consts) == 2 * len(per_size["1x11"]), consts
    assert not any("block_mask" in str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    by_name = dict(zip(("q", "q3", "k", "v", "mask", "mask3"), inputs))  # Dynamo's inputs in the order it read them
    got = gm(*(by_name[n.name.removeprefix("l_").removesuffix("_")] for n in gm.graph.nodes if n.op == "placeholder"))
    want = fn(*(x.double() if x.is_floating_point() else x for x in inputs))
    assert all(relative_error(a, b) < 1e-5 for a, b in zip(got, want))


H200, A100 = ("NVIDIA H200", (9, 0)), ("NVIDIA A100-SXM4-80GB", (8, 0))


@pytest.mark.parametrize("kernel, card, codegen, made", [
    ("auto", H200, "inductor", "gqa_flex"), ("auto", A100, "inductor", "gqa_packed"),
    ("auto", H200, "eager", "gqa_packed"), ("sdpa", H200, "inductor", "gqa_packed"),
    ("flex", A100, "inductor", "gqa_flex")])
def test_gqa_kernel_auto_takes_flexattention_under_inductor_on_sm_9x_only(monkeypatch, kernel, card, codegen, made):
    # "auto" (the default): FlexAttention's decoding kernel where it was timed (an H200, sm_90, under Inductor:
    # as fast or faster captured, s34-s35); elsewhere packed SDPA, and on another GPU the report says why. The
    # rewritten graph runs here eagerly (CPU tensors behind the faked card) and equals float64 eager
    from kpt_compiler.passes import _attention_gate as gate
    from kpt_compiler.passes import attention
    from kpt_compiler.registry import PassContext
    from kpt_compiler.target import Target

    import test_cudagraphs

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=mask, scale=0.3)

    monkeypatch.setattr(gate, "backend", lambda call, device, order: "CUDNN_ATTENTION")
    g = torch.Generator().manual_seed(3)
    inputs = (torch.randn(B, 4 * KVH, 1, D, generator=g), *(torch.randn(B, KVH, L, D, generator=g) for _ in "kv"),
              _keep((B, 1, 1, L), 1))
    gm = test_cudagraphs._graph(fn, *inputs)
    ctx = PassContext(options=attention.AttentionOptions(gqa_kernel=kernel),
                      target=Target("cuda", card[0], card[1], multiprocessors=8), stage="pre_aot",
                      is_inference=True, mode="default", codegen=codegen)
    assert attention.fuse_attention(gm, ctx) and ctx.stats.get(made) == 1, ctx.notes
    assert sum(ctx.stats.get(k, 0) for k in ("gqa_flex", "gqa_packed")) == 1, ctx.stats
    said = [n for n in ctx.notes if "FlexAttention's decoding form was timed on compute capability 9.0 only" in n]
    assert len(said) == (kernel == "auto" and card == A100), ctx.notes
    gm.recompile()
    by_name = dict(zip(("q", "k", "v", "mask"), inputs))
    got = gm(*(by_name[n.name.removeprefix("l_").removesuffix("_")] for n in gm.graph.nodes if n.op == "placeholder"))
    want = fn(*(x.double() if x.is_floating_point() else x for x in inputs))
    assert relative_error(got[0], want) < 1e-5


def test_a_dynamic_batch_is_left_to_packing():
    def fn(q, kv, mask):
        r = repeat_kv(kv, 2)
        return F.scaled_dot_product_attention(q, r, r, attn_mask=mask, scale=0.3)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="kernelpytorch",
                             options={"codegen": "eager", "fusion": False, "attention": {"gqa_kernel": "flex"}})
    g = torch.Generator().manual_seed(1)
    for b, length in ((2, 11), (3, 17)):
        q, kv = torch.randn(b, 2 * KVH, 1, D, generator=g), torch.randn(b, KVH, length, D, generator=g)
        mask = torch.rand(b, 1, 1, length, generator=g) > 0.2
        mask[..., 0] = True
        for x in (q, kv, mask):  # dynamic from the first call (torch 2.9 under pytest kept recompiling statically)
            torch._dynamo.mark_dynamic(x, 0)
        assert relative_error(compiled(q, kv, mask), fn(q.double(), kv.double(), mask)) < 1e-5
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.stats.get("gqa_packed") == 1 and not rec.stats.get("gqa_flex"), rec.notes
    assert any("not made: dynamic shapes" in n for n in rec.notes), rec.notes


@pytest.mark.parametrize("shape", [(B, 1, 3, L), (3, L), None])
def test_flex_masked_sdpa_is_sdpa_with_the_mask(shape):
    # the kernel's function alone, eagerly: boolean and additive masks, broadcast, none; grouped-query heads
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, 4 * KVH, 3, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, KVH, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    masks = [None] if shape is None else [_keep(shape, 3), torch.randn(shape, generator=g, dtype=torch.float64)]
    for m in masks:
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.25, enable_gqa=True)
        assert relative_error(flex_masked_sdpa(q, k, v, m, scale=0.25), want) < 1e-10


def _window(q, k, v, mask):  # a constant sliding window: the attention pass's flex_sdpa form
    i = torch.arange(q.shape[-2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4))


@pytest.mark.parametrize("fn, heads, t, made", [(_attend(4), 4 * KVH, 1, "flex_masked_sdpa"),
                                                (_window, KVH, L, "flex_sdpa")])
def test_the_cudagraphs_estimate_counts_flexattention_as_the_sdpa_call_it_replaced(fn, heads, t, made):
    # torch's FLOP counter cannot run the higher-order op (torch 2.11-2.13): the estimate failed, and under "auto"
    # the cudagraphs pass declined every graph with a FlexAttention form (decode steps on the H200, s34; the
    # windowed and soft-capped forms before). Now it counts SDPA's FLOPs
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kpt_compiler.passes import attention, cudagraphs as cg
    from kpt_compiler.registry import PassContext
    from kpt_compiler.target import Target

    import test_cudagraphs

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, heads, t, D, generator=g), *(torch.randn(B, KVH, L, D, generator=g) for _ in range(2))
    gm = test_cudagraphs._graph(fn, q, k, v, _keep((B, 1, t, L), t))
    with sdpa_kernel(SDPBackend.MATH):  # the CPU's fused SDPA op has no FLOP formula; its math path has
        before = cg.estimate(gm)[0]
    ctx = PassContext(options=attention.AttentionOptions(gqa_kernel="flex"), target=Target("cpu", "cpu"),
                      stage="pre_aot", is_inference=True, mode="default", codegen="eager")
    assert attention.fuse_attention(gm, ctx), ctx.notes
    gm.recompile()
    assert any(made == getattr(n.target, "__name__", None) for n in gm.graph.nodes), gm.graph
    with sdpa_kernel(SDPBackend.MATH):
        assert cg.estimate(gm)[0] == before > 0


def test_the_flop_stand_in_gives_sdpa_the_query_heads_in_k_and_v(monkeypatch):
    # torch 2.11's FLOP formula for SDPA's fused CUDA ops asserts that q, k and v have the same heads (H200, s34)
    seen = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: seen.append((q, k, v)) or q)
    q, k = torch.randn(B, 4 * KVH, 1, D), torch.randn(B, KVH, L, D)
    flex_masked_sdpa.flop_standin(q, k, k, None, scale=0.25)
    assert [t.shape for t in seen[0]] == [q.shape, (B, 4 * KVH, L, D), (B, 4 * KVH, L, D)]


def test_asking_for_flexattention_without_packing_is_an_error_that_says_so():
    with pytest.raises(kpt_compiler.OptionError, match="gqa_kernel='flex' .* needs pack_gqa=True"):
        torch.compile(lambda x: x + 1, backend="kernelpytorch",
                      options={"attention": {"gqa_kernel": "flex", "pack_gqa": False}})(torch.ones(2))


@pytest.mark.parametrize("s, pairs, want", [(80, 8, 2), (2080, 8, 17), (4096, 8, 32), (2080, 128, 2), (2080, 300, 1),
                                            (1, 8, 1), (64 * 40, 8, 20)])
def test_the_decoding_kernel_gets_no_more_key_splits_than_there_are_tiles_of_keys(s, pairs, want):
    # Inductor's rule on 132 SMs: 2 * (132 // pairs) parts, each rounded up to whole tiles of 64 keys
    from kpt_compiler.kernels.flex_attention import split_kv

    got = split_kv(s, pairs, 132)
    assert got == want
    inductor = max(2 * (132 // pairs), 1)
    tile = -(-(-(-s // inductor)) // 64) * 64  # the keys a part of Inductor's covers
    assert got <= inductor and -(-s // got) <= tile and (got - 1) * tile < s  # as much work a part, none empty
