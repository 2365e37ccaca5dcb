"""benchmarks/bench_sparsity.py (issue 19's 2:4 microbenchmark) on the CPU: the smoke run's files and table, its
dense references and the cost of pruning random weights. The sparse kernels themselves need CUDA (the H100 run)."""

import json
import re

from benchmarks import bench_sparsity


def test_the_smoke_run_writes_a_row_per_shape_and_m_with_references_and_pruning_sqnr(tmp_path):
    assert bench_sparsity.main(["--device", "cpu", "--ms", "16,64", "--rep-ms", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "bench_sparsity.json").read_text())
    table = (tmp_path / "bench_sparsity.md").read_text()
    assert record["card"] == "cpu" and record["command"].endswith("--out " + str(tmp_path)) and "commit" in record
    asked = [(n, k, m) for n, k in bench_sparsity.TINY for m in (16, 64)]  # in this order
    assert [(r["N"], r["K"], r["M"]) for r in record["rows"]] == asked
    assert {tuple(int(v) for v in re.match(r"\| tiny \| (\d+)x(\d+) \| (\d+) \|", line).groups())
            for line in table.splitlines() if line.startswith("| tiny |")} == set(asked)
    assert len([line for line in table.splitlines() if line.startswith("| tiny |")]) == len(asked)
    assert "REFERENCE" in table and "smoke test" in table  # the CPU's sparse columns are no timings
    for row in record["rows"]:
        assert row["reference"] and not row["unsupported"] and set(row["ms"]) == set(bench_sparsity.COLUMNS)
        # the references are the dense matmul of the pruned weight itself (fp8 + 2:4: of its dequantized operands)
        assert row["rel_err"]["2:4 cuSPARSELt"] < 1e-6 and row["rel_err"]["2:4 CUTLASS"] < 1e-6 and row["rel_err"]["2:4 kpt"] < 1e-6, row
        assert row["rel_err"]["fp8 + 2:4"] < 1e-5, row
        # magnitude 2:4 pruning of Gaussian weights keeps ~8.8 dB (keeping 3 of 4: ~15 dB, 1 of 4: ~4 dB, nothing
        # pruned: inf, everything: 0 dB); these rows measure 8.7 to 9.4
        assert 7.5 < row["sqnr_db"] < 10.5, row
    assert 8.3 < sum(r["sqnr_db"] for r in record["rows"]) / len(record["rows"]) < 9.6


def test_a_kernel_that_raises_is_a_cell_that_says_unsupported(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise RuntimeError("fp8 is not supported on this card " + "x" * 300)

    monkeypatch.setattr(bench_sparsity, "fp8_linear_static", refuse)
    assert bench_sparsity.main(["--device", "cpu", "--shapes", "32x64", "--ms", "3", "--rep-ms", "1",
                                "--out", str(tmp_path)]) == 0
    row, = json.loads((tmp_path / "bench_sparsity.json").read_text())["rows"]
    assert set(row["unsupported"]) == {"fp8 dense", "fp8 + 2:4", "fp8 + 2:4 scaled after"} and set(row["ms"]) == {
        "dense bf16", "2:4 cuSPARSELt", "2:4 CUTLASS", "2:4 kpt"}
    assert row["unsupported"]["fp8 dense"].startswith("RuntimeError: fp8 is not supported")
    assert len(row["unsupported"]["fp8 dense"]) == 200 and "fp8 + 2:4" not in row["rel_err"]
    line = capsys.readouterr().out.strip().splitlines()[-1]  # the table is printed last
    assert line.startswith("| tiny | 32x64 | 3 |")
    assert line.count("unsupported") == 3


def test_taken_layers_reads_the_layers_the_pass_took_at_the_rows_it_saw():
    """``--taken``'s source: the pass's own report, so a layer the gate takes is timed at its real shape."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 128),
                                torch.nn.Linear(128, 256)).to(torch.bfloat16).eval()  # the last: under 256
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    taken, misses = bench_sparsity.taken_layers(model, (x,), {"codegen": "eager", "sparsity_2_4": {
        "kernel": "dense", "min_features": 128}})
    assert [(n, k, m) for _, n, k, m in taken] == [(512, 256, 15), (128, 512, 15), (256, 128, 15)], taken
    assert not misses
    taken, misses = bench_sparsity.taken_layers(model, (x,), {"codegen": "eager", "sparsity_2_4": {
        "kernel": "dense"}})
    assert [(n, k) for _, n, k, _ in taken] == [(512, 256)], taken
    assert len(misses) == 2 and all("min_features" in m or "256" in m for m in misses), misses
