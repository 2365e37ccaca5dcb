"""Is the fp4 kernel code at HEAD the code that 68e0d69's H100 tables measured, up to moving SOURCE into
_fp4_cuda_source.py? Compares cost_model._code_text (what source_hash hashes: code without comments, docstrings
and layout) of each of fp4_linear's SOURCE_MODULES at 68e0d69 and in the working tree."""
import subprocess, sys
sys.path.insert(0, ".")
from kpt_compiler.cost_model import _code_text
from kpt_compiler.kernels import fp4_linear

OLD = "68e0d69"
def old(name): return _code_text(subprocess.run(["git", "show", f"{OLD}:kernels/{name}.py"], capture_output=True, text=True, check=True).stdout)
def new(name): return _code_text(open(f"kernels/{name}.py").read())

print("SOURCE_MODULES now:", fp4_linear.SOURCE_MODULES)
for name in fp4_linear.SOURCE_MODULES:
    if name in ("_fp4_cuda", "_fp4_cuda_source"):
        continue
    a, b = old(name), new(name)
    if name == "fp4_linear":
        a = a.replace('"_fp4_cuda", "_fp4_format"', '"_fp4_cuda", "_fp4_cuda_source", "_fp4_format"', 1)
    print(f"{name}: code text {'identical' if a == b else 'DIFFERS'}"
          + (" (after adding _fp4_cuda_source to SOURCE_MODULES)" if name == "fp4_linear" else ""))
imp = "from ._fp4_cuda_source import SOURCE, chunk_from_shared, edited "
moved = new("_fp4_cuda_source").replace("from __future__ import annotations ", "", 1)
assert new("_fp4_cuda").count(imp) == 1
rebuilt = new("_fp4_cuda").replace(imp, "").replace("MAX_M = 16 ", "MAX_M = 16 " + moved + " ", 1)
print("_fp4_cuda at", OLD, "== _fp4_cuda now with its import of _fp4_cuda_source replaced by that module's code:",
      " ".join(rebuilt.split()) == " ".join(old("_fp4_cuda").split()))
