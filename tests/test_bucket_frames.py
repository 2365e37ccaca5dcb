"""Static graphs Dynamo makes beside a bucketed dynamic one (the sizes first seen, batch 1) served by that graph
instead of compiled (passes/_bucket_frames.py), on the CPU with codegen eager: outputs equal eager's, the static
graphs never compiled, and every case where serving would be wrong refused."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kpt_compiler
from kpt_compiler.passes import bucketing as bucketing_pass

OPTIONS = {"codegen": "eager", "bucketing": {"pad": "always"}, "fusion": False}


class Rows(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class OddAtOne(Rows):
    def forward(self, x):
        if x.shape[0] == 1:  # Dynamo specializes batch 1 and takes this branch there only
            return 2 * super().forward(x)
        return super().forward(x)


def _stream(model, batches, options=OPTIONS):
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    fn = torch.compile(model, backend="kernelpytorch", options=options)
    with torch.no_grad():
        for i, b in enumerate(batches):
            x = torch.randn(b, 5, 16)
            if i and b > 1:  # as automatic dynamic shapes would from the second size (torch_xla turns that off)
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(fn(x), model(x), atol=1e-5, rtol=1e-5)
    return kpt_compiler.reports()


def test_batch_1_is_served_by_the_dynamic_graph_without_a_compile():
    reports = _stream(Rows().eval(), [3, 5, 1, 3, 1, 6, 1, 3])
    assert len(reports) == 3  # batch 3 (static), the dynamic one, batch 1 (static)
    first, dynamic, one = reports
    assert dynamic.pass_record("bucketing").status == "applied"
    assert "joint" not in first.stages  # Dynamo sends batch 3 to the dynamic graph once it exists: never compiled
    assert any("served by the frame's" in n for n in first.pass_record("bucketing").notes)  # had it been called
    assert "joint" not in one.stages, one.notes  # never compiled: AOTAutograd never ran
    assert any(n.startswith("served by the frame's bucketed dynamic graph") for n in one.notes), one.notes
    # batch 1 ran padded to the dynamic code's least size, 2 (Dynamo's dynamic sizes start there)
    assert any("first call in bucket" in n and "=2" in n for n in dynamic.pass_record("bucketing").notes), \
        dynamic.pass_record("bucketing").notes


class BreaksAtOne(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.a = nn.Linear(d, d)

    def forward(self, x):
        h = self.a(x)
        if x.shape[0] == 1:
            torch._dynamo.graph_break()  # at batch 1 only: that graph is the part before, of the same frame
        return torch.where(h > 0.5, 2 * h, h)


CLAMP = [False]


class ReadsAGlobal(Rows):
    def forward(self, x):
        y = super().forward(x)
        return y.clamp(max=0.05) if CLAMP[0] else y


def _refused(report, why):
    assert any(why in n for n in report.notes), report.notes
    assert "joint" in report.stages  # its own compile ran (its second call)


def test_a_graph_that_is_another_program_at_batch_1_compiles_its_own():
    """Padding 1 to 2 runs the dynamic graph's code; a forward that branches on batch 1, breaks the graph there
    only, or reads a global that changed since, is another program: refused by the graphs' structure (values
    alone would pass the first call's check where the difference depends on them)."""
    _refused(_stream(OddAtOne().eval(), [3, 5, 1, 1, 1])[2], "not the dynamic graph's program at its sizes")
    reports = _stream(BreaksAtOne().eval(), [3, 5, 1, 1, 1])
    assert any("not the dynamic graph's program" in n for r in reports[2:] for n in r.notes)
    model = ReadsAGlobal().eval()
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    fn = torch.compile(model, backend="kernelpytorch", options=OPTIONS)
    try:
        with torch.no_grad():
            for i, b in enumerate([3, 5, 1, 1, 4, 1]):
                CLAMP[0] = i >= 2  # changes after the dynamic graph exists
                x = torch.randn(b, 5, 16)
                if i and b > 1:
                    torch._dynamo.mark_dynamic(x, 0)
                torch.testing.assert_close(fn(x), model(x), atol=1e-5, rtol=1e-5)
    finally:
        CLAMP[0] = False
    assert any("not the dynamic graph's program" in n for r in kpt_compiler.reports() for n in r.notes)


def test_another_model_of_the_class_is_not_served_by_the_first_ones_graph():
    a, b = Rows().eval(), Rows().eval()  # one frame (one forward code object), other weights
    _stream(a, [3, 5])
    fb = torch.compile(b, backend="kernelpytorch", options=OPTIONS)  # Dynamo's cache is per code object
    with torch.no_grad():
        for n in (1, 1, 3):
            x = torch.randn(n, 5, 16)
            torch.testing.assert_close(fb(x), b(x), atol=1e-5, rtol=1e-5)
    one = kpt_compiler.reports()[-1]
    assert any("other parameters" in n for n in one.notes), one.notes  # checked by identity, not by the check


def test_not_served_without_bucketing_or_in_training():
    reports = _stream(Rows().eval(), [3, 5, 1, 1], options={**OPTIONS, "bucketing": False})
    assert not any("served" in n for r in reports for n in r.notes)
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    model = Rows()
    fn = torch.compile(model, backend="kernelpytorch", options=OPTIONS)
    for n in (3, 5, 1):
        x = torch.randn(n, 5, 16)
        torch.testing.assert_close(fn(x), model(x), atol=1e-5, rtol=1e-5)
    assert not any("served" in n for r in kpt_compiler.reports() for n in r.notes)


def test_the_dynamic_graph_is_let_go_with_its_compiled_code():
    """The registry holds the plan, whose CUDA graphs hold a memory pool: it must not outlive the graph."""
    import gc

    from kpt_compiler.passes import _bucket_frames as frames

    before = set(frames._FRAMES)
    _stream(Rows().eval(), [3, 5])
    mine = set(frames._FRAMES) - before
    assert len(mine) == 1
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    gc.collect()
    assert not mine & set(frames._FRAMES)


def test_a_dynamic_graph_compiled_under_autocast_does_not_serve_a_plain_call():
    """Autocast is Dynamo's global state, guarded, not a node: the structure cannot see it, the state guard does."""
    model = Rows().eval()
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    fn = torch.compile(model, backend="kernelpytorch", options=OPTIONS)
    with torch.no_grad():
        for i, b in enumerate([3, 5, 6]):
            x = torch.randn(b, 5, 16)
            if i:
                torch._dynamo.mark_dynamic(x, 0)
            with torch.autocast("cpu", torch.bfloat16):
                fn(x)
        for _ in range(2):
            x = torch.randn(1, 5, 16)
            torch.testing.assert_close(fn(x), model(x), atol=1e-5, rtol=1e-5)
    assert any("another global state" in n for r in kpt_compiler.reports() for n in r.notes)


def _stream_2d(model, sizes, reset=True):
    """(batch, sequence) pairs: both dims dynamic from the second call, the sequence alone at batch 1 (Dynamo's
    graph for batch 1 keeps the sizes it made dynamic before)."""
    if reset:
        torch._dynamo.reset()
        kpt_compiler.clear_reports()
    fn = torch.compile(model, backend="kernelpytorch", options=OPTIONS)
    with torch.no_grad():
        for i, (b, s) in enumerate(sizes):
            x = torch.randn(b, s, 16)
            if i or not reset:
                torch._dynamo.mark_dynamic(x, 1)
                if b > 1:
                    torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(fn(x), model(x), atol=1e-5, rtol=1e-5)
    return kpt_compiler.reports()


def test_batch_1_with_the_sequence_dynamic_is_served_without_a_compile(monkeypatch):
    """The graph for batch 1 is dynamic in the sequence: the same program as the dynamic graph's with its batch
    symbol at 1 and its sequence symbol at the other graph's (compared symbolically), served at every sequence.
    It is not traced for a padding proof of its own (seconds a graph for transformers' Llama on the H100, s39)."""
    traced = []
    trace = bucketing_pass._trace
    monkeypatch.setattr(bucketing_pass, "_trace", lambda gm, values: traced.append(gm) or trace(gm, values))
    reports = _stream_2d(Rows().eval(), [(3, 5), (4, 7), (1, 9), (1, 11), (1, 6), (1, 30)])
    assert len(reports) == 3
    assert len(traced) == 1, "only the dynamic graph is traced for its proof"
    one = reports[2]
    assert one.pass_record("bucketing").status == "applied", "the batch-1 graph keeps the sequence dynamic"
    assert any("no padding proof of its own" in n for n in one.pass_record("bucketing").notes)
    assert "joint" not in one.stages, one.notes  # never compiled
    assert any(n.startswith("served by the frame's bucketed dynamic graph") for n in one.notes), one.notes
    assert not any("not served" in n for n in one.notes), one.notes


class MeanRows(Rows):
    """The mean over the sequence: the dynamic graph pads the batch only."""

    def forward(self, x):
        return super().forward(x).mean(1)


def test_batch_1_is_compiled_where_the_dynamic_graph_would_have_to_pad_it_and_leaves_a_dim_unpadded():
    """Batch 1 is under the dynamic code's least size (2): serving would pad it, which the dynamic graph does only
    where it pads every dynamic size; it does not pad the sequence here, so every call would run the batch-1
    graph uncompiled (a review of cd73e92). Refused before the compile, it is compiled as before."""
    reports = _stream_2d(MeanRows().eval(), [(3, 5), (4, 7), (1, 9), (1, 11), (1, 6), (1, 30)])
    assert len(reports) == 3
    assert any("reduces (mean) over dim 1" in n for n in reports[1].pass_record("bucketing").notes)
    one = reports[2]
    assert any("it does not pad s" in n and "not served by the frame's bucketed dynamic graph" in n
               for n in one.pass_record("bucketing").notes), one.pass_record("bucketing").notes
    assert "joint" in one.stages, one.notes  # compiled


class ExpandsPositions(Rows):
    """transformers' Llama: positions [1, s] expanded to the batch except at batch 1, where the batch-1 graph has
    no expand and the dynamic graph's expand to (1, s) is the identity."""

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=x.dtype)[None]
        if x.shape[0] != 1:
            pos = pos.expand(x.shape[0], -1)
        return super().forward(x + 0.01 * pos[..., None])


class ViewsOtherwiseAtOne(Rows):
    """At batch 1 a view that is not the identity there (features split in two): another program."""

    def forward(self, x):
        y = super().forward(x)
        return y.reshape(1, y.shape[1], 2, -1) if x.shape[0] == 1 else y


def test_a_view_that_is_the_identity_at_batch_1_does_not_stop_serving():
    """Without the identity views left out of the comparison, ExpandsPositions' batch-1 graph is another program
    and compiles its own code (transformers' Llama did on the H100: 12.9 s of its stream's pass 1, s38)."""
    reports = _stream_2d(ExpandsPositions().eval(), [(3, 6), (4, 8), (1, 10), (1, 12), (1, 6), (1, 30)])
    assert len(reports) == 3
    one = reports[2]
    assert "joint" not in one.stages, one.notes  # never compiled
    assert any(n.startswith("served by the frame's bucketed dynamic graph") for n in one.notes), one.notes
    assert not any("not served" in n for n in one.pass_record("bucketing").notes), one.pass_record("bucketing").notes
    reports = _stream_2d(ViewsOtherwiseAtOne().eval(), [(3, 6), (4, 8), (1, 10), (1, 12), (1, 6), (1, 30)])
    assert any("not served by the frame's bucketed dynamic graph: it is not the dynamic graph's program" in n
               for n in reports[2].pass_record("bucketing").notes), reports[2].pass_record("bucketing").notes


def test_batch_1_with_the_sequence_dynamic_that_is_another_program_compiles_at_once():
    """Refused by structure before its compile (transformers' GPT-2 takes another path at batch 1): compiled as
    any dynamic graph, not deferred."""
    reports = _stream_2d(OddAtOne().eval(), [(3, 5), (4, 7), (1, 9), (1, 11), (1, 6), (1, 30)])
    assert len(reports) == 3
    assert any("not served by the frame's bucketed dynamic graph: it is not the dynamic graph's program" in n
               for n in reports[2].pass_record("bucketing").notes), reports[2].pass_record("bucketing").notes
    assert "joint" in reports[2].stages and not any("deferred" in n for n in reports[2].notes)


def test_batch_1_of_another_model_of_the_class_is_refused_before_its_compile():
    """Its graph maps and is the same program; its parameters are other objects (read off Dynamo's example
    inputs, the real ones): compiled as any graph."""
    _stream_2d(Rows().eval(), [(3, 5), (4, 7)])
    reports = _stream_2d(Rows().eval(), [(1, 9), (1, 7), (1, 30)], reset=False)
    notes = reports[-1].pass_record("bucketing").notes
    assert any("not served" in n and "other parameters" in n for n in notes), notes
    assert "joint" in reports[-1].stages


class Derived(nn.Module):
    """At batch > 1 the forward checks y's length is twice x's, so Dynamo's dynamic graph derives it (2*s); the
    batch-1 graph never checks it and keeps y's length a size of its own."""

    def __init__(self, d=16):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, y):
        if x.shape[0] > 1 and y.shape[1] != 2 * x.shape[1]:
            raise ValueError("y must be twice x for batches")
        return self.a(x), self.b(y)


def test_a_size_the_dynamic_graph_derives_is_not_served_where_the_other_graph_has_its_own():
    """Found by a review: the derived size was taken for a free one, and y padded or cut to twice x's length."""
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    model = Derived().eval()
    fn = torch.compile(model, backend="kernelpytorch", options=OPTIONS)
    with torch.no_grad():
        for i, (b, s, t) in enumerate([(3, 5, 10), (4, 7, 14), (1, 5, 10), (1, 5, 7), (1, 9, 30), (1, 6, 40)]):
            x, y = torch.randn(b, s, 16), torch.randn(b, t, 16)
            for z in (x, y) if i else ():
                torch._dynamo.mark_dynamic(z, 1)
                if b > 1:
                    torch._dynamo.mark_dynamic(z, 0)
            for got, ref in zip(fn(x, y), model(x, y)):
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    notes = [n for r in kpt_compiler.reports() for n in r.pass_record("bucketing").notes]
    assert any("the dynamic graph derives it" in n for n in notes), notes


def test_a_served_batch_1_graph_that_stops_being_served_runs_as_it_is(monkeypatch):
    """Never compiled (a dynamic graph compiled outside Dynamo would lose its symbols): where serving stops (here
    the first call's check made to fail), its calls run the graph eagerly, right at every sequence."""
    from kpt_compiler.passes import _bucket_frames as frames

    monkeypatch.setattr(frames, "_differs", lambda out, ref: "made to differ")
    reports = _stream_2d(Rows().eval(), [(3, 5), (4, 7), (1, 9), (1, 11), (1, 30)])
    one = reports[2]
    assert "joint" not in one.stages
    assert any("not served by the frame's dynamic graph from call 1" in n for n in one.notes), one.notes
    assert any(n.startswith("not compiled: its calls go to another graph") for n in one.notes), one.notes


class Not16(Rows):
    def forward(self, x):
        if x.shape[1] == 16:  # the dynamic code is guarded Ne(s, 16): bucket 16 breaks it
            raise ValueError("16 is reserved")
        return super().forward(x)


def test_a_size_no_bucket_takes_runs_the_graph_as_it_is_for_that_call_only():
    """Found by a review: one such call stopped serving for good, and a batch-1 graph never compiled ran eagerly
    from then on."""
    reports = _stream_2d(Not16().eval(), [(3, 5), (4, 7), (1, 9), (1, 12), (1, 9), (1, 30), (1, 5)])
    one = reports[2]
    assert any(n.startswith("a call the dynamic graph cannot take") for n in one.notes), one.notes
    assert any(n.startswith("served by the frame's bucketed dynamic graph") for n in one.notes), one.notes
    assert not any("not served" in n for n in one.notes), one.notes


def test_a_deferred_graph_does_not_hold_its_first_inputs():
    """Found by a review: the first call's inputs stayed alive through the pass manager as long as the model,
    for a compile that, served, never runs."""
    import gc
    import weakref

    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    model = Rows().eval()
    fn = torch.compile(model, backend="kernelpytorch", options=OPTIONS)
    with torch.no_grad():
        first = torch.randn(3, 5, 16)
        fn(first)
        held = weakref.ref(first)
        del first
        gc.collect()
    assert held() is None


def test_batch_1_is_not_served_by_a_graph_that_does_not_pad_the_batch():
    """bucketing's dims=(1,): the dynamic code takes batch 2 and up and nothing pads 1 to 2, so the batch-1 graph
    compiles its own code (it was accepted, never compiled, and ran eagerly)."""
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    model = Rows().eval()
    fn = torch.compile(model, backend="kernelpytorch", options={**OPTIONS, "bucketing": {"pad": "always",
                                                                                        "dims": (1,)}})
    with torch.no_grad():
        for i, (b, s) in enumerate([(3, 5), (4, 7), (1, 9), (1, 11)]):
            x = torch.randn(b, s, 16)
            for d in ((1,) if b == 1 else (0, 1)) if i else ():
                torch._dynamo.mark_dynamic(x, d)
            torch.testing.assert_close(fn(x), model(x), atol=1e-5, rtol=1e-5)
    one = kpt_compiler.reports()[2]
    assert any("does not pad" in n for n in one.pass_record("bucketing").notes), one.pass_record("bucketing").notes
    assert "joint" in one.stages


class CausalAttention(nn.Module):
    """Hand-written causal attention, which the attention pass (after bucketing) rewrites to SDPA: causal in the
    dynamic graph, and with no mask at all in a static graph of sequence 1 (every key visible there)."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        t = x.shape[1]
        scores = (q @ k.transpose(-1, -2)) * 0.25
        causal = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
        return self.o(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v)


def _to_sequence_1(fn, model):
    """Static sizes, then two calls marked dynamic in batch and sequence, then 1x1 twice; each call against eager."""
    with torch.no_grad():
        for b, s, dynamic in [(3, 5, False), (4, 7, True), (2, 6, True), (1, 1, False), (1, 1, False)]:
            x = torch.randn(b, s, 16)
            if dynamic:
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(fn(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_static_graph_that_later_passes_rewrite_otherwise_is_still_served():
    """The comparison reads both graphs as bucketing sees them. A static graph was read after the passes that follow
    it, while the dynamic one was read before them. So a static graph that a later pass rewrote was another program.
    Here the attention pass finds no mask at sequence 1 and a causal one in the dynamic graph. The 200-call streams'
    call 194 is such a graph; its compile took 10.5 s of the Llama stream's second pass on the H200 in s43."""
    model = CausalAttention().eval()
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    fn = torch.compile(model, backend="kernelpytorch", options=OPTIONS)
    _to_sequence_1(fn, model)
    reports = kpt_compiler.reports()
    assert len(reports) == 3, [r.notes for r in reports]  # the first sizes, the dynamic graph, sequence 1
    assert "no mask" in " ".join(reports[2].pass_record("attention").notes), "the rewrites differ"
    one = reports[2]
    assert any(n.startswith("served by the frame's bucketed dynamic graph") for n in one.notes), one.notes
    assert not any("not served" in n for n in one.notes), one.notes
    assert "joint" not in one.stages, one.notes  # never compiled


def test_transformers_llama_at_sequence_1_is_served():
    pytest.importorskip("transformers")
    from kpt_compiler.models import zoo

    torch.manual_seed(0)
    model, make = zoo.build("llama", attn="eager", n_layer=1, hidden=64, heads=4, kv_heads=2)
    model.eval()
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    fn = torch.compile(model, backend="kernelpytorch", options=OPTIONS)
    with torch.no_grad():
        for b, s in [(3, 20), (4, 33), (2, 9), (1, 1), (1, 1)]:
            x = make(b, s, "cpu")[0]
            torch.testing.assert_close(fn(x).logits, model(x).logits, atol=1e-4, rtol=1e-4)
    one = kpt_compiler.reports()[-1]
    assert any(n.startswith("served by the frame's bucketed dynamic graph") for n in one.notes), one.notes
    assert "joint" not in one.stages, one.notes


class SizeView(Rows):
    """A view to ``x.size()[:-1] + (...)``, as GPT-2's Conv1D: a torch.Size node in a dynamic graph, the tuple
    itself in a static one."""

    def forward(self, x):
        h = super().forward(x)
        return h.view(h.size()[:-1] + (2, 8)).sum(-1)


def test_a_size_tuple_built_from_dynamic_sizes_is_the_static_graphs_tuple():
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    model = SizeView().eval()
    fn = torch.compile(model, backend="kernelpytorch", options=OPTIONS)
    _to_sequence_1(fn, model)
    one = kpt_compiler.reports()[-1]
    assert any(n.startswith("served by the frame's bucketed dynamic graph") for n in one.notes), one.notes
    assert "joint" not in one.stages, one.notes


def test_a_served_graph_is_freed_without_the_collector(monkeypatch):
    """Once Dynamo drops them, a served graph's callable and its own deferred code go by reference counting: the
    serving wrapper held the Served object past the wrap, a cycle through the pass manager (found by a review of
    d4d1236), which kept compiled code, and on a GPU its CUDA graphs, until the collector ran."""
    import gc
    import weakref

    from kpt_compiler import backend

    made = []
    init = backend._Deferred.__init__
    monkeypatch.setattr(backend._Deferred, "__init__", lambda self, *a, **k: init(self, *a, **k) or made.append(
        weakref.ref(self)))
    gc.collect()
    gc.disable()
    try:
        _stream_2d(Rows().eval(), [(3, 5), (4, 7), (1, 9), (1, 11)])
        assert made, "the batch-1 graph's code is deferred"
        torch._dynamo.reset()
        kpt_compiler.clear_reports()
        assert [r() for r in made] == [None] * len(made)
    finally:
        gc.enable()
