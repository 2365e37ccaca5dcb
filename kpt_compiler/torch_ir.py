"""Reading and editing Dynamo's graphs (torch IR) in pre_aot passes.

Dynamo records calls as written: ``q @ k.transpose(-2, -1)`` may be ``operator.matmul``, ``torch.matmul`` or the
``matmul`` method; softmax may be ``F.softmax``, ``torch.softmax`` or ``x.softmax``. ``kind(node)`` maps each
spelling to one name and ``arg(node, name)`` reads an argument whether it was passed by position or keyword,
so passes match meaning, not spelling. ``emit`` adds a call with its ``example_value`` (a FakeTensor, as Dynamo
keeps them), and ``evaluate`` runs a part of the graph that depends on no input (a mask built from arange).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph_utils import attr_of, symbolic_sizes

__all__ = ["kind", "arg", "example_value", "emit", "depends_on_inputs", "evaluate", "cast_dtype", "copy_meta",
           "add_constant", "hints_only", "attention_sizes_dynamic"]

# (kind, parameter names in order) for each spelling; methods are ("method", name).
_SIGS: dict[Any, tuple[str, tuple[str, ...]]] = {}


def _add(kind_name: str, params: tuple[str, ...], *targets: Any) -> None:
    for t in targets:
        _SIGS[t] = (kind_name, params)


_add("matmul", ("input", "other"), torch.matmul, operator.matmul, torch.bmm, ("method", "matmul"), ("method", "bmm"))
_add("transpose", ("input", "dim0", "dim1"), torch.transpose, ("method", "transpose"), torch.swapaxes,
     ("method", "swapaxes"))
_add("permute", ("input", "dims"), torch.permute, ("method", "permute"))
_add("mul", ("input", "other"), operator.mul, torch.mul, ("method", "mul"))
_add("div", ("input", "other"), operator.truediv, torch.div, torch.true_divide, ("method", "div"))
_add("add", ("input", "other"), operator.add, torch.add, ("method", "add"))
_add("where", ("condition", "input", "other"), torch.where)
_add("masked_fill", ("input", "mask", "value"), torch.masked_fill, ("method", "masked_fill"))
_add("softmax", ("input", "dim", "_stacklevel", "dtype"), F.softmax)
_add("softmax", ("input", "dim", "dtype"), torch.softmax, ("method", "softmax"))
_add("sdpa", ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
     F.scaled_dot_product_attention)
_add("dropout", ("input", "p", "training", "inplace"), F.dropout)
_add("dropout", ("input", "p", "training"), torch.dropout)
_add("invert", ("input",), operator.invert, torch.logical_not, torch.bitwise_not, ("method", "logical_not"),
     ("method", "bitwise_not"))
_add("contiguous", ("input",), ("method", "contiguous"))
_add("tanh", ("input",), torch.tanh, F.tanh, ("method", "tanh"))
_add("linear", ("input", "weight", "bias"), F.linear)
_add("addmm", ("input", "mat1", "mat2", "beta", "alpha"), torch.addmm)
_add("silu", ("input", "inplace"), F.silu)
_add("relu", ("input", "inplace"), F.relu)
_add("relu", ("input",), torch.relu, ("method", "relu"))
_add("gelu", ("input", "approximate"), F.gelu)
_add("pow", ("input", "exponent"), torch.pow, ("method", "pow"), operator.pow)
_add("mean", ("input", "dim", "keepdim", "dtype"), torch.mean, ("method", "mean"))
_add("rsqrt", ("input",), torch.rsqrt, ("method", "rsqrt"))
_add("layer_norm", ("input", "normalized_shape", "weight", "bias", "eps"), F.layer_norm)
if hasattr(F, "rms_norm"):
    _add("rms_norm", ("input", "normalized_shape", "weight", "eps"), F.rms_norm)
_add("batch_norm", ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
     F.batch_norm)
_add("conv2d", ("input", "weight", "bias", "stride", "padding", "dilation", "groups"), torch.conv2d, F.conv2d)
_add("cast", ("input", "dtype"), ("method", "to"), ("method", "type"))
for _name in ("float", "half", "bfloat16", "double"):
    _add("cast", ("input",), ("method", _name))
_METHOD_DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


def _key(node: fx.Node) -> Any:
    if node.op == "call_method":
        return ("method", node.target)
    if node.op == "call_function":
        return node.target
    return None


def kind(node: Any) -> str | None:
    """The canonical name of what ``node`` computes ("matmul", "softmax", ...), or None."""
    if not isinstance(node, fx.Node):
        return None
    try:
        entry = _SIGS.get(_key(node))
    except TypeError:  # an unhashable target
        return None
    return entry[0] if entry else None


_MISSING = object()


def arg(node: fx.Node, name: str, default: Any = _MISSING) -> Any:
    """Argument ``name`` of a recognised call, positional or keyword."""
    _kind, params = _SIGS[_key(node)]
    if name in node.kwargs:
        return node.kwargs[name]
    i = params.index(name)
    if node.op == "call_method" and node.target == "permute" and name == "dims":
        dims = node.args[1:]
        return tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else tuple(dims)
    if i < len(node.args):
        return node.args[i]
    if default is _MISSING:
        raise KeyError(f"{node.format_node()} has no argument {name!r}")
    return default


def example_value(node: Any) -> Any:
    """What Dynamo recorded the node computes (a FakeTensor for tensors); plain values stay as they are."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def attention_sizes_dynamic(gm: fx.GraphModule) -> bool:
    """Whether an attention of ``gm`` has symbolic sizes: a softmax's scores, or an SDPA's query or key (a graph
    dynamic only in other sizes, or in an int, runs its attention at fixed sizes)."""
    for node in gm.graph.nodes:
        k = kind(node)
        operands = [node] if k == "softmax" else [arg(node, "query"), arg(node, "key")] if k == "sdpa" else []
        if any(symbolic_sizes(example_value(o)) for o in operands if isinstance(o, fx.Node)):
            return True
    return False


def cast_dtype(node: fx.Node) -> torch.dtype | None | str:
    """For a "cast" node: the dtype it casts to, None if it keeps the dtype, "other" if it does more."""
    if node.op == "call_method" and node.target in _METHOD_DTYPES:
        return _METHOD_DTYPES[node.target]
    rest = list(node.args[1:]) + list(node.kwargs.values())
    dtypes = [a for a in rest if isinstance(a, torch.dtype)]
    others = [a for a in rest if not isinstance(a, (torch.dtype, torch.device, bool)) and a is not None]
    if others or len(dtypes) > 1:
        return "other"
    before, after = example_value(node.args[0]), example_value(node)
    if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.device != after.device:
        return "other"
    return dtypes[0] if dtypes else None


def copy_meta(src: fx.Node, dst: fx.Node) -> None:
    """Source location and module path, so dumps show where a new node came from."""
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def emit(graph: fx.Graph, fn: Callable, args: tuple, kwargs: dict | None = None, *, like: fx.Node | None = None,
         fake_fn: Callable | None = None) -> fx.Node:
    """Insert ``fn(*args, **kwargs)`` at the graph's insertion point, with its example_value (computed by
    ``fake_fn`` instead of ``fn`` when given: any function with the same output shape and dtype)."""
    kwargs = kwargs or {}
    node = graph.call_function(fn, args, kwargs)
    vals = [example_value(a) for a in node.all_input_nodes]
    fake_mode = next((v.fake_mode for v in vals if isinstance(v, torch._subclasses.FakeTensor)), None)
    if fake_mode is None:  # a factory call (torch.zeros): the graph's own fake mode
        fake_mode = next((v.fake_mode for v in map(example_value, graph.nodes)
                          if isinstance(v, torch._subclasses.FakeTensor)), None)
    fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), example_value)
    # the Python dispatcher, as Dynamo traces with: without it a dynamic size read inside ``fn`` (SDPA reads
    # q.size() on some paths) becomes an int, which specializes the graph to the sizes it was traced at
    from torch._dispatch.python import enable_python_dispatcher

    with fake_mode if fake_mode is not None else _null(), enable_python_dispatcher():
        node.meta["example_value"] = (fake_fn or fn)(*fake_args, **fake_kwargs)
    if like is not None:
        copy_meta(like, node)
    return node


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def ancestors(node: fx.Node) -> list[fx.Node]:
    """Every node ``node`` depends on, itself included, in graph order."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def depends_on_inputs(node: fx.Node, tensors_only: bool = False) -> bool:
    """True if the value of ``node`` depends on a graph input (so it cannot be known at compile time).
    ``tensors_only``: on an input tensor (not counting the sizes Dynamo passes as inputs: a mask built from
    ``arange`` of a dynamic length depends on no tensor)."""
    return any(n.op == "placeholder" and (not tensors_only or isinstance(example_value(n), torch.Tensor))
               for n in ancestors(node))


def evaluate(gm: fx.GraphModule, node: fx.Node, max_elements: int = 1 << 26,
             why: list[str] | None = None, known: dict[fx.Node, torch.Tensor] | None = None) -> torch.Tensor | None:
    """Compute ``node`` now, when it depends on no input (e.g. a mask built from arange); None otherwise.

    Runs the node's ancestors on real tensors outside Dynamo's fake mode. Returns None for values that depend
    on inputs, that are larger than ``max_elements``, or whose computation fails; for the last, the error is
    appended to ``why`` (where given), so the caller can say why a value it expected stayed unknown.
    ``known``: inputs whose value is known all the same (a DDP piece's input that the whole graph computes from
    no input: kpt_compiler/distributed.py's ``values_before_cut``).
    """
    known, chain = known or {}, ancestors(node)
    if any(n.op == "placeholder" and n not in known for n in chain):
        return None
    drawn = [n for n in chain if n.op in ("call_function", "call_method") and _drawn(n.target)]
    if drawn:  # computed once here, it would be one sample of what each call draws
        if why is not None:
            why.append(f"{drawn[0].name} draws new values at each call (random numbers or uninitialized memory)")
        return None
    val = example_value(node)
    if isinstance(val, torch.Tensor) and (val.numel() > max_elements or not _static(val)):
        return None
    env: dict[fx.Node, Any] = {}
    load = lambda a: fx.node.map_arg(a, lambda n: env[n])  # noqa: E731
    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
            for n in chain:
                if n.op == "placeholder":
                    env[n] = known[n]
                elif n.op == "get_attr":
                    env[n] = attr_of(gm, n.target)
                elif n.op == "call_function":
                    env[n] = n.target(*load(n.args), **load(n.kwargs))
                elif n.op == "call_method":
                    self_, *rest = load(n.args)
                    env[n] = getattr(self_, n.target)(*rest, **load(n.kwargs))
                else:
                    return None
    except Exception as e:  # noqa: BLE001 - unknown ops: the value stays unknown, and the caller is told why
        if why is not None:
            why.append(f"{type(e).__name__}: {str(e)[:160]}")
        return None
    out = env[node]
    return out if isinstance(out, torch.Tensor) else None


_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                            "empty_permuted"})


def _drawn(target: Any) -> bool:
    """An op whose values are new at each call: random (ATen's ``nondeterministic_seeded`` tag, looked up by name
    for torch functions and methods: ``torch.rand``, ``F.dropout``, ``Tensor.uniform_``) or uninitialized memory."""
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags or \
            target._schema.name.split("::")[-1] in _UNINITIALIZED
    if isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name.split("::")[-1]
    else:
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return isinstance(name, str) and _drawn_name(name)


@functools.lru_cache(maxsize=None)
def _drawn_name(name: str) -> bool:
    if name in _UNINITIALIZED:
        return True
    packet = getattr(torch.ops.aten, name, None)
    return isinstance(packet, torch._ops.OpOverloadPacket) and any(
        torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in t.shape)


def add_constant(gm: fx.GraphModule, name: str, tensor: torch.Tensor, fake_mode: Any) -> fx.Node:
    """A ``get_attr`` node reading ``tensor``, registered as a buffer of ``gm`` (a tensor a pass computed once,
    such as a weight quantized or concatenated at compile time), with its fake value in ``fake_mode``."""
    from torch._dynamo.source import ConstantSource

    gm.register_buffer(name, tensor)
    # AOTAutograd lifts a Dynamo graph's buffers into inputs and wants the source of each (for guards on
    # duplicated inputs, which these are not; and to treat them as static inputs under CUDA graphs)
    if getattr(gm, "_param_name_to_source", None) is not None:
        gm._param_name_to_source[name] = ConstantSource(name)
    attr = gm.graph.get_attr(name)
    attr.meta["example_value"] = fake_mode.from_tensor(tensor, static_shapes=True)
    return attr


def hints_only(*nodes: Any):
    """A context in which the dynamic sizes of ``nodes``' values read as the sizes Dynamo saw (their hints)
    without guarding them: for a cost decision on a dynamic graph. Without it, ``int(size)`` or a tensor made
    at those sizes specializes the graph to them, and Dynamo compiles another graph for every new size (the
    attention pass's gate did that to GPT-2 in a stream of sizes on the H100, 2026-11-26). Only for decisions
    that hold at every size: a rewrite's correctness must not rest on what is read here."""
    import contextlib

    stack = contextlib.ExitStack()
    envs = {}
    for node in nodes:
        v = example_value(node)
        sizes = list(v.shape) if isinstance(v, torch.Tensor) else [v]
        for s in sizes:
            if isinstance(s, torch.SymInt):
                envs[id(s.node.shape_env)] = s.node.shape_env
    for env in envs.values():
        stack.enter_context(env.suppress_guards())
    return stack
