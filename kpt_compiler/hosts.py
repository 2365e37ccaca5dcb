"""Code generators that host the pipeline: Inductor (cuda and cpu), eager (cpu/cuda, for tests and
debugging) and torch_xla's dynamo bridge (xla).

Each host runs AOTAutograd and calls back into ``CompileRun.run_stage`` at the same four points, so a pass
sees the same kind of graph whichever host compiles it:

  pre_aot   in the backend, before the host is called
  joint     before the forward/backward split (partition), or on the inference graph
  forward   on the forward graph after the split
  backward  on the backward graph, when the backward is compiled

Inductor hosts the pipeline through its own hooks (``joint_custom_pre_pass``, ``post_grad_custom_pre_pass``),
so with no pass enabled a kernelpytorch compile is an Inductor compile. The eager host uses Inductor's
decompositions and partitioner so that its graphs match the ones Inductor's hooks see.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .pipeline import CompileRun

__all__ = ["inductor_config_patches", "compile_inductor", "compile_eager", "compile_xla", "HOSTS"]


def _stage_hook_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class StageHook(CustomGraphPass):
        """Runs one stage of our pipeline inside Inductor, then any custom pass the user had installed."""

        def __init__(self, run: CompileRun, stage: str | None, chained: Any = None):
            self.run, self.stage, self.chained = run, stage, chained

        def __call__(self, graph: fx.Graph) -> None:
            gm = graph.owning_module
            stage, is_inference = self.stage, None
            if stage is None:  # the post-grad hook: inner_compile below said which side this is
                stage, is_inference = self.run.host_stage[-1] if self.run.host_stage else ("forward", None)
            if not self.run.stage_done(gm, stage):
                self.run.run_stage(gm, stage, is_inference=is_inference)
            if self.chained is not None:
                self.chained(graph)

        def uuid(self) -> Any:
            chained = self.chained.uuid() if hasattr(self.chained, "uuid") else None
            return ("kernelpytorch", self.stage, self.run.fingerprint(), chained)

    return StageHook


def inductor_config_patches(run: CompileRun) -> dict[str, Any]:
    """The Inductor config one compile runs under: the mode's settings (as torch.compile gives Inductor),
    the user's options["inductor"], and our stage hooks chained in front of any custom pass already set."""
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    StageHook = _stage_hook_class()
    patches: dict[str, Any] = dict(list_mode_options(run.options.mode))
    patches.update(run.options.inductor)
    patches["joint_custom_pre_pass"] = StageHook(run, "joint", inductor_config.joint_custom_pre_pass)
    patches["post_grad_custom_pre_pass"] = StageHook(run, None, inductor_config.post_grad_custom_pre_pass)
    if run.dump is not None:
        # A cached artifact skips our hooks and the dump would miss stages: compile afresh when dumping.
        patches["fx_graph_cache"] = False
    return patches


def compile_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], run: CompileRun) -> Callable:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    patches = inductor_config_patches(run)
    caches = contextlib.nullcontext()
    if run.dump is not None:
        caches = torch._functorch.config.patch(enable_autograd_cache=False)

    def inner_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any):
        # Inductor says here which side of the split it compiles; the post-grad hook reads it.
        side = "backward" if kwargs.get("is_backward") else "forward"
        run.host_stage.append((side, bool(kwargs.get("is_inference", False))))
        try:
            return compile_fx_inner(gm, example_inputs, **kwargs)
        finally:
            run.host_stage.pop()

    with caches:
        compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
    missing = [stage for stage in ("joint", "forward") if stage not in run.report.stages]
    if missing:
        run.report.notes.append(
            f"stage(s) {', '.join(missing)}: the code came from Inductor's cache, so their passes did not run in "
            "this process (they ran when the entry was made); set dump_dir to compile afresh and see them run"
        )
    return compiled


def _boxed(gm: fx.GraphModule) -> Callable:
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


def _aot_host(run: CompileRun, finish: Callable[[fx.GraphModule, Sequence[Any]], Callable], *, partition: Callable,
              decompositions: Any) -> Callable:
    """AOTAutograd with our stages at its partition and compiler callbacks; ``finish`` generates code."""
    from torch._dynamo.backends.common import aot_autograd

    def partition_fn(joint: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        if not run.stage_done(joint, "joint"):
            run.run_stage(joint, "joint", is_inference=False)
        return partition(joint, joint_inputs, **kwargs)

    def fw_compiler(gm: fx.GraphModule, inputs: Sequence[Any]):
        run.run_stage(gm, "forward", is_inference=False)
        return finish(gm, inputs)

    def bw_compiler(gm: fx.GraphModule, inputs: Sequence[Any]):
        run.run_stage(gm, "backward", is_inference=False)
        return finish(gm, inputs)

    def inference_compiler(gm: fx.GraphModule, inputs: Sequence[Any]):
        run.run_stage(gm, "joint", is_inference=True)
        run.run_stage(gm, "forward", is_inference=True)
        return finish(gm, inputs)

    return aot_autograd(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        inference_compiler=inference_compiler,
        partition_fn=partition_fn,
        decompositions=decompositions,
        keep_inference_input_mutations=True,
    )


def compile_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], run: CompileRun) -> Callable:
    import functools

    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    host = _aot_host(
        run,
        lambda g, _inputs: _boxed(g),
        partition=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
        decompositions=select_decomp_table(),
    )
    return host(gm, example_inputs)


def compile_xla(gm: fx.GraphModule, example_inputs: Sequence[Any], run: CompileRun) -> Callable:
    """What torch's ``openxla`` backend does (aot_autograd around openxla_eval_boxed), with our stages."""
    from torch._dynamo.backends.torchxla import openxla_eval_boxed
    from torch._functorch.partitioners import default_partition

    host = _aot_host(run, openxla_eval_boxed, partition=default_partition, decompositions=None)
    return host(gm, example_inputs)


HOSTS = {"inductor": compile_inductor, "eager": compile_eager, "xla": compile_xla}
