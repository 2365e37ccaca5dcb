"""kernelpytorch under torch.distributed on two GPUs with NCCL (issue 20): the runs of tests/test_distributed.py
(bare, DDP split, DDP whole, FSDP2) with Inductor generating the code, and the fp8 pass under FSDP2, whose
weights are all-gathered in their own precision and cast to fp8 inside the compiled graph."""

import pytest
import torch

import distributed_runs as runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < runs.WORLD, reason="needs two GPUs")]


def test_ddp_and_fsdp2_under_nccl_match_one_process_and_report_per_rank(tmp_path):
    results, reference = runs.spawn(tmp_path, "nccl", {})
    # fp32 with Inductor's and our Triton kernels on the GPU against float64 on the CPU
    runs.check_runs(tmp_path, results, reference, tolerance=1e-3)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9), reason="needs fp8")
def test_fp8_under_fsdp2_is_as_accurate_as_fp8_in_one_process(tmp_path):
    results, reference = runs.spawn(tmp_path, "nccl", {"fp8": {"decide": "always"}}, which=runs.FP8_RUNS)
    print(runs.check_fp8(results, reference))
