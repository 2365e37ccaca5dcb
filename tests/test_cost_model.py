"""The cost model: calibration files per card, dtype and kernel source; the nearest-shape rule; host time
without CUDA graphs; the decision cache. CUDA targets are faked (``Target("cuda", name, capability)``): the
answers depend on the target and the files, not on a GPU being here."""

import json
import math

import pytest
import torch

from kpt_compiler import cost_model as cm
from kpt_compiler.kernels import gated_linear
from kpt_compiler.target import Target

H100 = Target("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
A100 = Target("cuda", "NVIDIA A100-SXM4-80GB", (8, 0))
CEILINGS = {"tflops": 700.0, "copy_tbps": 3.0, "kernel_floor_us": 3.0, "run": 0}


def merged(x, weights, biases, widths):  # stands in for a rule's replacement function (source of "horizontal")
    return torch.split(torch.nn.functional.linear(x, torch.cat(weights)), widths, -1)


def _points(*rows):
    return [{"M": m, "K": k, "N": n, "speedup": s, "run": 0} for m, k, n, s in rows]


def _write(directory, target=H100, tables=None, host=None, source=None):
    """A calibration file for ``target`` in ``directory`` (the format of kpt_compiler/calibration/README.md)."""
    data = {
        "device": {"name": target.name, "capability": list(target.capability)},
        "runs": [{"command": "python -m benchmarks.calibrate", "date": "2026-11-26", "commit": "abc1234",
                  "torch": "2.11.0", "triton": "3.6.0"}],
        "ceilings": CEILINGS,
        "device_time": {kind: {"bfloat16": {"source": source or cm.source_hash(src), "points": points}}
                        for kind, (src, points) in (tables or {}).items()},
        "host_us": host or {},
    }
    path = directory / cm.calibration_file(target.name, target.capability)
    path.write_text(json.dumps(data))
    return path


def gemm(kind="gated_linear", M=8192, K=1024, N=2816, dtype=torch.bfloat16, source=gated_linear, **kw):
    return cm.Candidate(kind, M, {"K": K, "N": N}, dtype, source, mkn=(M, K, N), **kw)


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    monkeypatch.setenv("KPT_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.setenv("KPT_CACHE_DIR", str(tmp_path / "cache"))
    _write(tmp_path, tables={
        "gated_linear": (gated_linear, _points((8192, 1024, 2816, 1.39), (128, 1024, 2816, 1.41),
                                               (8192, 4096, 14336, 0.84))),
        "horizontal": (merged, _points((1, 1024, 1536, 1.81), (128, 1024, 1536, 1.74))),
    }, host={"gated_linear": {"inference": 53.5, "triton": 12.4, "inductor": 36.9, "run": 0}})
    return tmp_path


def test_file_names_say_the_card_and_its_capability():
    assert cm.calibration_file("NVIDIA H100 80GB HBM3", (9, 0)) == "nvidia-h100-80gb-hbm3.sm90.json"
    assert cm.calibration_file("NVIDIA H200", (9, 0)) == "nvidia-h200.sm90.json"


def test_the_nearest_calibrated_shape_decides_and_the_reason_names_the_card(calibrated):
    model = cm.CostModel(H100, "reduce-overhead")  # CUDA graphs: device time alone
    win = model.decide("auto", gemm(M=4096))
    assert win.rewrite and "1.39x over Inductor's device time measured on NVIDIA H100 80GB HBM3 (sm_90) at " \
        "M,K,N=8192,1024,2816" in win.why and "2026-11-26, commit abc1234" in win.why, win.why
    loss = model.decide("auto", gemm(M=8192, K=4096, N=11008))
    assert not loss.rewrite and "0.84x" in loss.why
    assert model.decide("always", gemm(M=8192, K=4096, N=11008)).rewrite


def test_a_card_without_a_file_declines_and_says_measure_would_time_it(calibrated):
    for target in (A100, Target("cuda", "NVIDIA H100 80GB HBM3", (9, 1)), Target("cuda", "NVIDIA H100 PCIe", (9, 0))):
        d = cm.CostModel(target).decide("auto", gemm(M=4096))
        assert not d.rewrite and f"no calibration for {target.card}" in d.why and "decide='measure'" in d.why, d.why
        assert cm.CostModel(target).calibration is None
    assert cm.CostModel(H100).calibration.card == "NVIDIA H100 80GB HBM3 (sm_90)"


def test_a_dtype_without_a_table_declines_at_every_size(calibrated):
    """fp16 has no table (the file's are bf16's): no rewrite at any size, and the reason names decide='measure'.
    (q/k/v merging once had a row threshold for such cases and took 8192 rows, where bf16 measured no gain.)"""
    for kind, source in (("gated_linear", gated_linear), ("horizontal", merged), ("linear_epilogue", gated_linear)):
        for M in (1, 128, 8192):
            d = cm.CostModel(H100).decide("auto", gemm(kind, M=M, N=1536, dtype=torch.float16, source=source))
            assert not d.rewrite and "no calibrated win" in d.why and "measure" in d.why, (kind, M, d.why)


def test_a_table_measured_with_other_kernel_source_declines(tmp_path, monkeypatch):
    monkeypatch.setenv("KPT_CALIBRATION_DIR", str(tmp_path))
    _write(tmp_path, tables={"gated_linear": (gated_linear, _points((8192, 1024, 2816, 1.39)))}, source="0" * 16)
    d = cm.CostModel(H100, "reduce-overhead").decide("auto", gemm())
    assert not d.rewrite and "calibrated with kernel source 0000000000000000" in d.why, d.why
    assert cm.source_hash(gated_linear) in d.why and "benchmarks.calibrate" in d.why


def test_source_hash_ignores_comments_and_docstrings_but_not_code():
    base = 'def f(x):\n    """doc"""\n    return x + 1  # one\n'
    assert cm._code_text(base) == cm._code_text('def f(x):\n    """other doc"""\n\n    return x + 1  # two\n')
    assert cm._code_text(base) != cm._code_text(base.replace("x + 1", "x + 2"))
    assert cm._code_text('s = f"{a} b"  # c\n') == 's = f"{a} b"'  # f-strings kept as written


def test_a_calibration_answers_only_near_the_shapes_it_measured(calibrated):
    """BERT's q/k/v at 16384 rows against a table measured at 1 and 128 rows, where merging saves launches:
    its 1.74x says nothing there, so the cost model declines and names decide='measure'. At the zoo Llama's
    128 rows the same table decides."""
    model = cm.CostModel(H100, "reduce-overhead")

    def horizontal(M, K=1024, Ns=(1024, 256, 256)):
        return cm.Candidate("horizontal", M, {"K": K, "N": list(Ns)}, torch.bfloat16, merged, mkn=(M, K, sum(Ns)))

    far = model.decide("auto", horizontal(16384, 768, (768,) * 3))
    assert not far.rewrite and "no shape calibrated on NVIDIA H100 80GB HBM3 (sm_90) within 4x" in far.why, far.why
    near = model.decide("auto", horizontal(128))
    assert near.rewrite and "1.74x" in near.why, near.why
    assert model.decide("auto", horizontal(128 * 4)).rewrite and not model.decide("auto", horizontal(128 * 5)).rewrite


def test_a_kernel_faster_on_the_device_but_slower_to_issue_loses_only_where_launches_dominate(calibrated):
    """The zoo Llama's gated MLP: 1.41x on the device at 128 x 1024 x 2816 and 1.39x at 8192 tokens, but as the
    inference op 17 us slower to issue than Inductor's three calls. Without CUDA graphs it must lose at 128
    tokens (host time dominates) and still win at 8192 (device time dominates); as the triton_op form (24 us
    faster to issue than Inductor's calls) it wins at 128 too; under CUDA graphs host time does not count."""
    def at(M, form="inference"):
        return gemm(M=M, form=form, gemm_ns=[2816, 2816], unfused_kernels=3)

    model = cm.CostModel(H100, "default")
    small, big = model.decide("auto", at(128)), model.decide("auto", at(8192))
    assert not small.rewrite and "host 54" in small.why and "without CUDA graphs" in small.why, small.why
    assert big.rewrite, big.why
    assert model.decide("auto", at(128, "triton")).rewrite
    graphs = cm.CostModel(H100, "reduce-overhead").decide("auto", at(128))
    assert graphs.rewrite and "without CUDA graphs" not in graphs.why
    est = cm.CostModel._inductor_device_us(model.calibration, at(128))
    assert 10 < est < 17, est  # bench_dispatch measured Inductor's three kernels at 13.3 us on the H100


def test_measured_decisions_are_cached_per_card_and_source(calibrated, monkeypatch):
    model = cm.CostModel(H100)
    c = gemm(M=4096, K=4096, N=14336)  # far from every calibrated shape: the table declines
    assert not model.decide("auto", c).rewrite
    cm._store(model._key(c, cm.source_hash(c.source)), {"rewrite": True, "ours_ms": 0.01, "inductor_ms": 0.02})  # as "measure" leaves it
    d = model.decide("auto", c)
    assert d.rewrite and "measured earlier" in d.why
    assert not cm.CostModel(A100).decide("auto", c).rewrite  # another card: not its measurement
    monkeypatch.setattr(cm, "source_hash", lambda source: "changed")  # the kernel changed: not its measurement
    assert "measured earlier" not in model.decide("auto", c).why


def test_on_the_cpu_never():
    d = cm.CostModel(Target("cpu", "cpu")).decide("auto", gemm())
    assert not d.rewrite and "eager reference" in d.why


def test_the_committed_calibrations_hold_their_promises():
    """Each file under kpt_compiler/calibration names its card as its file name does, every entry names the run
    (command, date, commit) that measured it, and its kernel sources are today's (a kernel changed since its
    calibration would make the cost model decline on that card: python -m benchmarks.calibrate again)."""
    from kpt_compiler.kernels import fp4_linear, layer_norm, linear_epilogue, rms_norm, sparse24_linear
    from kpt_compiler.passes import _fp8_recipes, _fp8_static
    from kpt_compiler.passes.merge_parallel_linears import merged_linear

    sources = {"gated_linear": gated_linear, "linear_epilogue": linear_epilogue,
               "linear_epilogue_vs_gemm": linear_epilogue, "horizontal": merged_linear, "add_rms_norm": rms_norm,
               "add_layer_norm": layer_norm}
    sources.update({f"fp8_linear_{r}{t}": _fp8_recipes for r in ("tensorwise", "rowwise") for t in ("", "_train")})
    sources.update({f"fp8_linear_{r}_static": _fp8_static for r in ("tensorwise", "rowwise")})
    sources.update({f"fp4_linear_{f}": fp4_linear for f in ("nvfp4", "mxfp4")})
    sources["sparse24_linear"] = sparse24_linear
    files = sorted(cm.CALIBRATION_DIR.glob("*.json"))
    for path in files:
        data = json.loads(path.read_text())
        assert path.name == cm.calibration_file(data["device"]["name"], tuple(data["device"]["capability"]))
        runs = data["runs"]
        assert runs and all(r["command"] and r["date"] and r["commit"] for r in runs), path
        assert 0 <= data["ceilings"]["run"] < len(runs)
        for kind, by_dtype in data["device_time"].items():
            for dtype, table in by_dtype.items():
                assert table["source"] == cm.source_hash(sources[kind]), (path.name, kind, dtype)
                for p in table["points"]:
                    assert 0 <= p["run"] < len(runs) and p["speedup"] > 0 and math.isfinite(p["speedup"]), p
        for kind, host in data["host_us"].items():
            assert {"inference", "triton", "inductor"} <= set(host) and 0 <= host["run"] < len(runs), (kind, host)


def test_the_committed_h100_file_is_used_on_an_h100_and_no_other_card(monkeypatch):
    monkeypatch.delenv("KPT_CALIBRATION_DIR", raising=False)
    if not (cm.CALIBRATION_DIR / cm.calibration_file(H100.name, H100.capability)).exists():
        pytest.skip("no H100 calibration committed")
    assert cm.CostModel(H100).calibration.card == H100.card
    d = cm.CostModel(A100).decide("auto", gemm())
    assert not d.rewrite and "no calibration for NVIDIA A100-SXM4-80GB (sm_80)" in d.why, d.why


def test_without_host_times_a_card_declines_where_no_cuda_graph_replays_the_calls(tmp_path, monkeypatch):
    """A file measured with --tables gated_linear alone: device time speaks under CUDA graphs, and where host
    time would count the answer is no, with the command that measures it."""
    monkeypatch.setenv("KPT_CALIBRATION_DIR", str(tmp_path))
    _write(tmp_path, tables={"gated_linear": (gated_linear, _points((128, 1024, 2816, 1.41)))})
    c = gemm(M=128, gemm_ns=[2816, 2816], unfused_kernels=3)
    assert cm.CostModel(H100, "reduce-overhead").decide("auto", c).rewrite
    d = cm.CostModel(H100, "default").decide("auto", c)
    assert not d.rewrite and "no host times" in d.why and "--tables host,ceilings" in d.why, d.why


@pytest.mark.parametrize("ours_ms, theirs_ms", [(1.0, 2.0), (2.0, 1.0)])
def test_measure_times_both_and_keeps_the_faster(tmp_path, monkeypatch, ours_ms, theirs_ms):
    """decide='measure' with a fake timer: ours is taken only when it times faster, and the answer is cached
    (decide='auto' then reuses it)."""
    from kpt_compiler import bench

    monkeypatch.setenv("KPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KPT_CALIBRATION_DIR", str(tmp_path))  # no file: only the measurement can say yes
    calls = []

    def ours():
        calls.append("ours")

    monkeypatch.setattr(bench, "median_ms", lambda fn, device, **kw: (fn(), ours_ms)[1])
    c = gemm(M=4096, ours=ours, baseline_ms=lambda: theirs_ms)
    d = cm.CostModel(H100).decide("measure", c)
    assert d.rewrite == (ours_ms < theirs_ms) and calls == ["ours"], d.why
    assert f"ours {ours_ms:.4f} ms, Inductor at best {theirs_ms:.4f} ms" in d.why
    again = cm.CostModel(H100).decide("auto", gemm(M=4096))
    assert again.rewrite == d.rewrite and "measured earlier" in again.why


def test_an_fp4_table_from_calibrate_decides_the_fp4_pass_per_shape(tmp_path, monkeypatch):
    # benchmarks.calibrate --tables fp4_linear_nvfp4 writes the table the fp4 pass asks for (passes/fp4._decide):
    # the GEMV pays at one row, the dot form does not at 256 (the H200's figures, s15)
    from benchmarks import calibrate
    from kpt_compiler.kernels import fp4_linear

    assert set(calibrate.FP4_TABLES) == {f"fp4_linear_{f}" for f in ("nvfp4", "mxfp4")}
    monkeypatch.setenv("KPT_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.setenv("KPT_CACHE_DIR", str(tmp_path / "cache"))
    points = _points((1, 4096, 14336, 1.58), (256, 4096, 14336, 0.8))
    _write(tmp_path, tables={"fp4_linear_nvfp4": (fp4_linear, points)})
    model = cm.CostModel(H100, "reduce-overhead")

    def fp4(M):
        return cm.Candidate("fp4_linear_nvfp4", M, {"K": 4096, "N": 14336}, torch.bfloat16, fp4_linear,
                            mkn=(M, 4096, 14336))

    assert model.decide("auto", fp4(1)).rewrite and not model.decide("auto", fp4(256)).rewrite
    d = model.decide("auto", cm.Candidate("fp4_linear_mxfp4", 1, {"K": 4096, "N": 14336}, torch.bfloat16,
                                          fp4_linear, mkn=(1, 4096, 14336)))
    assert not d.rewrite and "no calibrated win" in d.why, d.why  # the other format has its own table


def test_a_source_hash_is_kept_on_disk_by_the_texts_themselves(tmp_path, monkeypatch):
    """Tokenizing kernel files costs a warm compile 0.18 s on the H100 (cost_model._hash_texts), so the hash of
    a text is kept on disk keyed by the text's bytes: a new process reads it without tokenizing, and any change
    of a byte (a comment included) computes it again."""
    monkeypatch.setenv("KPT_CACHE_DIR", str(tmp_path))
    text = "def f(x):\n    return x + 1  # one\n"
    first = cm._hash_texts([text])
    assert (tmp_path / "source_hashes.json").exists()

    def no_tokenizing(_text):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(cm, "_code_text", no_tokenizing)
    assert cm._hash_texts([text]) == first  # read from the file
    with pytest.raises(AssertionError, match="tokenized again"):
        cm._hash_texts([text.replace("# one", "# two")])  # another text: computed, not read
    monkeypatch.undo()
    monkeypatch.setenv("KPT_CACHE_DIR", str(tmp_path))
    assert cm._hash_texts([text.replace("# one", "# two")]) == first  # comments aside, the same code
    assert cm._hash_texts([text.replace("x + 1", "x + 2")]) != first
