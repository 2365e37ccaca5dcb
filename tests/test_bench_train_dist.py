"""benchmarks/bench_train_dist.py (issue 20's training benchmark) on the CPU with gloo: one process and two under
DDP, kpt and Inductor timed in turn in the same processes. The two-GPU figures come from the lent GPUs."""

import json

import pytest

from benchmarks import bench_train_dist


@pytest.mark.inductor
def test_one_and_two_processes_write_rows_with_scaling_and_what_fired(tmp_path, capsys):
    assert bench_train_dist.main(["--device", "cpu", "--modes", "inductor,kpt", "--setups", "1gpu,ddp", "--steps",
                                  "5", "--out", str(tmp_path), "--profile", str(tmp_path / "prof"), "--batch", "3",
                                  "--timeout", "600"]) == 0
    record = json.loads((tmp_path / "bench_train_dist.json").read_text())
    assert all(r["shape"].startswith("3x") for r in record["rows"]), record["rows"]  # --batch: sequences per GPU
    assert record["card"] == "cpu" and "--out " + str(tmp_path) in record["command"] and record["commit"]
    one_ind, one, ddp_ind, ddp = record["rows"]
    assert [r["mode"] for r in record["rows"]] == ["inductor", "kpt"] * 2 and all(r["steps"] == 5 for r in record["rows"])
    # two backends in one process: each model compiled by its own (our backend compiles no graph of Inductor's
    # model, which runs none of our passes), from the same weights to the same loss
    assert one_ind["graphs"] == ddp_ind["graphs"] == 0 and one_ind["fired"] == ddp_ind["fired"] == []
    assert one_ind["first_loss"] == pytest.approx(one["first_loss"], rel=1e-3)
    assert ddp["vs_inductor"] == pytest.approx(ddp_ind["ms"] / ddp["ms"])
    assert (one["setup"], one["gpus"], ddp["setup"], ddp["gpus"]) == ("1gpu", 1, "ddp", 2), record["rows"]
    for row in (one, ddp):
        assert "error" not in row and "attention" in row["fired"], row
        assert row["tokens_s"] == pytest.approx(row["gpus"] * 3 * 32 / (row["ms"] / 1e3))  # tiny-gpt: 3x32 a rank
        assert row["first_loss"] > 1.0, row  # the targets are not the inputs: a model that copies is no help
    assert ddp["scaling"] == pytest.approx(ddp["tokens_s"] / one["tokens_s"]) and one["scaling"] == 1.0
    assert ddp["ddp_pieces"] == ddp["graphs"] > 1 and one["ddp_pieces"] == 0, (one, ddp)  # DDPOptimizer's cut
    for row in record["rows"]:  # profiled on rank 0 after the timing: the CPU has no device time to split
        assert row["profile_wall_ms"] > 0 and row["nccl_ms"] == row["device_ms"] == row["nccl_exposed_ms"] == 0, row
        assert "aten::" in (tmp_path / "prof" / f"{row['setup']}-{row['mode']}.txt").read_text()
    table = (tmp_path / "bench_train_dist.md").read_text()
    assert "| tiny-gpt | 3x32 | ddp | 2 | kpt |" in table and f"{ddp['scaling']:.2f}x" in table


def test_an_unknown_setup_is_an_error_that_names_the_known_ones():
    with pytest.raises(SystemExit, match="unknown setup.*1gpu, ddp, fsdp2"):
        bench_train_dist.main(["--device", "cpu", "--setups", "1gpu,zero3"])


def test_the_profile_counts_kernels_not_the_annotations_recorded_on_the_device():
    """The H100 profile of session 18 counted DDP's forward range and the optimizer's as device time (DDP's
    step looked twice the one-GPU step); only kernels count now."""
    from benchmarks.bench_train_dist import _annotation

    for name in ("DistributedDataParallel.forward", "Optimizer.step#AdamW.step", "nccl:all_reduce",
                 "record_param_comms", "aten::mm", "ProfilerStep#3"):
        assert _annotation(name), name
    for name in ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                 "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "triton_poi_fused__unsafe_view_mul_silu_3",
                 "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymou..."):
        assert not _annotation(name), name


def test_the_timeline_counts_communication_that_no_kernel_runs_beside():
    """Whether DDP's all-reduce hides behind the backward: the device's busy time and the time a communication
    kernel ran with nothing else beside it, from kernel spans on several streams (us)."""
    from benchmarks.bench_train_dist import timeline

    spans = [(0, 10, False), (5, 20, False),  # compute 0-20
             (15, 30, True),  # all-reduce 15-30: 5 hidden, 10 alone
             (25, 28, False),  # a kernel beside it: 3 more hidden
             (40, 45, True), (42, 50, True)]  # alone, overlapping each other: 10
    busy, alone = timeline(spans)
    assert busy == 30 + 10 and alone == 7 + 10
    assert timeline([]) == (0, 0) and timeline([(0, 5, False)]) == (5, 0)


def test_cuda_graph_modes_compare_with_inductor_under_graphs():
    """kpt-ro's "vs Inductor" is against inductor-ro, kpt's against inductor; scaling against the same mode."""
    rows = [{"setup": s, "mode": m, "ms": ms, "tokens_s": t} for s, m, ms, t in (
        ("1gpu", "inductor", 20.0, 100.0), ("1gpu", "kpt", 16.0, 125.0), ("1gpu", "inductor-ro", 10.0, 200.0),
        ("1gpu", "kpt-ro", 8.0, 250.0), ("ddp", "kpt-ro", 12.0, 333.0), ("1gpu", "kpt-cg", 9.0, 222.0))]
    bench_train_dist.add_ratios(rows)
    by = {(r["setup"], r["mode"]): r for r in rows}
    assert by["1gpu", "kpt"]["vs_inductor"] == pytest.approx(20 / 16)
    assert by["1gpu", "kpt-ro"]["vs_inductor"] == pytest.approx(10 / 8)
    assert by["1gpu", "kpt-cg"]["vs_inductor"] == pytest.approx(10 / 9)  # kpt's pass capturing: against graphs too
    assert "vs_inductor" not in by["1gpu", "inductor-ro"] and "vs_inductor" not in by["ddp", "kpt-ro"]
    assert by["ddp", "kpt-ro"]["scaling"] == pytest.approx(333 / 250)
    with pytest.raises(SystemExit, match="unknown mode"):
        bench_train_dist.main(["--device", "cpu", "--modes", "kpt,kpt-fast"])


def test_a_setup_whose_processes_do_not_finish_is_killed_and_says_so():
    import time

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish in 3 s"):
        bench_train_dist.spawn_with_timeout(bench_train_dist._sleep, (600,), 1, 3)
    assert time.monotonic() - start < 60


def test_the_profile_counts_what_the_cudagraph_trees_copy_into_their_graphs(monkeypatch):
    """Per graph input, the copies the trees make before a replay (the inputs not static, not an earlier
    graph's output), and the method is put back afterwards."""
    import types

    import torch
    from torch._inductor import cudagraph_trees as trees

    calls = []
    monkeypatch.setattr(trees.CUDAGraphNode, "_copy_inputs_and_remove_from_src",
                        lambda node, dsts, srcs: calls.append(len(srcs)))
    before = trees.CUDAGraphNode._copy_inputs_and_remove_from_src
    node = types.SimpleNamespace(non_static_input_idx=[0, 2],
                                 wrapped_function=types.SimpleNamespace(placeholders=[
                                     types.SimpleNamespace(name=n) for n in ("tangents_1", "primals_3", "mask")]))
    with bench_train_dist._graph_copies() as copies:
        for _ in range(2):
            trees.CUDAGraphNode._copy_inputs_and_remove_from_src(
                node, [None] * 3, [torch.ones(4, 8), torch.ones(1), torch.ones(2, dtype=torch.bfloat16)])
    assert copies == {"tangents_1": [2, 2 * 128], "mask": [2, 2 * 4]}, copies  # primals_3 is static
    assert calls == [3, 3] and trees.CUDAGraphNode._copy_inputs_and_remove_from_src is before
