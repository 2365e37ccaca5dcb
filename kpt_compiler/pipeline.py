"""The default pipeline: which passes run, in which order, and the one-line description of a pipeline.

The pipeline is a flat list. Passes run in this order within each stage (stages in the order of
``registry.STAGES``); one comment per entry says why it sits where it does. Passes registered elsewhere (a
user's, a test's) run after these, in registration order. ``options["pipeline"]`` replaces the list (it may
name groups, which stand for their members in the order the group declares them).
"""

from __future__ import annotations

from . import passes as _builtin_passes  # noqa: F401  (importing registers the built-in passes and groups)
from .options import CompileOptions
from .registry import STAGES, GraphPass, expand_groups, registered_passes
from .target import Target

__all__ = ["DEFAULT_PIPELINE", "resolve_pipeline", "describe_pipeline"]

DEFAULT_PIPELINE: tuple[str, ...] = (
    # pre_aot: before AOTAutograd, so a rewrite's backward comes from its replacement's autograd formula
    "bucketing",  # first: it proves padding safe on the graph as the user wrote it (on for CUDA inference)
    "attention",  # first rewrite: it needs the softmax chain intact, before anything fuses parts of it
    # lossy, off by default; before the fusion rules, which would take their linears into bf16 kernels. fp4 first:
    # asked for together, inference layers get fp4 weights and fp8 takes the rest (training graphs)
    "fp4",
    "fp8",
    # 2:4 after the two: asked for with fp8, a layer fp8 took is not a plain linear any more (fp8 + 2:4 in one
    # layer is not built); before the fusion rules, which would take its linears into dense kernels
    "sparsity-2-4",
    # the fusion group, after attention, which needs the q/k/v projections' outputs as they were
    "fold-conv-bn",  # before the GEMM rules: a folded convolution is no GEMM candidate, and it is cheap
    "fuse-add-norm",  # before the epilogue rule, which would otherwise take the residual add into a GEMM
    "fuse-gated-linear",  # before the epilogue rule: the gate's linear + activation would match it alone
    "fuse-linear-epilogue",  # after the gated rule; takes what is left of linear + bias/act/residual
    "merge-parallel-linears",  # last: only linears no rule above took are merged (q, k, v)
    "cudagraphs",  # after every rewrite: it sizes the graph as Inductor will get it, and changes nothing in it
)


def resolve_pipeline(options: CompileOptions) -> list[GraphPass]:
    registry = registered_passes()
    if options.pipeline is not None:
        names = expand_groups([n.replace("_", "-") for n in options.pipeline])
    else:
        names = list(DEFAULT_PIPELINE) + [n for n in registry if n not in DEFAULT_PIPELINE]
    return [registry[n] for n in names if n in registry]


def describe_pipeline(options: CompileOptions, target: Target | None = None) -> str:
    """The pipeline as one line per stage, e.g. ``pre_aot: attention, -fuse-add-norm(off)``."""
    lines = []
    for stage in STAGES:
        items = []
        for spec in resolve_pipeline(options):
            if spec.stage != stage:
                continue
            if not options.pass_enabled(spec.name):
                items.append(f"-{spec.name}(off)")
            elif target is not None and spec.unsupported_reason(target, options.pass_options(spec.name)):
                items.append(f"-{spec.name}(n/a)")
            else:
                items.append(spec.name)
        lines.append(f"{stage}: {', '.join(items) if items else '-'}")
    return "\n".join(lines)
