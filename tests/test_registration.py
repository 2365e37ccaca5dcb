"""The backend is found by name in a process that never imports our package (the entry point), and
importing the package registers it too."""

import subprocess
import sys
import textwrap

import torch


def test_entry_point_in_a_fresh_process():
    script = textwrap.dedent("""
        import sys
        import torch
        assert "kpt_compiler" not in sys.modules
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        x = torch.randn(3, 4)
        compiled = torch.compile(model, backend="kernelpytorch", options={"codegen": "eager"})
        torch.testing.assert_close(compiled(x), model(x))
        import kpt_compiler  # only now, to read what happened
        assert kpt_compiler.last_report().codegen == "eager"
        print("ok", "kernelpytorch" in torch._dynamo.list_backends())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "True"]


def test_import_registers_the_backend():
    import kpt_compiler
    from torch._dynamo.backends.registry import lookup_backend

    assert "kernelpytorch" in torch._dynamo.list_backends()
    assert lookup_backend("kernelpytorch") is kpt_compiler.kernelpytorch


def test_decide_auto_means_measure_under_max_autotune():
    import dataclasses

    from kpt_compiler.registry import PassContext
    from kpt_compiler.target import Target

    @dataclasses.dataclass(frozen=True)
    class WithDecide:
        decide: str = "auto"

    def ctx(options, mode):
        return PassContext(options=options, target=Target("cpu", "cpu"), stage="pre_aot", is_inference=True, mode=mode)

    assert ctx(WithDecide(), "max-autotune").decide == "measure"
    assert ctx(WithDecide(), "default").decide == "auto"
    assert ctx(WithDecide("always"), "max-autotune").decide == "always"
    assert ctx(object(), "max-autotune").decide is None
