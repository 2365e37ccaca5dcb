"""Does the fp4 kernel code at HEAD run what 68e0d69's H100 fp4 tables measured? (python scripts/fp4_source_move_check.py)

s48 measured the tables at 68e0d69, then moved the CUDA source into kernels/_fp4_cuda_source.py and gave ``config``
the device's shared memory (the x ring's 168 KB pick only where a block may have it), which changes fp4_linear's
source hash with no device time left to measure again. This prints what ``cost_model.source_hash`` hashes (each
SOURCE_MODULES file's code, without comments, docstrings and layout) where it differs from 68e0d69's, apart from the
move, and checks what the H100 runs: the CUDA source byte for byte, and the launch configs at every M, N and K below
for 132 SMs and sm_90's 227 KB."""
import difflib
import importlib.util
import subprocess
import sys
import tempfile

sys.path.insert(0, ".")
from kpt_compiler.cost_model import _code_text  # noqa: E402
from kpt_compiler.kernels import _fp4_cuda, fp4_linear  # noqa: E402

OLD = "68e0d69"


def text_at(name: str) -> str:
    return subprocess.run(["git", "show", f"{OLD}:kernels/{name}.py"], capture_output=True, text=True, check=True).stdout


def new(name: str) -> str:
    return _code_text(open(f"kernels/{name}.py").read())


def differences(a: str, b: str) -> list[str]:
    """The code texts' differences, word by word (the texts are words joined by single spaces)."""
    x, y = a.split(" "), b.split(" ")
    ops = difflib.SequenceMatcher(None, x, y, autojunk=False).get_opcodes()
    return [f"  {op}: {' '.join(x[i1:i2])!r} -> {' '.join(y[j1:j2])!r}" for op, i1, i2, j1, j2 in ops if op != "equal"]


print("SOURCE_MODULES now:", fp4_linear.SOURCE_MODULES)
for name in fp4_linear.SOURCE_MODULES:
    if name == "_fp4_cuda_source":
        continue
    a, b = _code_text(text_at(name)), new(name)
    if name == "_fp4_cuda":  # the moved code back where it was, after MAX_M's line
        moved = new("_fp4_cuda_source").replace("from __future__ import annotations ", "", 1)
        b = " ".join(b.replace("from ._fp4_cuda_source import SOURCE, chunk_from_shared, edited ", "")
                     .replace("MAX_M = 16 ", "MAX_M = 16 " + moved + " ", 1).split())
    diff = differences(a, b)
    print(f"{name}: code text {'the same' if not diff else 'differs'}" + (" (the move undone)" if name == "_fp4_cuda"
                                                                        else ""))
    if diff:
        print("\n".join(diff))

with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
    f.write(text_at("_fp4_cuda"))
    f.flush()
    spec = importlib.util.spec_from_file_location("kpt_compiler.kernels._fp4_cuda_at_old", f.name)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
print("the CUDA source byte for byte as at", OLD, ":", old.SOURCE == _fp4_cuda.SOURCE)
shapes = [(m, n, k) for m in range(1, 17) for n in (16, 1000, 2048, 4096, 4096 + 16 * 2 * 132, 11008, 14336, 16917,
                                                     28672, 32000) for k in (128, 1024, 4096, 128 * 47, 6144, 14336)]
same = [old.config(m, n, k, 132) == _fp4_cuda.config(m, n, k, 132, 227 * 1024) for m, n, k in shapes]
print(f"config at 132 SMs and 227 KB as at {OLD}: {sum(same)} of {len(shapes)} shapes")
