"""Emitters: the code generators behind the ``codegen`` option, each running the pipeline's stages as it
compiles. Inductor (cuda and cpu), eager (cpu/cuda, for tests and debugging: runs the rewritten ATen graph as
it is) and torch_xla's dynamo bridge (xla).

Each emitter runs AOTAutograd and calls back into ``PassManager.run_stage`` at the same four points, so a pass
sees the same kind of graph whichever emitter compiles it:

  pre_aot   in the backend, before the emitter is called
  joint     before the forward/backward split (partition), or on the inference graph
  forward   on the forward graph after the split
  backward  on the backward graph, when the backward is compiled

Inductor runs the pipeline through its own hooks (``joint_custom_pre_pass``, ``post_grad_custom_pre_pass``),
so with no pass enabled a kernelpytorch compile is an Inductor compile. The eager emitter uses Inductor's
decompositions and partitioner so that its graphs match the ones Inductor's hooks see. The ``wrap`` stage
runs after an emitter returns (``PassManager.run_wrap_stage``, called by the backend).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .pass_manager import PassManager

__all__ = ["inductor_config_patches", "compile_inductor", "compile_eager", "compile_xla", "EMITTERS"]


def _stage_hook_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class StageHook(CustomGraphPass):
        """Runs one stage of our pipeline inside Inductor, then any custom pass the user had installed."""

        def __init__(self, pm: PassManager, stage: str | None, chained: Any = None):
            self.pm, self.stage, self.chained = pm, stage, chained

        def __call__(self, graph: fx.Graph) -> None:
            gm = graph.owning_module
            stage, is_inference = self.stage, None
            if stage is None:  # the post-grad hook: inner_compile below said which side this is
                stage, is_inference = self.pm.emitter_stage[-1] if self.pm.emitter_stage else ("forward", None)
            if not self.pm.stage_done(gm, stage):
                self.pm.run_stage(gm, stage, is_inference=is_inference)
            if self.chained is not None:
                self.chained(graph)

        def uuid(self) -> Any:
            chained = self.chained.uuid() if hasattr(self.chained, "uuid") else None
            return ("kernelpytorch", self.stage, self.pm.fingerprint(), chained)

    return StageHook


def inductor_config_patches(pm: PassManager) -> dict[str, Any]:
    """The Inductor config one compile runs under: the mode's settings (as torch.compile gives Inductor),
    the user's options["inductor"], and our stage hooks chained in front of any custom pass already set."""
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    StageHook = _stage_hook_class()
    patches: dict[str, Any] = dict(list_mode_options(pm.options.mode))
    patches.update(pm.inductor_patches)  # what our passes ask (the cudagraphs pass: triton.cudagraphs)
    patches.update(pm.options.inductor)
    patches["joint_custom_pre_pass"] = StageHook(pm, "joint", inductor_config.joint_custom_pre_pass)
    patches["post_grad_custom_pre_pass"] = StageHook(pm, None, inductor_config.post_grad_custom_pre_pass)
    if pm.dump is not None:
        # A cached artifact skips our hooks and the dump would miss stages: compile afresh when dumping.
        patches["fx_graph_cache"] = False
    return patches


def user_overrides(pm: PassManager) -> list[str]:
    """Report notes for the Inductor settings our passes asked that the user's ``options["inductor"]`` overrides
    (the user's word holds, and the report must not let a pass's own note say otherwise)."""
    user = pm.options.inductor
    return [f"options['inductor'] sets {key}={user[key]!r}, over the {asked!r} that our passes asked for; "
            f"what they asked it for does not happen" + (" (no CUDA-graph capture)" if key == "triton.cudagraphs" else "")
            for key, asked in pm.inductor_patches.items() if key in user and user[key] != asked]


def compile_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], pm: PassManager) -> Callable:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    patches = inductor_config_patches(pm)
    pm.report.notes.extend(user_overrides(pm))
    patches["unsafe_marked_cacheable_functions"] = _cacheable_functions(gm, pm)
    caches = contextlib.nullcontext()
    if pm.dump is not None:
        caches = torch._functorch.config.patch(enable_autograd_cache=False)

    def inner_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any):
        # Inductor says here which side of the split it compiles; the post-grad hook reads it.
        side = "backward" if kwargs.get("is_backward") else "forward"
        pm.emitter_stage.append((side, bool(kwargs.get("is_inference", False))))
        try:
            return compile_fx_inner(gm, example_inputs, **kwargs)
        finally:
            pm.emitter_stage.pop()

    bypassed = _aot_cache_bypasses()
    with caches:
        compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
    if pm.dump is None and _aot_cache_bypasses() > bypassed:
        reason = _aot_cache_reason(gm, patches)
        pm.report.notes.append(f"AOTAutograd's cache skipped this graph ({reason}): a warm restart "
                               "traces and partitions it again before Inductor's FX-graph cache can hit")
    missing = [stage for stage in ("joint", "forward") if stage not in pm.report.stages]
    if missing:
        pm.report.notes.append(
            f"stage(s) {', '.join(missing)}: the code came from Inductor's cache, so their passes did not run in "
            "this process (they ran when the entry was made); set dump_dir to compile afresh and see them run"
        )
    return compiled


def _aot_cache_bypasses() -> int:
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_bypass"]


def _aot_cache_reason(gm: fx.GraphModule, patches: dict) -> str:
    """Why AOTAutograd's cache passed over ``gm``: its own check of the graph, under the compile's config patches
    (checked outside them, it named a function the patches mark cacheable; s23). Where the check passes, the cause
    came later (its key or its entry), and AOTAutograd's log at INFO says which."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import check_cacheable
        from torch._inductor import config as inductor_config

        with inductor_config.patch(patches):
            check_cacheable(gm)
    except Exception as e:  # noqa: BLE001 - the reason, whatever torch raised
        return " ".join(str(e).split())[:300]
    return ("not for its graph's ops: its key or its entry could not be made; TORCH_LOGS="
            "'+torch._functorch._aot_autograd.autograd_cache' shows why")


def _cacheable_functions(gm: fx.GraphModule, pm: PassManager) -> dict[str, str]:
    """Inductor's ``unsafe_marked_cacheable_functions`` with the plain functions our pre_aot passes put in the
    graph (``merged_linear_static``, ``folded_weight``, ...). AOTAutograd's cache skips a graph that calls a
    function it does not know (a warm llama compile traced everything again: merge-parallel-linears), though
    ours are pure and what they do is in ``pm.fingerprint()`` (our package's source): that is their key."""
    from torch._inductor import config as inductor_config

    marked = dict(inductor_config.unsafe_marked_cacheable_functions)
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, types.FunctionType) and \
                (target.__module__ or "").startswith("kpt_compiler."):
            marked[f"{target.__module__}.{target.__name__}"] = pm.fingerprint()
    return marked


def _boxed(gm: fx.GraphModule) -> Callable:
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


def _aot_emitter(pm: PassManager, finish: Callable[[fx.GraphModule, Sequence[Any]], Callable], *,
                 partition: Callable, decompositions: Any) -> Callable:
    """AOTAutograd with our stages at its partition and compiler callbacks; ``finish`` generates code."""
    from torch._dynamo.backends.common import aot_autograd

    def partition_fn(joint: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        if not pm.stage_done(joint, "joint"):
            pm.run_stage(joint, "joint", is_inference=False)
        return partition(joint, joint_inputs, **kwargs)

    def fw_compiler(gm: fx.GraphModule, inputs: Sequence[Any]):
        pm.run_stage(gm, "forward", is_inference=False)
        return finish(gm, inputs)

    def bw_compiler(gm: fx.GraphModule, inputs: Sequence[Any]):
        pm.run_stage(gm, "backward", is_inference=False)
        return finish(gm, inputs)

    def inference_compiler(gm: fx.GraphModule, inputs: Sequence[Any]):
        pm.run_stage(gm, "joint", is_inference=True)
        pm.run_stage(gm, "forward", is_inference=True)
        return finish(gm, inputs)

    return aot_autograd(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        inference_compiler=inference_compiler,
        partition_fn=partition_fn,
        decompositions=decompositions,
        keep_inference_input_mutations=True,
    )


def compile_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], pm: PassManager) -> Callable:
    import functools

    import torch._inductor.lowering  # noqa: F401 - some of the decompositions below use it (max_pool3d's does)
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    emitter = _aot_emitter(
        pm,
        lambda g, _inputs: _boxed(g),
        partition=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
        decompositions=select_decomp_table(),
    )
    return emitter(gm, example_inputs)


def compile_xla(gm: fx.GraphModule, example_inputs: Sequence[Any], pm: PassManager) -> Callable:
    """What torch's ``openxla`` backend does (aot_autograd around openxla_eval_boxed), with our stages."""
    from torch._dynamo.backends.torchxla import openxla_eval_boxed
    from torch._functorch.partitioners import default_partition

    emitter = _aot_emitter(pm, openxla_eval_boxed, partition=default_partition, decompositions=None)
    return emitter(gm, example_inputs)


EMITTERS = {"inductor": compile_inductor, "eager": compile_eager, "xla": compile_xla}
