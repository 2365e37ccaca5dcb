"""The cudagraphs pass on the GPU: a small inference graph is captured by default and replayed, its outputs
stay valid after the next call (they are copied out of the pool), a large graph is left alone, refusals name
their reason. Inductor's own refusals reach the report through its log (tests/test_cudagraphs.py: on torch 2.11
the H100 captured both graphs we built for Inductor to refuse, a CPU constant and a CPU random tensor)."""

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kpt_compiler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class Mlp(nn.Module):
    def __init__(self, d=512, hidden=2048):
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _compiled(model, **options):
    torch._dynamo.reset()
    return torch.compile(model, backend="kernelpytorch", options=options)


def test_a_small_inference_graph_is_captured_by_default_and_its_outputs_outlive_the_next_call():
    torch.manual_seed(0)
    model = Mlp().cuda().bfloat16().eval()
    xs = [torch.randn(1, 16, 512, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    f = _compiled(model)
    with torch.no_grad():
        outs = [f(x) for x in xs]  # warm-up, record, replays: each output kept while the next calls run
        refs = [model(x) for x in xs]
    rec = kpt_compiler.last_report().pass_record("cudagraphs")
    assert rec.status == "applied" and rec.stats.get("captured") == 1, rec
    assert not any("declined" in n for n in rec.notes), rec.notes
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    # it did replay: Inductor's cudagraph trees hold a recorded graph for this function
    from torch._inductor import cudagraph_trees

    tree = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    assert tree is not None and len(tree.roots) >= 1


def test_always_captures_a_training_step_forward_and_backward_and_it_trains_as_eager():
    import copy

    torch.manual_seed(0)
    model = Mlp().cuda()
    ref = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    f = _compiled(model, cudagraphs={"decide": "always"})
    for _ in range(4):  # warm-up, record, replays
        x = torch.randn(8, 64, 512, device="cuda")
        losses = []
        for m, o in ((f, opt), (ref, opt_ref)):
            loss = m(x).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5)
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad(set_to_none=True)
        assert abs(losses[0] - losses[1]) <= 1e-3 * abs(losses[1]), losses
    rec = kpt_compiler.last_report().pass_record("cudagraphs")
    assert rec.status == "applied" and rec.stats.get("captured") == 1, rec
    assert any("forward and backward captured" in n for n in rec.notes), rec.notes
    from torch._inductor import cudagraph_trees

    tree = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    assert tree is not None and len(tree.ids_to_funcs) >= 2  # the forward's graph and the backward's


def test_auto_leaves_a_training_graph_and_says_how_to_capture_it():
    model = Mlp().cuda()
    _compiled(model)(torch.randn(8, 64, 512, device="cuda")).sum().backward()
    rec = kpt_compiler.last_report().pass_record("cudagraphs")
    assert rec.status != "applied" and any("decide='always' captures forward and backward" in n
                                           for n in rec.notes), rec


def test_without_the_copy_each_output_is_right_until_the_next_call():
    torch.manual_seed(0)
    model = Mlp().cuda().bfloat16().eval()
    f = _compiled(model, cudagraphs={"copy_outputs": False})
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 16, 512, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(f(x).clone(), model(x), rtol=2e-2, atol=2e-2)
    rec = kpt_compiler.last_report().pass_record("cudagraphs")
    assert rec.status == "applied" and not any("copied out" in n for n in rec.notes), rec.notes


def test_a_large_graph_is_left_to_run_without_capture():
    model = Mlp(4096, 16384).cuda().bfloat16().eval()
    x = torch.randn(16, 1024, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _compiled(model)(x)
    rec = kpt_compiler.last_report().pass_record("cudagraphs")
    assert rec.status == "unchanged" and any("not under launch_bound_ms" in n for n in rec.notes), rec.notes


class Causal(nn.Module):
    """Causal self-attention and an MLP over [batch, sequence, 256]: what bucketing proves safe to pad."""

    def __init__(self, d=256):
        super().__init__()
        self.qkv, self.mlp = nn.Linear(d, 3 * d), Mlp(d, 4 * d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.mlp(x + a.transpose(1, 2).reshape(b, s, d))


def _bucketed_calls(options, sizes):
    torch.manual_seed(0)
    model = Causal().cuda().bfloat16().eval()
    f = _compiled(model, **options)
    xs = [torch.randn(b, s, 256, device="cuda", dtype=torch.bfloat16) for b, s in sizes]
    for x in xs:
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(x, 1)
    with torch.no_grad():
        outs = [f(x) for x in xs]  # every output kept while the later calls run
        refs = [model(x) for x in xs]
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    return kpt_compiler.last_report()


def test_bucketing_with_cuda_graphs_captures_per_bucket_and_replays_right():
    sizes = [(3, 50), (4, 60), (2, 33), (4, 64), (3, 40), (2, 64), (4, 63)]  # buckets 4x64 and 2x64
    report = _bucketed_calls({"bucketing": True, "cudagraphs": {"decide": "always"}}, sizes)
    rec = report.pass_record("cudagraphs")
    assert rec.status == "applied", rec.notes
    captured = [n for n in rec.notes if ": captured (" in n]
    assert len(captured) == 2, rec.notes  # each bucket at its second call
    # the pool's own segments (s44): the reserved memory's growth read 0 MiB once torch.cuda.graph emptied the cache
    assert float(re.search(r"([\d.]+) MiB in all", captured[-1]).group(1)) > 0, captured
    assert report.pass_record("bucketing").stats["padded_dims"] == 2


def test_a_memory_cap_stops_the_captures_and_the_report_says_so():
    sizes = [(3, 50), (4, 60), (4, 40), (2, 33), (2, 40), (2, 30)]
    report = _bucketed_calls({"bucketing": True, "cudagraphs": {"decide": "always", "max_pool_mb": 1e-3}}, sizes)
    notes = report.pass_record("cudagraphs").notes
    # the first capture grows the pool past the cap and is let go; the calls still come out right (checked above)
    assert any("capture released" in n and "max_pool_mb" in n for n in notes), notes


def test_a_bucket_auto_declines_runs_at_its_own_sizes(monkeypatch):
    import types

    import kpt_compiler.passes._bucket_plan as bucket_plan

    pads = []
    monkeypatch.setattr(bucket_plan, "F", types.SimpleNamespace(pad=lambda t, p: pads.append(p) or F.pad(t, p)))
    sizes = [(3, 50), (4, 60), (2, 33)]  # no graph pays under a bound of a nanosecond: nothing padded
    report = _bucketed_calls({"bucketing": True, "cudagraphs": {"launch_bound_ms": 1e-6}}, sizes)
    notes = report.pass_record("cudagraphs").notes
    assert any("not captured, its calls run unpadded" in n for n in notes), notes
    assert not pads


def test_by_default_bucketing_waits_for_the_fourth_distinct_size_then_captures():
    sizes = [(3, 50), (4, 60), (2, 33), (4, 40), (3, 64), (4, 63), (4, 50)]  # the 4th: bucket 4x64
    report = _bucketed_calls({"cudagraphs": {"decide": "always"}}, sizes)
    notes = report.pass_record("bucketing").notes
    assert any(n.startswith("call 4: 4 distinct sizes met") for n in notes), notes
    assert any(": captured (" in n for n in report.pass_record("cudagraphs").notes)


def test_without_bucketing_a_dynamic_graph_is_refused_with_the_way_out():
    report = _bucketed_calls({"bucketing": False, "cudagraphs": {"decide": "always"}}, [(3, 50), (4, 60)])
    rec = report.pass_record("cudagraphs")
    assert rec.status != "applied" and any("bucketing" in n for n in rec.notes), rec.notes


def _step(x, cache, pos):  # a static cache's update: written in place, read back
    cache.index_copy_(0, pos, x)
    return cache.sum(0) * 2


def _compiled_step(monkeypatch=None):
    """``_step`` compiled with our capture on; with ``monkeypatch``, the CUDA graphs made are counted too."""
    made = []
    if monkeypatch is not None:
        class Counted(torch.cuda.CUDAGraph):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                made.append(self)

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Counted)
    torch._dynamo.reset()
    return torch.compile(_step, backend="kernelpytorch", options={"cudagraphs": {"decide": "always"}}), made


def test_a_graph_writing_into_its_inputs_is_captured_by_us_and_the_writes_land():
    f, _ = _compiled_step()
    step = _step
    for _ in range(2):  # a second cache (a new generate() call): moved into the first's storage, or captured
        cache, ref = torch.zeros(8, 16, device="cuda"), torch.zeros(8, 16, device="cuda")
        outs = []
        for i in range(6):
            x, pos = torch.randn(1, 16, device="cuda"), torch.tensor([i], device="cuda")
            outs.append(f(x, cache, pos))
            expected = step(x, ref, pos)
            torch.testing.assert_close(outs[-1], expected)
        torch.testing.assert_close(cache, ref)  # every write landed in the caller's tensor
    rec = kpt_compiler.last_report().pass_record("cudagraphs")
    assert rec.status == "applied" and any("CUDA graph of ours" in n for n in rec.notes), rec.notes
    assert any(": captured (" in n for n in rec.notes), rec.notes


def test_a_written_input_met_again_at_an_address_captured_before_replays_that_graph(monkeypatch):
    # generate() makes a new static cache per call: one graph per set of the cache's addresses, the second
    # captured without a warm-up run, and a cache met again replays its own graph instead of capturing again
    f, made = _compiled_step(monkeypatch)
    step = _step
    caches = {name: (torch.zeros(8, 16, device="cuda"), torch.zeros(8, 16, device="cuda")) for name in "AB"}
    captured_after = []
    for name in "ABA":
        cache, ref = caches[name]
        cache.zero_(), ref.zero_()
        for i in range(4):
            x, pos = torch.randn(1, 16, device="cuda"), torch.tensor([i], device="cuda")
            torch.testing.assert_close(f(x, cache, pos), step(x, ref, pos))
        torch.testing.assert_close(cache, ref)
        captured_after.append(len(made))
    assert captured_after == [1, 2, 2], captured_after


def test_a_new_cache_after_the_old_one_is_dropped_replays_without_capturing_again(monkeypatch):
    # generate() makes a new static cache per call; where the caller has dropped the old one, the new one moves
    # into the storage the capture kept (passes/_bucket_graphs.py, _adopt) instead of a capture (milliseconds each)
    f, made = _compiled_step(monkeypatch)
    step = _step
    for _ in range(3):
        cache = torch.randn(8, 16, device="cuda")  # the last round's cache is dropped here
        ref = cache.clone()
        for i in range(5):
            x, pos = torch.randn(1, 16, device="cuda"), torch.tensor([i], device="cuda")
            torch.testing.assert_close(f(x, cache, pos), step(x, ref, pos))
        torch.testing.assert_close(cache, ref)  # every write landed in the caller's (moved) tensor
    assert len(made) == 1, len(made)
    rec = kpt_compiler.last_report().pass_record("cudagraphs")
    assert any("moved into the storage the last capture kept" in n for n in rec.notes), rec.notes


def test_batch_1_is_served_by_the_dynamic_graphs_captured_buckets():
    """Dynamo's graph for batch 1 (the sequence still dynamic) is not compiled: its calls are padded to batch 2
    and replayed from the dynamic graph's captures (passes/_bucket_frames.py), right at every length."""
    torch.manual_seed(0)
    model = Causal().cuda().bfloat16().eval()
    kpt_compiler.clear_reports()
    f = _compiled(model, bucketing=True, cudagraphs={"decide": "always"})
    sizes = [(3, 50), (4, 60), (1, 33), (1, 60), (1, 33), (1, 50), (1, 64)]
    with torch.no_grad():
        for i, (b, s) in enumerate(sizes):
            x = torch.randn(b, s, 256, device="cuda", dtype=torch.bfloat16)
            for d in ((1,) if b == 1 else (0, 1)) if i else ():
                torch._dynamo.mark_dynamic(x, d)
            out = f(x)
            torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)
    reports = kpt_compiler.reports()
    one = reports[-1]
    assert "joint" not in one.stages and any(n.startswith("served by the frame's") for n in one.notes), one.notes
    dynamic = reports[1].pass_record("cudagraphs").notes
    assert any(": captured (" in n and "=2" in n for n in dynamic), dynamic  # batch 1 replayed at batch 2
