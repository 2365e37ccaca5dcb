"""Benchmarks: kernelpytorch against eager and Inductor on real models, run from the repository root.

    python -m benchmarks.run --suite quick --device cuda --out DIR   # the model zoo, every mode, one process
    python -m benchmarks.compare OLD.json NEW.json                   # what got slower or less accurate
    python -m benchmarks.ceilings                                    # copy bandwidth and GEMM TFLOP/s here

Timings are outputs with the command that made them, never a pass/fail test.
"""
