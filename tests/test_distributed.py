"""kernelpytorch under torch.distributed on the CPU (issue 20): two gloo processes train a small GPT one step
compiled with our backend (codegen eager), bare, under DDP (whose DDPOptimizer cuts Dynamo's graph at
gradient-bucket boundaries), under DDP with ``optimize_ddp`` off (one graph), and under FSDP2 (``fully_shard``).
tests/distributed_runs.py runs them and says what is asserted; tests/gpu/test_distributed_gpu.py runs the same
under NCCL on two GPUs."""

import pytest

import distributed_runs as runs
from kpt_compiler import torch_ir as ir


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    results, reference = runs.spawn(out, "gloo", {"codegen": "eager"})
    return out, results, reference


def test_every_rank_matches_one_process_and_reports_what_it_did(gloo):
    runs.check_runs(*gloo, tolerance=1e-5)


def test_the_check_fails_on_a_wrong_gradient(gloo):
    out, results, reference = gloo
    wrong = [{**r, "ddp": {**r["ddp"], "grads": {k: v * 1.001 for k, v in r["ddp"]["grads"].items()}}} for r in results]
    with pytest.raises(AssertionError, match="ddp"):
        runs.check_runs(out, wrong, reference, tolerance=1e-5)


def test_fp8_under_fsdp2_is_as_accurate_as_fp8_in_one_process(tmp_path):
    results, reference = runs.spawn(tmp_path, "gloo", {"codegen": "eager", "fp8": {"decide": "always"}},
                                    which=runs.FP8_RUNS)
    print(runs.check_fp8(results, reference))


def _graph():
    """Dynamo's graph of a block, with its example values (the matchers read them): q/k/v linears of one input,
    attention, a linear + gelu, an add + layer norm."""
    import torch
    import torch.nn.functional as F

    def block(x, wq, wk, wv, wo, r):
        a = torch.matmul(F.linear(x, wq), F.linear(x, wk).transpose(-1, -2)) * 0.125
        o = torch.matmul(F.dropout(F.softmax(a, dim=-1), 0.0, False), F.linear(x, wv))
        h = F.gelu(F.linear(o, wo))
        return F.layer_norm(h + r, (8,))

    graphs = []
    torch.compile(block, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)(
        *(torch.randn(2, 4, 8), *(torch.randn(8, 8) for _ in range(4)), torch.randn(2, 4, 8)))
    return graphs[0].graph


def test_the_patterns_a_ddp_split_cuts_are_named_once_with_their_pieces():
    from kpt_compiler.distributed import cut_patterns

    graph = _graph()
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]  # as DDPOptimizer's partition
    x = next(n for n in graph.nodes if n.op == "placeholder")
    kinds = [ir.kind(n) for n in nodes]
    assert cut_patterns({n: 0 for n in nodes}) == []  # one piece: nothing cut

    def cut_before(kind: str, nth: int = 0) -> dict:  # nodes before the nth node of a kind in piece 0, the rest 1
        at = [i for i, k in enumerate(kinds) if k == kind][nth]
        return {n: int(i >= at) for i, n in enumerate(nodes)}

    assert [(p, w) for p, w, _ in cut_patterns(cut_before("linear", 1))] == [
        (0, f"3 parallel linears of {x.name} (from {nodes[kinds.index('linear')].name})")]
    (piece, what, pieces), = cut_patterns(cut_before("matmul", 1))  # the softmax in 0, its second product in 1
    assert piece == 0 and what.startswith("attention (from ") and pieces == [0, 1]
    assert [w.split(" (")[0] for _, w, _ in cut_patterns(cut_before("gelu"))] == ["a linear and its epilogue"]
    assert [w.split(" (")[0] for _, w, _ in cut_patterns(cut_before("layer_norm"))] == ["add + layer_norm"]
    # a cut elsewhere leaves them whole: after the attention, before the next linear
    assert cut_patterns(cut_before("linear", 3)) == []


def test_a_ddp_piece_names_the_patterns_its_cut_runs_through(tmp_path):
    """One gloo process: a small Llama's 1 MB DDP buckets end between its gate and up projections; the piece that
    holds the first of them says so, and only that piece."""
    pytest.importorskip("transformers")  # the zoo's Llama (not in the torch 2.9 + torch_xla environment)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import kpt_compiler
    from kpt_compiler.bench import first_tensor
    from kpt_compiler.models.zoo import build

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net, make = build("llama", attn="eager", n_layer=2, hidden=256, heads=4, kv_heads=2, intermediate=1024)
        compiled = torch.compile(DDP(net, bucket_cap_mb=1), backend="kernelpytorch", options={"codegen": "eager"})
        first_tensor(compiled(*make(2, 16, "cpu"))).float().pow(2).mean().backward()
    finally:
        dist.destroy_process_group()
    misses = [n for r in kpt_compiler.reports() for n in r.notes if n.startswith("DDP split near miss")]
    assert len(misses) == 2 and all("2 parallel linears of" in n and "no pass sees it whole" in n for n in misses), \
        misses  # gate and up of each layer
    assert len({n.split("runs through")[0] for n in misses}) == 2  # two different cuts, each said once
    for report in kpt_compiler.reports():  # said by the piece that holds the pattern's first node
        piece = report.notes[0].split("(")[1].split(")")[0]
        assert all(n.startswith(f"DDP split near miss: the cut between {piece} and ") for n in report.notes[1:]), \
            report.notes
