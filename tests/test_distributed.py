"""kernelpytorch under torch.distributed on the CPU (issue 20): two gloo processes train a small GPT one step
compiled with our backend (codegen eager), bare, under DDP (whose DDPOptimizer cuts Dynamo's graph at
gradient-bucket boundaries), under DDP with ``optimize_ddp`` off (one graph), and under FSDP2 (``fully_shard``).
tests/distributed_runs.py runs them and says what is asserted; tests/gpu/test_distributed_gpu.py runs the same
under NCCL on two GPUs."""

import pytest

import distributed_runs as runs


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
