"""The attention pass on the GPU: real models in bf16 at model sizes, the backend chosen, training."""

import copy

import pytest
import torch
import torch.nn as nn

import kpt_compiler
from kpt_compiler.bench import first_tensor, relative_error

pytestmark = pytest.mark.gpu


def _hf(name, **kw):
    pytest.importorskip("transformers")
    from kpt_compiler.models.zoo import build

    torch.manual_seed(0)
    model, make_inputs = build(name, attn="eager", **kw)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    if hasattr(model.config, "attention_dropout"):
        model.config.attention_dropout = 0.0
    return model.cuda(), make_inputs


@pytest.mark.parametrize("name, kw", [("gpt2", dict(n_layer=4)), ("llama", dict(n_layer=4)), ("bert", dict(n_layer=4))])
def test_models_bf16_inference(name, kw):
    model, make_inputs = _hf(name, **kw)
    model.eval()
    (ids,) = make_inputs(4, 512, "cuda")
    with torch.no_grad():
        ref = first_tensor(model(ids)).float()  # fp32 eager
        compiled = torch.compile(copy.deepcopy(model).bfloat16(), backend="kernelpytorch")
        out = first_tensor(compiled(ids)).float()
        eager_bf16 = first_tensor(copy.deepcopy(model).bfloat16()(ids)).float()
    # fused attention is at least as accurate as bf16 eager, with some slack for rounding order
    assert relative_error(out, ref) <= 1.5 * relative_error(eager_bf16, ref) + 1e-3
    report = kpt_compiler.last_report()
    rec = report.pass_record("attention")
    assert rec.matches == 4
    assert rec.stats.get("causal", 0) == (0 if name == "bert" else 4)
    joint_ops = report.stages["joint"].ops_after
    if torch.cuda.get_device_capability() >= (9, 0):
        assert any("cudnn_attention" in op for op in joint_ops), joint_ops


def test_a_graph_with_dynamic_sizes_runs_flash_not_cudnn_on_hopper():
    """cuDNN's SDPA builds a plan per distinct problem on the host (about 50 ms in the H100 Llama stream of
    session 41); a graph with dynamic sizes meets a new one at nearly every call, so "auto" puts flash first
    there and keeps cuDNN for graphs of fixed sizes (the test above)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the attention pass sets an SDPA order on compute capability 9.0 and up only")
    model, make_inputs = _hf("llama", n_layer=2)
    model = model.bfloat16().eval()
    compiled = torch.compile(model, backend="kernelpytorch")
    with torch.no_grad():
        for batch, seq in [(2, 128), (3, 200), (4, 77)]:  # the second call compiles the graph with dynamic sizes
            (ids,) = make_inputs(batch, seq, "cuda")
            out = first_tensor(compiled(ids)).float()
            ref = first_tensor(model(ids)).float()
            assert relative_error(out, ref) < 2e-2
    report = kpt_compiler.last_report()
    assert report.pass_record("attention").matches == 2
    note = next(n for n in report.pass_record("attention").notes if "SDPA backends" in n)
    assert note.split(": ")[1].startswith("flash"), note
    joint_ops = report.stages["joint"].ops_after
    assert any("flash_attention" in op for op in joint_ops) and not any("cudnn" in op for op in joint_ops), joint_ops


def test_llama_training_step_bf16():
    model, make_inputs = _hf("llama", n_layer=2)
    model.train()
    ref_model = copy.deepcopy(model)  # fp32
    (ids,) = make_inputs(2, 256, "cuda")
    compiled = torch.compile(model.bfloat16(), backend="kernelpytorch")
    out = first_tensor(compiled(ids))
    out.float().square().mean().backward()
    ref = first_tensor(ref_model(ids))
    ref.square().mean().backward()
    assert relative_error(out, ref) < 2e-2
    errs = [relative_error(p.grad, pr.grad) for p, pr in zip(model.parameters(), ref_model.parameters())
            if pr.grad is not None and pr.grad.norm() > 1e-6]
    assert max(errs) < 0.1, max(errs)
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.matches == 2 and "backward" in kpt_compiler.last_report().stages


def test_fp32_inputs_on_cuda_stay_exact_enough():
    model, make_inputs = _hf("gpt2", n_layer=2)
    model.eval()
    (ids,) = make_inputs(2, 128, "cuda")
    with torch.no_grad():
        ref = first_tensor(copy.deepcopy(model).double()(ids))
        out = first_tensor(torch.compile(model, backend="kernelpytorch")(ids))
    assert relative_error(out, ref) < 1e-3  # TF32 may be used by the fused kernels
    assert kpt_compiler.last_report().pass_record("attention").matches == 2


@pytest.mark.parametrize("window", [None, 100])
def test_soft_capping_and_windows_go_to_flex_attention_on_cuda_with_their_backward(window):
    import math

    import torch.nn.functional as F

    def gemma(q, k, v):
        s = torch.tanh(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 / 50.0) * 50.0
        i = torch.arange(q.shape[-2], device=q.device)
        blocked = i[None, :] > i[:, None]
        if window is not None:
            blocked = blocked | (i[:, None] - i[None, :] >= window)
        s = s + torch.zeros(s.shape[-2:], dtype=q.dtype, device=q.device).masked_fill(blocked, -math.inf)
        return F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = torch.compile(gemma, backend="kernelpytorch")(q, k, v)
    out.float().square().sum().backward()
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = gemma(*ref_in)
    ref.square().sum().backward()
    assert relative_error(out, ref) < 2e-2
    for t, r in zip((q, k, v), ref_in):
        assert relative_error(t.grad, r.grad) < 5e-2
    report = kpt_compiler.last_report()
    assert report.pass_record("attention").matches == 1
    assert any("flex_attention" in op for op in report.stages["joint"].ops_after), report.stages["joint"].ops_after


def test_alibi_goes_to_flex_attention_on_cuda_with_its_backward():
    import torch.nn.functional as F

    def alibi(q, k, v):  # slope_h * (j - i) and a causal mask, built in the graph from arange
        i = torch.arange(q.shape[-2], device=q.device)
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / q.shape[1]) for h in range(q.shape[1])], device=q.device)
        bias = (slopes.view(-1, 1, 1) * (i[None, :] - i[:, None])).to(q.dtype)
        bias = bias.masked_fill(i[None, :] > i[:, None], float("-inf"))
        return F.softmax((q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + bias).float(), dim=-1).to(q.dtype) @ v

    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = torch.compile(alibi, backend="kernelpytorch")(q, k, v)
    out.float().square().sum().backward()
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = alibi(*ref_in)
    ref.square().sum().backward()
    assert relative_error(out, ref) < 2e-2
    for t, r in zip((q, k, v), ref_in):
        assert relative_error(t.grad, r.grad) < 5e-2
    report = kpt_compiler.last_report()
    assert report.pass_record("attention").stats.get("linear_bias") == 1, report.pass_record("attention").notes
    assert any("flex_attention" in op for op in report.stages["joint"].ops_after), report.stages["joint"].ops_after


# ------------------------------------------------------------------------------- SDPA calls already there


def _sdpa_call(mask_fn):
    def fn(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask_fn(q))
    return fn


def _bf16(B=4, H=12, L=197, D=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]


def test_an_expanded_all_true_mask_is_dropped_so_sdpa_runs_a_fused_kernel():
    # transformers 5.17 hands BERT and ViT this mask; its last-dimension stride is 0, so SDPA ran math
    q, k, v = _bf16()
    L = q.shape[-2]
    fn = _sdpa_call(lambda q: (torch.arange(L, device=q.device)[None, None, :, None] >= 0).expand(q.shape[0], 1, L, L))
    out = torch.compile(fn, backend="kernelpytorch")(q, k, v)
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.matches == 1 and any("dropped" in n and "kernel here" in n for n in rec.notes), rec.notes
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert relative_error(out.float(), ref) < 1e-2


def test_a_bias_laid_out_as_t5_does_is_read_contiguous_and_stays_exact():
    q, k, v = _bf16(L=256)
    L, H = q.shape[-2], q.shape[-3]
    bias = torch.randn(L, L, H, device="cuda", dtype=torch.bfloat16).permute(2, 0, 1)[None]  # last stride H

    def fn(q, k, v, bias):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)

    out = torch.compile(fn, backend="kernelpytorch")(q, k, v, bias)
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.matches == 1 and any("contiguous copy" in n for n in rec.notes), rec.notes
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias.float(),
                                                           scale=1.0)
    assert relative_error(out.float(), ref) < 1e-2


def test_the_probe_agrees_with_the_dispatcher_on_cuda():
    from kpt_compiler.passes import _attention_gate as gate
    import torch.fx as fx

    q, k, v = _bf16()
    L = q.shape[-2]
    expanded = (torch.arange(L, device="cuda")[None, None, :, None] >= 0).expand(q.shape[0], 1, L, L)
    graph = fx.Graph()
    nodes = [graph.placeholder(n) for n in "qkvm"]
    for mask, expected in ((expanded, "MATH"), (expanded.contiguous(), None)):
        for n, t in zip(nodes, (q, k, v, mask)):
            n.meta["example_value"] = t
        picked = gate.backend(gate.Call(*nodes, dropout=0.0, causal=False, scale=None), q.device, None)
        assert picked == (expected or torch.nn.attention.SDPBackend(
            torch._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=None)).name)
        assert (picked == "MATH") == (mask.stride(-1) == 0)


def test_decide_measure_times_the_call_against_what_runs_instead(tmp_path, monkeypatch):
    monkeypatch.setenv("KPT_CACHE_DIR", str(tmp_path))  # a fresh decision cache: this compile measures
    q, k, v = _bf16(L=512)

    def hand_written(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1) @ v

    L = q.shape[-2]
    expanded = _sdpa_call(lambda q: (torch.arange(L, device=q.device)[None, None, :, None] >= 0).expand(q.shape[0], 1, L, L))
    for fn, theirs in ((hand_written, "decomposed"), (expanded, "decomposed")):
        torch._dynamo.reset()
        out = torch.compile(fn, backend="kernelpytorch", options={"attention": {"decide": "measure"}})(q, k, v)
        rec = kpt_compiler.last_report().pass_record("attention")
        timed = [n for n in rec.notes if "measured on" in n]
        assert timed and f"Inductor's side: {theirs}" in timed[0], rec.notes
        assert rec.matches == 1, rec.notes  # fused attention beats the decomposed form at this size
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        assert relative_error(out.float(), ref) < 1e-2
    assert (tmp_path / "decisions.json").exists()


def test_a_mask_of_dynamic_length_compiles_once_for_every_length():
    # Inductor's SDPA lowering guards a dynamic mask's row stride % 8, so a graph compiled at an aligned length
    # recompiled for the other residues; the pass reads rows padded to a multiple of 8 instead
    from torch._dynamo.utils import counters

    def fn(q, k, v, keep):  # one mask from the inputs, realized once for two attention calls
        bias = torch.where(keep[:, None, None, :], 0.0, -1e9).to(q.dtype).expand(-1, 1, q.shape[-2], -1)
        bias = bias + torch.zeros_like(bias)
        x = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return torch.nn.functional.scaled_dot_product_attention(x, k, v, attn_mask=bias)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="kernelpytorch")
    for n in (16, 24, 13, 21, 7, 40):
        q, k, v = _bf16(B=2, H=4, L=n)
        keep = torch.rand(2, n, device="cuda") > 0.3
        keep[:, 0] = True
        out = compiled(q, k, v, keep)
        ref = fn(q.float(), k.float(), v.float(), keep)
        assert relative_error(out.float(), ref) < 2e-2, n
    rec = kpt_compiler.last_report().pass_record("attention")
    assert any("padded to a multiple of 8" in note for note in rec.notes), rec.notes
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # the first lengths, then dynamic


def test_gpt2_with_changing_lengths_runs_causal_sdpa_with_no_mask():
    # the dynamic graph's causal mask is read as a formula in the positions: is_causal, no dense mask
    from torch._dynamo.utils import counters

    model, make_inputs = _hf("gpt2", n_layer=2)
    model = model.to(torch.bfloat16).eval()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="kernelpytorch")
    with torch.no_grad():
        for b, s in ((2, 64), (3, 100), (4, 37), (2, 200)):
            x = make_inputs(b, s, "cuda")
            out, ref = first_tensor(compiled(*x)), first_tensor(model(*x))
            assert relative_error(out.float(), ref.float()) < 2e-2, (b, s)
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.stats.get("causal", 0) == 2 and any("for every size" in n for n in rec.notes), rec.notes
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # the first sizes, then dynamic


@pytest.mark.parametrize("batch, length", [(16, 80), (16, 4096), (1, 4096)])
def test_a_decode_steps_grouped_query_sdpa_is_packed_where_the_gpu_has_pairs_enough(batch, length):
    # passes/_attention_gqa.py under Inductor on the GPU: one token, 32 query heads over 8 key/value heads (Llama's
    # ratio) through repeat_kv with a padding mask, as transformers' static cache writes it under torch.compile.
    # At batch 16 (128 pairs) the gate takes the packed call (a fused backend for it); at batch 1 (8 pairs, under
    # a fifth of the SMs) it is left as it was, and the report says why. Either way it agrees with eager in bf16.
    # gqa_kernel="sdpa": on compute capability 9.x "auto" takes FlexAttention instead (the test below)
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(length)
    q = torch.randn(batch, 32, 1, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(batch, 8, length, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    keep = torch.ones(batch, 1, 1, length, dtype=torch.bool, device="cuda")
    keep[-1, ..., length // 2:] = False

    def fn(q, k, v, keep):
        kr, vr = (x[:, :, None].expand(batch, 8, 4, length, 128).reshape(batch, 32, length, 128) for x in (k, v))
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=keep, scale=128 ** -0.5)

    torch._dynamo.reset()
    out = torch.compile(fn, backend="kernelpytorch", options={"attention": {"gqa_kernel": "sdpa"}})(q, k, v, keep)
    rec = kpt_compiler.last_report().pass_record("attention")
    if batch == 1:
        assert not rec.stats.get("gqa_packed") and any("pairs, under a fifth" in n for n in rec.notes), rec.notes
    else:
        assert rec.stats.get("gqa_packed") == 1 and any("SDPA runs its" in n for n in rec.notes), rec.notes
    ref = fn(*(x.double() for x in (q, k, v)), keep)
    assert relative_error(out, ref) < 1e-2


@pytest.mark.parametrize("kernel", ["auto", "flex"])
@pytest.mark.parametrize("batch, t, length, additive", [(1, 1, 80, False), (1, 1, 4096, True), (16, 1, 2080, False),
                                                        (4, 4, 300, False)])
def test_a_decode_steps_grouped_query_sdpa_runs_as_flexattention_under_inductor(batch, t, length, additive, kernel):
    # gqa_kernel="flex", and "auto" (the default) on compute capability 9.x: FlexAttention over k and v as they
    # are, Inductor's decoding kernel at query lengths under 128; a padding mask (boolean or additive, bf16), one
    # or a few query positions
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(length + t)
    q = torch.randn(batch, 32, t, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(batch, 8, length, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    keep = torch.ones(batch, 1, t, length, dtype=torch.bool, device="cuda")
    keep[-1, ..., length // 2:] = False
    mask = torch.zeros(keep.shape, device="cuda").bfloat16().masked_fill(~keep, -1e4) if additive else keep

    def fn(q, k, v, mask):
        kr, vr = (x[:, :, None].expand(batch, 8, 4, length, 128).reshape(batch, 32, length, 128) for x in (k, v))
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=128 ** -0.5)

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend="kernelpytorch", options={"attention": {"gqa_kernel": kernel}})(q, k, v, mask)
    rec = kpt_compiler.last_report().pass_record("attention")
    if kernel == "auto" and torch.cuda.get_device_capability()[0] != 9:
        assert rec.stats.get("gqa_flex", 0) == 0, rec.notes  # timed on sm_90 only: packed SDPA (or none) here
    else:
        assert rec.stats.get("gqa_flex") == 1 and not rec.stats.get("gqa_packed"), rec.notes
    ref = fn(*(x.double() for x in (q, k, v)), mask.double() if additive else mask)
    assert relative_error(out, ref) < 1e-2
