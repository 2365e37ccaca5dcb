"""The attention pass: each hand-written form becomes SDPA with the same numerics (forward and gradients),
and the near misses stay as they were, with the reason in the report."""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kpt_compiler
from kpt_compiler.bench import first_tensor, relative_error

B, H, L, D = 2, 3, 9, 16  # odd sizes on purpose
TOL = 1e-5  # fp32 against a float64 reference


def _qkv(requires_grad=False, heads_kv=H):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, D, generator=g)
    k = torch.randn(B, heads_kv, L, D, generator=g)
    v = torch.randn(B, heads_kv, L, D, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


# a mask the caller passes in, in a training graph: rewritten as in inference (these tests read masks that leave
# every row a key; the default leaves such attention alone: test_a_caller_mask_that_may_hide_rows_...)
REWRITE = {"attention": {"hidden_rows": "rewrite"}}


def _compile(fn, options=None):
    return torch.compile(fn, backend="kernelpytorch", options={"codegen": "eager", **(options or {})})


def _check(fn, *, matches=1, causal=None, train=True, extra=(), options=None, status=None,
           op="scaled_dot_product_attention"):
    """Compile ``fn(q, k, v, *extra)``, compare with float64 eager (output and gradients), return the record."""
    q, k, v = _qkv(requires_grad=train)
    out = _compile(fn, options)(q, k, v, *extra)
    ref_inputs = [t.detach().double().requires_grad_(train) for t in (q, k, v)]
    ref_extra = [e.double() if isinstance(e, torch.Tensor) and e.is_floating_point() else e for e in extra]
    ref = fn(*ref_inputs, *ref_extra)
    assert relative_error(out, ref) < TOL
    if train:
        out.square().sum().backward()
        ref.square().sum().backward()
        for t, r in zip((q, k, v), ref_inputs):
            assert relative_error(t.grad, r.grad) < TOL
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.matches == matches, rec.notes
    assert rec.status == (status or ("applied" if matches else "unchanged"))
    if causal is not None:
        assert rec.stats.get("causal", 0) == causal, rec.notes
    if matches:
        assert op in kpt_compiler.last_report().stages["pre_aot"].ops_after
    return rec


def _causal_tril(n=L):
    return torch.tril(torch.ones(n, n, dtype=torch.bool))


# --------------------------------------------------------------------------------------------- forms


def test_scale_on_scores_multiply():
    _check(lambda q, k, v: F.softmax((q @ k.transpose(-2, -1)) * D**-0.5, dim=-1) @ v)


def test_scale_on_scores_divide_and_method_spellings():
    _check(lambda q, k, v: torch.matmul(q, k.transpose(2, 3)).div(math.sqrt(D)).softmax(dim=-1).matmul(v))


def test_scale_on_query_before_the_product():
    _check(lambda q, k, v: torch.softmax((q * D**-0.5) @ k.transpose(-1, -2), -1) @ v)


def test_scale_on_query_and_key():
    s = D**-0.25
    _check(lambda q, k, v: torch.softmax((q * s) @ (k * s).permute(0, 1, 3, 2), dim=-1) @ v)


def test_no_scale_and_key_given_pre_transposed():
    kt_fn = lambda q, k, v: torch.softmax(q @ k, dim=-1) @ v  # noqa: E731  (k is [.., D, L] already)
    q, k, v = _qkv()
    k = k.transpose(-2, -1).contiguous()
    out = _compile(kt_fn)(q, k, v)
    assert relative_error(out, kt_fn(q.double(), k.double(), v.double())) < TOL
    assert kpt_compiler.last_report().pass_record("attention").matches == 1


def test_causal_from_a_tril_buffer_masked_fill_minus_inf():
    mask = _causal_tril()
    # the buffer is a graph input, so its triangle is not proven: an exact boolean attn_mask instead
    rec = _check(lambda q, k, v, m: F.softmax((q @ k.transpose(-2, -1) / 4.0).masked_fill(~m, float("-inf")), -1) @ v,
                 extra=(mask,), causal=0, options=REWRITE)
    assert "attn_mask drop" in rec.notes[0]


def test_causal_gpt2_style_where_with_dtype_minimum():
    mask = _causal_tril().view(1, 1, L, L)

    def gpt2(q, k, v, m):
        w = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], 4.0, dtype=q.dtype)
        w = torch.where(m, w, torch.finfo(w.dtype).min)
        return torch.matmul(F.softmax(w, dim=-1).type(v.dtype), v)

    _check(gpt2, extra=(mask,), causal=0, options=REWRITE)


def test_causal_mask_built_in_the_graph_is_proven_and_dropped():
    def f(q, k, v):
        i = torch.arange(q.shape[-2])
        keep = i[None, :] <= i[:, None]
        mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
        return F.softmax(q @ k.transpose(-2, -1) * 0.25 + mask, dim=-1) @ v

    rec = _check(f, causal=1)
    assert "causal (mask proven lower-triangular)" in rec.notes[0]


def _sliding(q, k, v, dropout=0.0):
    i = torch.arange(q.shape[-2])
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)
    p = F.softmax((q @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf")), dim=-1)
    return F.dropout(p, dropout, training=dropout > 0) @ v


def test_sliding_window_built_in_the_graph_goes_to_flex_attention():
    rec = _check(_sliding, causal=0, op="flex_sdpa")
    assert rec.stats["window"] == 1 and "FlexAttention, sliding window of 3 (mask proven)" in rec.notes[0]


def test_sliding_window_with_dropout_stays_an_exact_sdpa_mask():
    q, k, v = _qkv()
    _compile(lambda q, k, v: _sliding(q, k, v, dropout=0.2))(q, k, v)
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.matches == 1 and "sliding window of 3" in rec.notes[0] and "FlexAttention" not in rec.notes[0]
    ops = kpt_compiler.last_report().stages["pre_aot"].ops_after
    assert "scaled_dot_product_attention" in ops and "flex_sdpa" not in ops


def test_additive_padding_mask_bert_style():
    pad = torch.zeros(B, 1, 1, L)
    pad[1, ..., -3:] = torch.finfo(torch.float32).min
    _check(lambda q, k, v, m: F.softmax(q @ k.transpose(-1, -2) * 0.25 + m, dim=-1) @ v, extra=(pad,), causal=0)


def test_boolean_mask_with_where_minus_inf():
    keep = torch.rand(B, 1, L, L, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[..., 0] = True  # no fully masked row (eager gives NaN there)
    _check(lambda q, k, v, m: F.softmax(torch.where(m, q @ k.transpose(-1, -2), float("-inf")), -1) @ v, extra=(keep,),
           options=REWRITE)


def test_alibi_style_bias_is_an_exact_float_mask():
    slopes = torch.tensor([0.5, 0.25, 0.125]).view(1, H, 1, 1)
    pos = torch.arange(L)
    bias = -(slopes * (pos[None, :] - pos[:, None]).abs()).float()
    rec = _check(lambda q, k, v, b: F.softmax(q @ k.transpose(-2, -1) * 0.25 + b, dim=-1) @ v, extra=(bias,),
                 options=REWRITE)
    assert "attn_mask add" in rec.notes[0]


def _alibi_slopes(heads, dtype=torch.float32):
    return torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)], dtype=dtype)


def _alibi_causal(q, k, v):  # slope_h * (j - i) and a causal mask, both built in the graph
    L = q.shape[-2]
    pos = torch.arange(L)
    rel = (pos[None, :] - pos[:, None]).to(q.dtype)
    bias = _alibi_slopes(q.shape[1], q.dtype).view(1, -1, 1, 1) * rel
    bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return F.softmax(q @ k.transpose(-2, -1) * D**-0.5 + bias, dim=-1) @ v


def _alibi_mpt(q, k, v):  # MPT: slope_h * (j - S + 1) as [H, 1, S]; causal by masked_fill with the dtype minimum
    L = q.shape[-2]
    alibi = _alibi_slopes(q.shape[1], q.dtype).view(-1, 1, 1) * torch.arange(1 - L, 1, dtype=q.dtype).view(1, 1, L)
    s = q @ k.transpose(-2, -1) * D**-0.5 + alibi
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    s = s.masked_fill(causal, torch.finfo(s.dtype).min)
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


@pytest.mark.parametrize("form", [_alibi_causal, _alibi_mpt])
def test_alibi_built_in_the_graph_goes_to_flex_attention_as_a_score_mod(form):
    from kpt_compiler.passes.attention import BIAS_IN_FLEX

    if not BIAS_IN_FLEX:  # torch 2.9: the exact dense mask instead
        assert "attn_mask" in _check(form).notes[0]
        return
    rec = _check(form, op="flex_sdpa", causal=1)
    assert rec.stats["linear_bias"] == 1 and "position bias" in rec.notes[0] and "causal" in rec.notes[0]
    ops = kpt_compiler.last_report().stages["pre_aot"].ops_after
    assert "masked_fill" not in ops and "arange" not in ops, ops  # the bias and mask are folded away


def test_alibi_coefficients_are_the_slopes():
    from kpt_compiler.passes._attention_masks import _linear_bias

    L_ = 7
    pos = torch.arange(L_)
    slopes = _alibi_slopes(4)
    bias = slopes.view(1, 4, 1, 1) * (pos[None, :] - pos[:, None]).float()
    coef = _linear_bias(bias, torch.ones(1, 1, L_, L_, dtype=torch.bool), heads=4)
    for (a, b, c), s in zip(coef, slopes.tolist()):
        assert a == pytest.approx(s, rel=1e-6) and b == pytest.approx(-s, rel=1e-6) and abs(c) < 1e-6
    # one term that is not linear in the positions: no coefficients (the dense mask is kept)
    assert _linear_bias(-(bias.abs()), torch.ones(1, 1, L_, L_, dtype=torch.bool), heads=4) is None


def test_a_constant_bias_that_is_not_linear_stays_an_exact_dense_mask():
    def symmetric(q, k, v):
        pos = torch.arange(q.shape[-2])
        bias = -(_alibi_slopes(q.shape[1]).view(1, -1, 1, 1) * (pos[None, :] - pos[:, None]).abs().float())
        return F.softmax(q @ k.transpose(-2, -1) * 0.25 + bias, dim=-1) @ v

    rec = _check(symmetric)
    assert rec.stats.get("linear_bias", 0) == 0 and "attn_mask add" in rec.notes[0]


def test_softmax_upcast_to_float32_and_back():
    def llama(q, k, v):
        w = torch.matmul(q, k.transpose(2, 3)) * 0.25
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)

    _check(llama)
    _check(lambda q, k, v: F.softmax((q @ k.transpose(-2, -1)).float(), -1).type(v.dtype) @ v)


def test_grouped_query_attention_repeat_kv():
    def repeat_kv(x, n):
        b, h, s, d = x.shape
        return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    def gqa(q, k, v):
        k, v = repeat_kv(k, 3), repeat_kv(v, 3)
        return F.softmax(q @ k.transpose(2, 3) * 0.25, dim=-1) @ v

    q, _, _ = _qkv(requires_grad=True)
    k = torch.randn(B, 1, L, D, requires_grad=True)
    v = torch.randn(B, 1, L, D, requires_grad=True)
    out = _compile(gqa)(q, k, v)
    ref = gqa(q.double(), k.double(), v.double())
    assert relative_error(out, ref) < TOL
    out.sum().backward()
    assert k.grad is not None and kpt_compiler.last_report().pass_record("attention").matches == 1


def test_dropout_in_eval_and_in_training():
    def f(q, k, v, training):
        return F.dropout(F.softmax(q @ k.transpose(-2, -1) * 0.25, -1), p=0.3, training=training) @ v

    rec = _check(lambda q, k, v: f(q, k, v, False), train=False)
    assert "dropout 0" in rec.notes[0]
    torch._dynamo.reset()
    q, k, v = _qkv(requires_grad=True)
    torch.manual_seed(0)
    _compile(lambda q, k, v: f(q, k, v, True))(q, k, v).sum().backward()
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.matches == 1 and "dropout 0.3" in rec.notes[0]  # same probability, SDPA's own random stream


def test_several_attentions_in_one_graph():
    def two(q, k, v):
        a = F.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v
        return F.softmax(a @ k.transpose(-2, -1) * 0.25, -1) @ v

    _check(two, matches=2)


# --------------------------------------------------------------------------------------------- near misses


def _near_miss(fn, reason, extra=(), dtype=torch.float32):
    q, k, v = (t.to(dtype) for t in _qkv())
    out = _compile(fn)(q, k, v, *extra)
    torch.testing.assert_close(first_tensor(out), first_tensor(fn(q, k, v, *extra)), rtol=1e-5, atol=1e-6)
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.matches == 0 and rec.status == "unchanged"
    assert rec.stats["near_misses"] >= 1 and any(reason in n for n in rec.notes), rec.notes
    assert "scaled_dot_product_attention" not in kpt_compiler.last_report().stages["pre_aot"].ops_after


def test_attention_weights_returned_are_left_alone():
    def f(q, k, v):
        w = F.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
        return w @ v, w

    _near_miss(f, "attention probabilities are also used elsewhere")


def test_scores_used_elsewhere_are_left_alone():
    def f(q, k, v):
        s = q @ k.transpose(-2, -1) * 0.25
        return F.softmax(s, -1) @ v + s.mean()

    _near_miss(f, "scores are also used elsewhere")


def _gemma(q, k, v, causal=True, dropout=0.0):
    """Gemma-2's eager attention: scale, soft-cap, causal mask from arange, float32 softmax."""
    s = torch.matmul(q, k.transpose(2, 3)) * D**-0.5
    s = s / 30.0
    s = torch.tanh(s)
    s = s * 30.0
    if causal:
        i = torch.arange(q.shape[-2])
        mask = torch.zeros(q.shape[-2], q.shape[-2], dtype=q.dtype).masked_fill(i[None, :] > i[:, None], -math.inf)
        s = s + mask
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return F.dropout(p, p=dropout, training=dropout > 0) @ v


@pytest.mark.parametrize("causal", [True, False])
def test_soft_capping_goes_to_flex_attention(causal):
    rec = _check(lambda q, k, v: _gemma(q, k, v, causal), causal=int(causal), op="flex_sdpa")
    assert "FlexAttention, soft-cap 30" in rec.notes[0]
    ops = kpt_compiler.last_report().stages["pre_aot"].ops_after
    assert "flex_sdpa" in ops and "tanh" not in ops


def test_soft_capping_with_an_unproven_mask_or_dropout_stays():
    pad = torch.zeros(B, 1, 1, L)
    pad[1, ..., -2:] = -1e4

    def padded(q, k, v, m):
        s = torch.tanh(q @ k.transpose(-2, -1) * 0.25 / 30.0) * 30.0 + m
        return F.softmax(s, -1) @ v

    _near_miss(padded, "not provably causal or a sliding window", extra=(pad,))
    torch._dynamo.reset()
    q, k, v = _qkv()
    _compile(lambda q, k, v: _gemma(q, k, v, dropout=0.1))(q, k, v)  # random: only the record is checked
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.matches == 0 and any("with dropout" in n for n in rec.notes), rec.notes


def test_scale_known_only_at_run_time():
    def f(q, k, v, s):
        return F.softmax(q @ k.transpose(-2, -1) * s, -1) @ v

    q, k, v = _qkv()
    s = torch.tensor(0.25)
    out = _compile(f)(q, k, v, s)
    torch.testing.assert_close(out, f(q, k, v, s))
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.matches == 0 and "known only at run time" in rec.notes[0]


def test_mask_in_a_wider_dtype_would_change_precision():
    mask = torch.zeros(1, 1, L, L)  # float32 mask on bfloat16 scores: eager computes the softmax in float32
    _near_miss(lambda q, k, v, m: F.softmax(q @ k.transpose(-2, -1) + m, -1).to(q.dtype) @ v,
               "changes their precision", extra=(mask,), dtype=torch.bfloat16)


def test_mask_in_a_narrower_dtype_is_cast_exactly():
    mask = torch.zeros(1, 1, L, L, dtype=torch.bfloat16)
    mask[..., -2:] = -1e4
    _check(lambda q, k, v, m: F.softmax(q @ k.transpose(-2, -1) + m, -1) @ v, extra=(mask,), options=REWRITE)


# --------------------------------------------------------------------------------------------- options, models


def test_switched_off_and_min_seq_len():
    f = lambda q, k, v: F.softmax(q @ k.transpose(-2, -1), -1) @ v  # noqa: E731
    _check(f, matches=0, options={"attention": False}, status="disabled")
    torch._dynamo.reset()
    q, k, v = _qkv()
    _compile(f, {"attention": {"min_seq_len": L + 1}})(q, k, v)
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.matches == 0 and "min_seq_len" in rec.notes[0]


def test_backend_option_is_validated():
    with pytest.raises(kpt_compiler.OptionError, match="'backend' in options\\['attention'\\] must be 'auto' or"):
        kpt_compiler.parse_options(None, {"attention": {"backend": "fastest"}})


def test_project_gpt_training_matches_eager():
    from kpt_compiler.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=97))
    ref_model = copy.deepcopy(model).double()
    idx = torch.randint(0, 97, (2, 17))
    out = _compile(model)(idx)
    ref = ref_model(idx)
    assert relative_error(out, ref) < TOL
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), (_, pr) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert relative_error(p.grad, pr.grad) < 1e-4, name
    assert kpt_compiler.last_report().pass_record("attention").matches == 2


HF_MODELS = {
    "gpt2": dict(n_layer=2),
    "llama": dict(n_layer=2, hidden=128, heads=4, kv_heads=2),
    "bert": dict(n_layer=2),
}


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_transformers_eager_attention(name):
    pytest.importorskip("transformers")
    from kpt_compiler.models.zoo import build

    torch.manual_seed(0)
    model, make_inputs = build(name, attn="eager", **HF_MODELS[name])
    model.train()  # gradients too; dropout off so eager and SDPA draw no random numbers
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    if hasattr(model.config, "attention_dropout"):
        model.config.attention_dropout = 0.0
    ref_model = copy.deepcopy(model).double()
    (ids,) = make_inputs(2, 12, "cpu")
    out = first_tensor(_compile(model)(ids))
    ref = first_tensor(ref_model(ids))
    assert relative_error(out, ref) < TOL
    out.square().mean().backward()
    ref.square().mean().backward()
    grads = [(p.grad, pr.grad) for p, pr in zip(model.parameters(), ref_model.parameters()) if pr.grad is not None]
    scale = max(pr.norm().item() for _, pr in grads)
    for g, gr in grads:
        assert (g.double() - gr).norm().item() <= 1e-4 * gr.norm().item() + 1e-6 * scale
    rec = kpt_compiler.last_report().pass_record("attention")
    assert rec.matches == 2
    # transformers builds its causal mask from arange in the graph: proven, so the kernels skip the upper half
    assert rec.stats.get("causal", 0) == (0 if name == "bert" else 2)


def test_transformers_mpt_alibi_goes_to_flex_attention():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "MptConfig"):
        pytest.skip("this transformers has no MPT")
    torch.manual_seed(0)
    cfg = transformers.MptConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=32, vocab_size=100)
    model = transformers.MptForCausalLM(cfg).train()  # MPT's attention dropout is 0 by default
    ref_model = copy.deepcopy(model).double()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    out = _compile(model)(ids).logits
    ref = ref_model(ids).logits
    assert relative_error(out, ref) < TOL
    out.square().mean().backward()
    ref.square().mean().backward()
    for p, pr in zip(model.parameters(), ref_model.parameters()):
        assert relative_error(p.grad, pr.grad) < 1e-4
    rec = kpt_compiler.last_report().pass_record("attention")
    from kpt_compiler.passes.attention import BIAS_IN_FLEX

    if not BIAS_IN_FLEX:  # torch 2.9: the exact dense mask instead
        assert rec.matches == 2, rec.notes
        return
    # MPT builds slope_h * (j - S + 1) from arange and masks the upper triangle: both folded into FlexAttention
    assert rec.matches == 2 and rec.stats.get("linear_bias") == 2 and rec.stats.get("causal") == 2, rec.notes


def test_linear_bias_fit_survives_bfloat16_rounding_at_long_sequences():
    """At 4096 positions bfloat16 rounds ALiBi's far entries by up to 8: an unweighted least-squares fit was
    pulled off by them and refused the bias (the bench's 8x16x4096x128 case fell back to a dense mask)."""
    from kpt_compiler.passes._attention_masks import _linear_bias

    L, slopes = 4096, torch.tensor([2 ** -0.5, 2 ** -1.5])
    i = torch.arange(L)
    bias = (slopes.view(-1, 1, 1) * (i[None, :] - i[:, None])).to(torch.bfloat16)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    fit = _linear_bias(bias, causal, heads=2)
    assert fit is not None
    for (a, b, c), slope in zip(fit, slopes.tolist()):
        assert abs(a - slope) < 1e-4 * slope and abs(b + slope) < 1e-4 * slope and abs(c) < 1e-2
    off = bias.clone()
    off[1, 3000, 10] += 64  # far beyond bfloat16's rounding of that entry (about 1000, rounded by 4)
    assert _linear_bias(off, causal, heads=2) is None
    off = bias.clone()
    off[0, 0, 1] = 5.0  # above the diagonal: masked, so it does not matter
    assert _linear_bias(off, causal, heads=2) is not None


def test_dropout_reaches_the_kernel():
    """The note says "dropout 0.3"; the op must do it too: SDPA is called with dropout_p=0.3, so two calls draw
    different masks, and about 30% of the probabilities are dropped (the mean of the output over many
    draws, against eager's own dropout, is what a forced dropout_p=0 would get wrong)."""
    def f(q, k, v):
        return F.dropout(F.softmax(q @ k.transpose(-2, -1) * 0.25, -1), p=0.3, training=True) @ v

    q, k, v = _qkv()
    compiled = _compile(f)
    a, b = compiled(q, k, v), compiled(q, k, v)
    assert not torch.equal(a, b)  # dropout draws anew on each call
    assert "dropout_p = 0.3" in kpt_compiler.last_report().pass_record("attention").diff
    # with dropout_p=1 - 1e-6 nearly everything is dropped; with a p ignored nothing would be
    g = lambda q, k, v: F.dropout(F.softmax(q @ k.transpose(-2, -1) * 0.25, -1), p=0.999, training=True) @ v  # noqa
    torch._dynamo.reset()
    torch.manual_seed(0)
    dropped = _compile(g)(q, k, v)
    assert kpt_compiler.last_report().pass_record("attention").matches == 1
    assert (dropped == 0).float().mean() > 0.5, (dropped == 0).float().mean()


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient", "math"])
def test_the_sdpa_backend_option_sets_the_priority_the_trace_runs_under(backend):
    """options={"attention": {"backend": ...}}: while AOTAutograd traces the rewritten graph, that SDPA backend
    comes first and the others follow (read inside the trace by a joint-stage test pass; on the CPU the
    dispatcher then picks what runs, on the GPU tests/gpu checks the kernel)."""
    from torch.nn.attention import SDPBackend

    from kpt_test_passes import SDP_PRIORITY

    names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    expected = [int(names[backend])] + [int(b) for n, b in names.items() if n != backend]
    q, k, v = _qkv()
    f = lambda q, k, v: F.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v  # noqa: E731
    _compile(f, {"attention": {"backend": backend}, "test_record_sdp_priority": True})(q, k, v)
    assert SDP_PRIORITY and SDP_PRIORITY[-1][:4] == expected, (SDP_PRIORITY[-1], expected)
    note = next(n for n in kpt_compiler.last_report().pass_record("attention").notes if "SDPA backends" in n)
    assert note.split(": ")[1].startswith(names[backend].name.lower())


def test_auto_puts_flash_first_and_cudnn_last_for_attention_of_dynamic_sizes_on_hopper():
    """cuDNN's SDPA builds an execution plan on the host per distinct problem (batch, lengths): attention of
    dynamic sizes meets a new one at nearly every call, so "auto" orders flash, memory-efficient, math, cuDNN
    there; attention of fixed sizes keeps cuDNN first, also in a graph dynamic only elsewhere; a backend the
    user names goes first in all."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend

    from kpt_compiler import graph_utils
    from kpt_compiler.passes.attention import AttentionOptions, _backend_order
    from kpt_compiler.target import Target

    graphs = []

    def grab(gm, inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, b):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True) * b.sum()

    q, b = torch.randn(2, 4, 16, 8), torch.randn(5)
    torch.compile(f, backend=grab)(q, b)
    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(b, 0)  # dynamic elsewhere: the attention's sizes stay fixed
    torch.compile(f, backend=grab)(q, b)
    torch._dynamo.reset()
    dynamic = torch.randn(2, 4, 24, 8)
    torch._dynamo.mark_dynamic(dynamic, 2)
    torch.compile(f, backend=grab)(dynamic, torch.randn(5))
    static, elsewhere, dyn = graphs
    assert graph_utils.has_dynamic_sizes(elsewhere)  # the graph is dynamic, its attention is not
    h100 = Target("cuda", "NVIDIA H100 80GB HBM3", capability=(9, 0))
    ctx = SimpleNamespace(options=AttentionOptions(), target=h100)
    assert _backend_order(ctx, static)[0] == SDPBackend.CUDNN_ATTENTION
    assert _backend_order(ctx, elsewhere)[0] == SDPBackend.CUDNN_ATTENTION
    assert _backend_order(ctx, dyn) == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                                        SDPBackend.CUDNN_ATTENTION]
    ctx.options = AttentionOptions(backend="cudnn")
    assert _backend_order(ctx, dyn)[0] == SDPBackend.CUDNN_ATTENTION
    ctx = SimpleNamespace(options=AttentionOptions(), target=Target("cuda", "NVIDIA A100", capability=(8, 0)))
    assert _backend_order(ctx, dyn) is None  # torch's own order


def test_a_mask_that_cannot_be_computed_at_compile_time_says_why(monkeypatch):
    """A mask that depends on no input is computed at compile time to prove it causal; where that fails, the
    rewrite keeps it as a dense mask and the report says why (it used to be a silent "not proven")."""
    from kpt_compiler import torch_ir

    def failing(gm, node, max_elements=1 << 26, why=None, known=None):
        why.append("RuntimeError: planted by the test")
        return None

    monkeypatch.setattr(torch_ir, "evaluate", failing)
    q, k, v = _qkv()

    def causal(q, k, v):
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        return F.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~mask, float("-inf")), -1) @ v

    out = _compile(causal)(q, k, v)
    torch.testing.assert_close(out, causal(q, k, v))
    rec = kpt_compiler.last_report().pass_record("attention")
    assert any("could not be computed at compile time" in n and "planted by the test" in n for n in rec.notes), rec.notes


def test_evaluate_says_why_it_could_not():
    from kpt_compiler import torch_ir

    def boom(x):
        raise RuntimeError("no kernel for this")

    gm = torch.fx.symbolic_trace(lambda: torch.ones(3))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        node = gm.graph.call_function(boom, (out.args[0],))
    node.meta["example_value"] = torch.empty(3)
    why = []
    assert torch_ir.evaluate(gm, node, why=why) is None and why == ["RuntimeError: no kernel for this"]


def test_the_report_warns_of_query_rows_hidden_whole_only_where_a_row_may_be():
    """Where a dense mask hides a query row whole, the fused kernels and eager's softmax give that row different
    values (session 24): said once per graph where the mask comes from an input or hides a row, not where a mask
    computed at compile time leaves every row a key."""
    from kpt_compiler.passes.attention import HIDDEN_ROWS

    pad = torch.zeros(B, 1, 1, L)
    pad[1, ..., -3:] = torch.finfo(torch.float32).min
    rec = _check(lambda q, k, v, m: F.softmax(q @ k.transpose(-1, -2) * 0.25 + m, dim=-1) @ v, extra=(pad,))
    assert rec.notes.count(HIDDEN_ROWS) == 1, rec.notes

    def upper(q, k, v):  # every row keeps its diagonal: not causal, a dense mask, no row hidden
        keep = torch.ones(L, L, dtype=torch.bool).triu()
        return F.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf")), -1) @ v

    rec = _check(upper, causal=0)
    assert "attn_mask" in rec.notes[0] and HIDDEN_ROWS not in rec.notes, rec.notes

    def first_row_hidden(q, k, v):
        m = torch.zeros(L, L)
        m[0] = torch.finfo(torch.float32).min
        return F.softmax(q @ k.transpose(-2, -1) * 0.25 + m, -1) @ v

    rec = _check(first_row_hidden, causal=0, train=False)  # the CPU's fused backward differs on that row
    assert rec.notes.count(HIDDEN_ROWS) == 1, rec.notes


def test_a_caller_mask_that_may_hide_rows_is_left_alone_in_training_and_rewritten_in_inference():
    """Left padding under a causal mask (transformers' eager style, the dtype's lowest) hides every row before the
    first real token. The fused kernels' gradients differ from eager's through those rows, and a causal LM's
    shifted loss reads the last of them (the review of 2026-12-04): in a graph that computes gradients the
    attention stays eager's, unless hidden_rows='rewrite'; without gradients it is rewritten."""
    keep = torch.tril(torch.ones(L, L, dtype=torch.bool)).expand(B, 1, L, L).clone()
    keep[1, ..., :3] = False  # the second sequence's first three tokens are padding
    mask = torch.zeros(B, 1, L, L).masked_fill(~keep, torch.finfo(torch.float32).min)

    def attn(q, k, v, m):
        return F.softmax(q @ k.transpose(-2, -1) * 0.25 + m, dim=-1) @ v

    rec = _check(attn, extra=(mask,), matches=0)  # the loss reads every row: gradients as eager's
    assert any("computes gradients" in n and "hidden_rows='rewrite'" in n for n in rec.notes), rec.notes
    rec = _check(attn, extra=(mask,), train=False)
    assert rec.matches == 1
    q, k, v = _qkv(requires_grad=True)
    _compile(attn, REWRITE)(q, k, v, mask).sum().backward()
    assert kpt_compiler.last_report().pass_record("attention").matches == 1
