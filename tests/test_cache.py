"""Inductor's caches key on our pipeline: a changed option never brings back an artifact compiled by
another pipeline, and the same options still hit the cache."""

import pytest
import torch
from torch._dynamo.utils import counters

import kpt_compiler


@pytest.mark.inductor
def test_changed_options_never_return_a_stale_artifact(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor import config

    with config.patch(fx_graph_cache=True, force_disable_caches=False):
        _check_cache_keys()


def _check_cache_keys():
    f = lambda x: torch.relu(x) * 2 + 1  # noqa: E731
    x = torch.randn(64)

    def run(options):
        torch._dynamo.reset()
        with torch.no_grad():
            return torch.compile(f, backend="kernelpytorch", options=options)(x)

    counters.clear()
    scaled = run({"test_scale_outputs": {"factor": 3.0}})
    torch.testing.assert_close(scaled, 3 * f(x))
    # Same graph, other options: Inductor must not hand back the tripled artifact.
    plain = run({})
    torch.testing.assert_close(plain, f(x))
    other_factor = run({"test_scale_outputs": {"factor": 5.0}})
    torch.testing.assert_close(other_factor, 5 * f(x))
    assert counters["inductor"]["fxgraph_cache_hit"] == 0
    # The first options again: now a cache hit, with the right result.
    again = run({"test_scale_outputs": {"factor": 3.0}})
    torch.testing.assert_close(again, 3 * f(x))
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1
    # the passes did not run this time, and the report says so instead of pretending
    report = kpt_compiler.last_report()
    assert "forward" not in report.stages
    assert any("came from Inductor's cache" in note for note in report.notes)
    assert "came from Inductor's cache" in report.table()
