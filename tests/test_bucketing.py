"""The bucketing pass on the CPU (codegen eager): each rule of the padding proof on a model that needs it, with
the outputs equal to eager on the real part at sizes that are padded; each refusal with its reason; the ladder,
the guards, the options. The CUDA graphs per bucket run on the GPU (tests/gpu/test_cudagraphs_gpu.py)."""

import math
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kpt_compiler
from kpt_compiler import OptionError
from kpt_compiler.passes import _bucket_plan as bucket_plan
from kpt_compiler.passes import bucketing as bk

SIZES = [(3, 5), (2, 7), (5, 9), (3, 12), (4, 16)]  # (batch, sequence): padded to 4x8, 2x8, 8x16, 4x16, 4x16


def _run(model, make, sizes=SIZES, dims=(0, 1), options=None, training=False, logits=False):
    """Compile with bucketing (dims marked dynamic so the first graph is the dynamic one); return the bucketing
    pass's record of the dynamic graph and the largest difference from eager over the calls."""
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    fn = torch.compile(model, backend="kernelpytorch",
                       options={"codegen": "eager", "bucketing": {"pad": "always", **(options or {})},
                                "fusion": False})
    worst = 0.0
    with torch.set_grad_enabled(training):
        for b, s in sizes:
            args = make(b, s)
            for a in args:
                for d in dims:
                    if isinstance(a, torch.Tensor) and a.dim() > d:
                        torch._dynamo.mark_dynamic(a, d)
            got, want = fn(*args), model(*args)
            if logits:  # a transformers output
                got, want = got.logits, want.logits
            assert got.shape == want.shape
            diff = (got - want).detach().abs()
            same = (got == want) | torch.isnan(got) & torch.isnan(want)  # infinities and NaNs as eager has them
            diff = torch.where(same, 0.0, diff.nan_to_num(nan=math.inf))
            worst = max(worst, float(diff.max()))  # NaN where eager has none counts as infinitely wrong
    records = [p for r in kpt_compiler.reports() for p in r.passes() if p.name == "bucketing"
               and not any("no padding proof of its own" in n for n in p.notes)]  # not a graph the dynamic one serves
    return records[-1], worst


def _padded(rec) -> list[str]:
    return [n for n in rec.notes if "first call in bucket" in n]


class Rows(nn.Module):  # rows: pointwise, linear, layer norm, views that split and merge dims
    def __init__(self, d=16):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.down(F.gelu(self.up(self.norm(x))))
        b, s, d = h.shape
        return h.reshape(b * s, 2, d // 2).softmax(-1).reshape(b, s, d)


def _x(b, s):
    return (torch.randn(b, s, 16),)


def test_rows_are_padded_on_both_dims_and_the_real_part_is_eager():
    rec, err = _run(Rows().eval(), _x)
    assert rec.status == "applied" and rec.stats["padded_dims"] == 2
    assert len(_padded(rec)) == 4  # (4, 8), (2, 8), (8, 16), (4, 16): the last size is a bucket already
    assert err < 1e-5


class CausalSdpa(nn.Module):
    def __init__(self, d=16, causal=True):
        super().__init__()
        self.qkv, self.causal = nn.Linear(d, 3 * d), causal

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).transpose(1, 2).reshape(b, s, 16)


def test_causal_attention_pads_the_sequence():
    rec, err = _run(CausalSdpa().eval(), _x)
    assert rec.status == "applied" and rec.stats["padded_dims"] == 2 and err < 1e-5


class ArangeMask(nn.Module):  # the textbook chain with a mask built from positions
    def forward(self, x):
        s = x.shape[1]
        i = torch.arange(s)
        scores = (x @ x.transpose(1, 2)).masked_fill(i[None, :, None] < i[None, None, :], float("-inf"))
        return scores.softmax(-1) @ x


def test_a_mask_built_from_arange_comparisons_is_causal():
    rec, err = _run(ArangeMask(), _x)
    assert rec.status == "applied" and rec.stats["padded_dims"] == 2 and err < 1e-5


def test_a_lower_triangular_buffer_sliced_to_the_length_is_causal():
    from kpt_compiler.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    rec, err = _run(model, lambda b, s: (torch.randint(0, 64, (b, s)),))
    assert rec.status == "applied" and rec.stats["padded_dims"] == 2 and err < 1e-5


class KeyMask(nn.Module):  # bidirectional attention with a key-padding mask given as an input
    def forward(self, x, mask):
        q = x.unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask[:, None, None, :]).squeeze(1)


def test_an_input_mask_padded_with_zeros_hides_the_padded_keys():
    def make(b, s):
        mask = torch.ones(b, s, dtype=torch.bool)
        mask[0, s // 2:] = False
        return torch.randn(b, s, 16), mask

    rec, err = _run(KeyMask(), make)
    assert rec.status == "applied" and rec.stats["padded_dims"] == 2 and err < 1e-5


class LowestMask(nn.Module):  # transformers' eager form: positions compared, made additive with the lowest value
    def __init__(self, keep=lambda q, k: k <= q):
        super().__init__()
        self.keep = keep

    def forward(self, x):
        i = torch.arange(x.shape[1])
        # a tensor 0.0, as transformers writes it on CUDA: a constant of the trace, read by its value
        mask = torch.where(self.keep(i[None, :, None], i[None, None, :]), torch.tensor(0.0), torch.finfo(x.dtype).min)
        return ((x @ x.transpose(1, 2)) / 4 + mask).softmax(-1) @ x


class PackedMask(nn.Module):  # transformers' packed-sequence part: one index read at the query's and the key's place
    def __init__(self, shift=0):
        super().__init__()
        self.shift = shift  # 1: the keys read another tensor (seq + 1), which no query's own index equals

    def forward(self, x):
        b, s, _ = x.shape
        pos = torch.arange(s).expand(b, s)
        seq = (torch.diff(torch.cat([pos[:, :1] - 1, pos], -1), dim=-1) != 1).cumsum(-1)
        rows = torch.arange(b)[:, None, None]
        keys = seq + self.shift if self.shift else seq
        same = seq[rows, torch.arange(s)[None, :, None]] == keys[rows, torch.arange(s)[None, None, :]]
        causal = torch.arange(s)[None, None, :] <= torch.arange(s)[None, :, None]
        mask = torch.where(same & causal, 0.0, torch.finfo(x.dtype).min)
        return ((x @ x.transpose(1, 2)) / 4 + mask).softmax(-1) @ x


@pytest.mark.parametrize("model", [LowestMask, PackedMask], ids=["causal", "packed"])
def test_a_lowest_value_mask_hides_padded_keys_where_each_real_row_sees_its_own_key(model):
    rec, err = _run(model(), _x)
    assert rec.stats["padded_dims"] == 2 and err < 1e-5, rec.notes


@pytest.mark.parametrize("keep", [
    lambda q, k: k < q,  # the first row sees no key: unpadded it averages its keys, padded the padded ones too
    lambda q, k: (k <= q) & (q > 2),  # the first three rows see nothing
    lambda q, k: k <= q - 1,
    lambda: PackedMask(shift=1),  # every row fully masked
], ids=["strict", "rows-masked", "shifted", "other-source"])
def test_a_lowest_value_mask_without_a_visible_diagonal_keeps_the_sequence(keep):
    rec, err = _run(keep() if keep.__code__.co_argcount == 0 else LowestMask(keep), _x, sizes=[(3, 5), (5, 6), (2, 3)])
    assert err < 1e-4 and rec.stats.get("padded_dims", 0) < 2, rec.notes
    assert "dim 1" in rec.notes[0] and "softmax over dim 2" in rec.notes[0], rec.notes


def _causal_lowest(x, value=torch.finfo(torch.float32).min):
    i = torch.arange(x.shape[1])
    return torch.where(i[None, :] <= i[:, None], 0.0, value)


@pytest.mark.parametrize("model", [  # a review's attacks on the finite-mask rule (2026-11-27), each once proven
    lambda x: ((x @ x.transpose(1, 2)) + _causal_lowest(x, -65504.0)).softmax(-1) @ x,  # fp16's lowest: too near
    lambda x: (x @ x.transpose(1, 2) + _causal_lowest(x) + torch.where(_causal_lowest(x) == 0, 0.0, 3e38)
               ).softmax(-1) @ x,  # a huge partner undoes the mask
    lambda x: ((x @ x.transpose(1, 2) * 0.01 + _causal_lowest(x)).to(torch.int8).float()).softmax(-1) @ x,  # wraps
    lambda x: ((x @ (x + 1e38 * (x == 0)).transpose(1, 2)) + _causal_lowest(x)).softmax(-1) @ x,  # huge padded keys
    lambda x: (_causal_lowest(x) @ _causal_lowest(x) * 1e-4 + _causal_lowest(x)).softmax(-1) @ x,  # masks' product
], ids=["fp16-lowest", "huge-partner", "int8", "huge-keys", "mask-product"])
def test_finite_masks_that_need_not_hide_keep_the_sequence(model):
    rec, err = _run(model, _x, sizes=[(3, 5), (5, 6), (2, 3)])
    assert err < 1e-4, err  # NaN fails too
    assert rec.stats.get("padded_dims", 0) < 2, rec.notes


def test_transformers_eager_attention_pads_both_dims():
    pytest.importorskip("transformers")
    from kpt_compiler.models import zoo

    for name in ("gpt2", "llama"):
        torch.manual_seed(0)
        model, make = zoo.build(name, attn="eager", n_layer=1)
        rec, err = _run(model.eval(), lambda b, s: make(b, s, "cpu"), dims=(0, 1), logits=True)
        assert rec.stats["padded_dims"] == 2 and err < 1e-4, (name, rec.notes)


class Prefix(nn.Module):
    def forward(self, x):
        return x.cumsum(1) * 2


def test_a_cumulative_sum_along_the_sequence_is_a_prefix():
    rec, err = _run(Prefix(), _x)
    assert rec.status == "applied" and rec.stats["padded_dims"] == 2 and err < 1e-5


class FirstToken(nn.Module):
    def forward(self, x):
        return x[:, 0] + x[:, 1:3].sum(1)


def test_reading_constant_positions_is_real():
    rec, err = _run(FirstToken(), _x, sizes=[(3, 5), (5, 6), (2, 3)])
    assert rec.status == "applied" and rec.stats["padded_dims"] == 2 and err < 1e-5


@pytest.mark.parametrize("model, refused", [
    (lambda x: x.mean(1), "reduces (mean) over dim 1"),
    (lambda x: (x + 1).sum(1), "reduces (sum) over dim 1"),  # zeros no more: a sum of x alone would be proven
    (lambda x: x[:, -1] * 2, "moves once padded"),
    (CausalSdpa(causal=False).eval(), "attention over padded keys"),
    (lambda x: x * x.shape[1], "computed from the padded size"),
    (lambda x: x.softmax(1), "softmax over dim 1"),
    (lambda x: x @ (x + 1).transpose(1, 2) @ (x + 1), "sums over a padded dim"),
])
def test_a_sequence_it_cannot_prove_is_refused_with_the_reason_and_the_batch_still_padded(model, refused):
    rec, err = _run(model, _x)
    assert rec.status == "applied" and rec.stats["padded_dims"] == 1, rec.notes
    assert refused in rec.notes[0] and "dim 1" in rec.notes[0], rec.notes[0]
    assert err < 1e-5


@pytest.mark.parametrize("model, refused", [
    (lambda x: x.sum(), "reduces (sum) over several padded dims"),
    (lambda x: x.flip(1), "no rule for this op"),  # an op the proof does not know: every padded dim it meets
])
def test_nothing_provable_leaves_the_graph_alone(model, refused):
    # (a sum over dim 1 alone would be proven: the padding is zeros)
    rec, err = _run(model, _x)
    assert rec.status == "unchanged" and "cannot prove" in rec.notes[0] and refused in rec.notes[0]
    assert err < 1e-4


def test_a_graph_of_one_shape_and_a_training_graph_are_not_padded():
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    fn = torch.compile(Rows(), backend="kernelpytorch", options={"codegen": "eager", "bucketing": True})
    with torch.no_grad():
        fn(torch.randn(2, 3, 16))
    assert "no input size varies" in kpt_compiler.last_report().pass_record("bucketing").notes[0]
    rec, _ = _run(Rows(), _x, training=True)
    assert rec.status == "unchanged" and "training graph" in rec.notes[0]


def test_by_default_only_calls_a_cuda_graph_replays_are_padded(monkeypatch):
    # on the CPU no CUDA graph holds a bucket: every call runs at its own sizes through the dynamic code
    pads = []
    monkeypatch.setattr(bucket_plan, "F", types.SimpleNamespace(pad=lambda t, p: pads.append(p) or F.pad(t, p)))
    rec, err = _run(Rows().eval(), _x, options={"pad": "captured"})
    assert rec.status == "applied" and "where a CUDA graph replays" in rec.notes[0], rec.notes
    assert not _padded(rec) and not pads and err < 1e-5
    _run(Rows().eval(), _x)  # the tests' pad="always": the same spy sees the padding
    assert pads
    with pytest.raises(OptionError, match="'pad' in options\\['bucketing'\\] must be 'captured' or 'always'"):
        torch.compile(Rows(), backend="kernelpytorch", options={"bucketing": {"pad": "never"}})(torch.randn(2, 3, 16))


def test_writing_into_a_padded_input_is_refused():
    def inplace(x):
        x.add_(1)
        return x * 2

    rec, _ = _run(inplace, _x)
    assert rec.status == "unchanged"
    assert "writes into the padded input" in rec.notes[0] or "writes into a padded input" in rec.notes[0]


def test_dims_option_limits_the_padding_and_buckets_set_the_ladder():
    rec, err = _run(Rows().eval(), _x, options={"dims": [1], "buckets": [8, 12]})
    assert rec.stats["padded_dims"] == 1 and err < 1e-5
    sizes = [n.split("bucket ")[1] for n in _padded(rec)]
    assert sizes == [f"{s}=8" for s in _syms(sizes)][:1] + sizes[1:]  # the first at 8
    assert any(n.endswith("=12") for n in sizes) and not any("=16" in n for n in sizes)  # 16 is past the ladder


def _syms(sizes):
    return [s.split("=")[0] for s in sizes]


def test_the_ladder():
    plan = bk.Plan(symbols=(), sources={}, tensors=[], sym_args=[], outputs=[], buckets=None)
    assert [plan.bucket(n) for n in (1, 2, 3, 5, 8, 9, 1000)] == [1, 2, 4, 8, 8, 16, 1024]
    plan.buckets = (4, 12)
    assert [plan.bucket(n) for n in (1, 4, 5, 12, 13)] == [4, 4, 12, 12, 13]  # past the last: unpadded


class Table(nn.Module):  # a position table of 10
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(10, 16))

    def forward(self, x):
        if x.shape[1] <= 10:  # Dynamo guards the length at 10 or less
            return x + self.pos[: x.shape[1]].expand(x.shape[0], -1, -1)
        return x


def test_a_bucket_that_breaks_a_guard_runs_unpadded():
    rec, err = _run(Table().eval(), _x, sizes=[(2, 3), (3, 9), (2, 10)])
    assert err < 1e-5
    assert any("breaks a guard" in n for n in rec.notes), rec.notes


def test_bad_options_name_what_is_wrong():
    with pytest.raises(OptionError, match="ascending"):
        torch.compile(Rows(), backend="kernelpytorch", options={"bucketing": {"buckets": [8, 4]}})(
            torch.randn(2, 3, 16))
    with pytest.raises(OptionError, match="bucket"):
        torch.compile(Rows(), backend="kernelpytorch", options={"bucketing": {"ladder": "fit"}})(
            torch.randn(2, 3, 16))


def test_a_graph_of_one_shape_compiles_at_its_second_call_and_runs_eagerly_before():
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    model = Rows().eval()
    fn = torch.compile(model, backend="kernelpytorch", options={"codegen": "eager", "bucketing": True})
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        first = fn(x)
        report = kpt_compiler.last_report()
        assert report.notes == ["compile deferred to call 2: the graph runs eagerly until then"]
        assert "joint" not in report.stages  # not compiled yet: no AOTAutograd stage ran
        second = fn(x)
        torch.testing.assert_close(first, model(x))
        torch.testing.assert_close(second, model(x))
    assert report.notes[-1].startswith("compiled at call 2") and "joint" in report.stages
    torch._dynamo.reset()
    fn = torch.compile(model, backend="kernelpytorch",
                       options={"codegen": "eager", "bucketing": {"compile_static_after": 1}})
    with torch.no_grad():
        fn(x)
    assert "joint" in kpt_compiler.last_report().stages


@pytest.mark.parametrize("options", [{}, {"bucketing": True}])
def test_a_dynamic_graph_stays_dynamic_through_the_passes(options):
    # a pass that reads a dynamic size as an int (a fake computation outside the Python dispatcher, a cost
    # decision) specializes the graph: mark_dynamic then raises, and unmarked sizes recompile at every call
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fn = torch.compile(ArangeMask(), backend="kernelpytorch", options={"codegen": "eager", **options})
    with torch.no_grad():
        for b, s in [(3, 5), (4, 9), (2, 7), (5, 12)]:
            x = torch.randn(b, s, 16)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(fn(x), ArangeMask()(x))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert kpt_compiler.last_report().pass_record("attention").status == "applied"


@pytest.mark.parametrize("model", [
    lambda x: torch.softmax(x, -1).sum(1),  # a softmax's rows are not zeros where the input's were
    lambda x: F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], attn_mask=x[:, None, :1, :1] * 0),
    lambda x: x.transpose(1, 2).reshape(x.shape[0], -1) * 2,  # a merge with the padded factor inside
    lambda x: x.sum(-1) / math.sqrt(x.shape[1]),  # a float computed from the padded size
    lambda x: torch.log(x.abs() + 1).argmax(),  # a flat index
    lambda x: (torch.softmax(x, 1) * torch.reciprocal(x * 0)).sum(1),  # 0 * inf where the padding is
    lambda x: torch.softmax(x + torch.where(x > 10, 0.0, torch.finfo(x.dtype).min), 1),  # lowest, not -inf
    lambda x: (((x > 0).to(torch.uint8) - 1).float() + 1).sum(1),  # 0 - 1 wraps to 255 in uint8
])
def test_what_padding_would_change_is_refused(model):  # cases a review found proven before (2026-11-26)
    rec, err = _run(model, _x, sizes=[(3, 5), (5, 6), (2, 3)])
    assert err < 1e-4, err  # NaN fails too
    assert rec.stats.get("padded_dims", 0) < 2, rec.notes
    assert "dim 1" in rec.notes[0] and ("cannot prove" in rec.notes[0] or "not padded" in rec.notes[0]), rec.notes


class RmsCausal(nn.Module):  # Llama's norm: rsqrt(mean(x * x) + eps) stays finite at zero rows, so keys do too
    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q = h.unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)


def test_rms_norm_keeps_padded_keys_finite_for_causal_attention():
    rec, err = _run(RmsCausal(), _x)
    assert rec.stats["padded_dims"] == 2 and err < 1e-5, rec.notes


def test_after_shapes_waits_for_that_many_distinct_sizes():
    rec, err = _run(Rows().eval(), _x, options={"after_shapes": 3})
    assert err < 1e-5
    assert any("padding starts once the graph has met 3 distinct sizes" in n for n in rec.notes), rec.notes
    assert any(n.startswith("call 3: 3 distinct sizes met") for n in rec.notes), rec.notes
    assert _padded(rec) and _padded(rec)[0].startswith("call 3:"), rec.notes  # calls 1 and 2 ran unpadded
    with pytest.raises(OptionError, match="after_shapes must be 1 or more"):
        torch.compile(Rows(), backend="kernelpytorch", options={"bucketing": {"after_shapes": 0}})(
            torch.randn(2, 3, 16))


def _default_record(x_sizes, monkeypatch=None):
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    fn = torch.compile(Rows().eval(), backend="kernelpytorch", options={"codegen": "eager", "fusion": False})
    with torch.no_grad():
        for b, s in x_sizes:
            x = torch.randn(b, s, 16)
            torch._dynamo.mark_dynamic(x, 1)
            assert (fn(x) - Rows.forward(fn._orig_mod, x)).abs().max() < 1e-5
    return kpt_compiler.last_report().pass_record("bucketing")


def test_not_asked_for_it_runs_for_cuda_inference_only_and_waits(monkeypatch):
    rec = _default_record([(2, 5), (2, 7)])
    assert rec.status == "unchanged" and "on by default for CUDA inference only" in rec.notes[0], rec.notes
    from kpt_compiler import backend as backend_module
    from kpt_compiler.target import Target

    monkeypatch.setattr(backend_module, "detect_target", lambda *a, **k: Target("cuda", "NVIDIA H100 80GB HBM3",
                                                                                (9, 0)))
    rec = _default_record([(2, 5), (2, 7)])
    assert rec.status == "applied", rec.notes
    assert any(f"met {bk.AUTO_AFTER_SHAPES} distinct sizes (on by default" in n for n in rec.notes), rec.notes
    assert not any("compile deferred" in n for r in kpt_compiler.reports() for p in r.passes() for n in p.notes)


def test_a_fitted_ladder_pads_less_than_powers_of_two_with_as_many_buckets():
    import itertools
    import random

    from kpt_compiler.passes import _ladder

    rng = random.Random(0)
    for _ in range(30):
        sizes = sorted({rng.randint(1, 300) for _ in range(rng.randint(1, 9))})
        fitted = _ladder.fit(sizes)
        pow2 = {_ladder.power_of_two(v) for v in sizes}
        assert len(fitted) <= len(pow2) and max(fitted) >= max(sizes)

        def waste(ladder):
            return sum(_ladder.round_up(v, ladder, "power_of_two") - v for v in sizes)

        # the least padding over every choice of that many buckets among the sizes met (aligned as fit aligns)
        caps = sorted({v if v <= 16 else -(-v // 8) * 8 for v in sizes})
        best = min(waste(c) for k in range(1, len(pow2) + 1) for c in itertools.combinations(caps, k)
                   if max(c) >= max(sizes))
        assert waste(fitted) == best <= waste(sorted(pow2)), (sizes, fitted)
    assert _ladder.round_up(700, (100, 500), "power_of_two") == 1024 and _ladder.round_up(700, (100, 500)) == 700
    # far-apart sizes met: one in between pads no further than its power of two (a review's case, 2026-11-27)
    far = _ladder.fit([3] + list(range(10**6, 10**6 + 7)))
    assert _ladder.round_up(4, far, "power_of_two") == 4 and _ladder.round_up(6, (5, 112), "power_of_two") == 8


def test_only_the_padded_dims_sizes_count_towards_the_wait():
    # the batch varies (not padded: dims=[1]) while the sequence takes two sizes: no ladder is fitted
    sizes = [(b, 6 if b % 2 else 40) for b in range(2, 11)]
    rec, err = _run(Rows().eval(), _x, sizes=sizes, options={"buckets": "fit", "dims": [1]})
    assert err < 1e-5 and not any("ladders fitted" in n for n in rec.notes), rec.notes


def test_buckets_fit_waits_for_eight_sizes_then_pads_to_the_fitted_ladder():
    sizes = [(2, s) for s in (5, 7, 9, 30, 31, 33, 60, 62, 63, 40, 6)]
    rec, err = _run(Rows().eval(), _x, sizes=sizes, dims=(1,), options={"buckets": "fit", "dims": [1]})
    assert err < 1e-5
    fitted = [n for n in rec.notes if "ladders fitted to the 8 sizes met" in n]
    assert fitted and fitted[0].startswith("call 8:"), rec.notes
    ladder = [int(v) for v in fitted[0].split("[")[1].rstrip("]").split(", ")]
    assert ladder == sorted(ladder) and max(ladder) >= 62 and len(ladder) <= 4, ladder  # 8, 16, 32, 64 as powers
    padded = [int(n.rsplit("=", 1)[1]) for n in _padded(rec)]
    # a fitted bucket, or a size's own power of two where the next bucket is further (7 -> 8, not 9)
    assert padded and set(padded) <= set(ladder) | {8, 16, 32, 64} and set(padded) & set(ladder), (padded, ladder)


# The review of 2026-12-04 (an adversarial helper): eight graphs the proof passed whose padded runs were wrong, or
# raised. Each is refused now, on the dim at fault, and the outputs equal eager's.
class _Table(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.table, self.body = nn.Parameter(torch.randn(64, 16)), body

    def forward(self, x):
        return self.body(self, x)


class _Int8Causal(nn.Module):  # positions cast to int8 wrap past 127: padded keys 128.. read as negative
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        i = torch.arange(x.shape[1]).to(self.dtype)
        scores = (x @ x.transpose(1, 2)).masked_fill(i[None, :, None] < i[None, None, :], float("-inf"))
        return scores.softmax(-1) @ x


class _QueryKeyMaskPool(nn.Module):  # padded query rows see no key: NaN rows, then 0 * NaN in a masked mean
    def forward(self, x, m):
        m2 = m[:, :, None] & m[:, None, :]
        h = (x @ x.transpose(1, 2)).masked_fill(~m2, float("-inf")).softmax(-1) @ x
        w = m.unsqueeze(-1).float()
        return (h * w).sum(1) / w.sum(1)


_SMALL = [(3, 5), (2, 7), (5, 9)]


@pytest.mark.parametrize("model, make, sizes, refused", [
    (_Table(lambda m, x: x + m.table[x.shape[1]]), _x, _SMALL, "its argument index"),
    (_Table(lambda m, x: x + m.table[64 - x.shape[1]:]), _x, _SMALL, "its argument start"),
    (_Table(lambda m, x: x + m.table.roll(x.shape[1], 0)[:x.shape[1]]), _x, _SMALL, "its argument shifts"),
    (lambda x: x[:, 0] + x.new_full((x.shape[0], 16), x.shape[1]), _x, _SMALL, "its argument fill_value"),
    (lambda x: x[:, :, x.shape[1]:] * 2, _x, _SMALL, "its argument start"),  # raised in the slicing back
    (lambda x: x.transpose(1, 2) @ (x - 0.5).pow(0.5), lambda b, s: (torch.rand(b, s, 16) + 1,), _SMALL,
     "sums over a padded dim"),  # (-0.5) ** 0.5 at the zero padding is NaN
    (_Int8Causal(torch.int8), lambda b, s: (torch.randn(b, s, 4),), [(2, 129), (1, 130)], "softmax over dim 2"),
    (_Int8Causal(torch.bfloat16), lambda b, s: (torch.randn(b, s, 4),), [(1, 257), (1, 259)], "softmax over dim 2"),
    (_QueryKeyMaskPool(), lambda b, s: (torch.randn(b, s, 16), torch.ones(b, s, dtype=torch.bool)), _SMALL,
     "reduces (sum) over dim 1"),
])
def test_the_second_reviews_wrong_proofs_are_refused(model, make, sizes, refused):
    rec, err = _run(model, make, sizes=sizes)
    assert refused in " ".join(rec.notes) and "dim 1" in " ".join(rec.notes), rec.notes
    assert err < 1e-4


def test_a_table_sliced_to_the_sequence_length_is_still_a_prefix():
    # a position table cut to the length (BERT's position ids): the end grows with the padding, the start is 0
    rec, err = _run(_Table(lambda m, x: x + m.table[:x.shape[1]]), _x, sizes=_SMALL)
    assert rec.status == "applied" and rec.stats["padded_dims"] == 2 and err < 1e-5, rec.notes



def test_an_output_smaller_than_its_real_size_withdraws_the_padding(monkeypatch):
    # the safety net behind the proof: with the check of growing sizes switched off, x[:, :, s:] is "proven" and
    # its padded output is narrower than the real one; the call runs unpadded instead and the report says why
    from kpt_compiler.passes import _padding_proof

    monkeypatch.setattr(_padding_proof._Prover, "sizes_only", lambda self, node, shapes: None)
    rec, err = _run(lambda x: x[:, :, x.shape[1]:] * 2, _x, sizes=_SMALL)
    assert err == 0 and any("smaller than its real size" in n for n in rec.notes), rec.notes


class _LegacyEmptyCache(nn.Module):  # transformers' legacy cache starts as torch.tensor([]) and is concatenated to
    def forward(self, x):
        past = x.new_zeros(0)  # a 1-D empty tensor: torch.cat skips it whatever the other parts' rank
        return torch.cat([past, x], dim=1).cumsum(1)


def test_a_one_dimensional_empty_part_of_a_cat_is_skipped_as_torch_skips_it():
    # a third review's find: the proof indexed the empty part's dim 1 and raised (the pass rolled back, unpadded)
    rec, err = _run(_LegacyEmptyCache(), _x, sizes=_SMALL)
    assert rec.status == "applied" and rec.stats["padded_dims"] == 2 and err < 1e-5, rec.notes
