"""torchao's float8 as a baseline for the fp8 pass (issue 16): training and inference conversions of a model.

    convert_training(model, "tensorwise" | "rowwise" | "rowwise_with_gw_hp")  # nn.Linear -> torchao's Float8Linear
    convert_inference(model, "row" | "tensor")   # quantize_ with dynamic fp8 activations and weights (weights once)

Training swaps each chosen ``nn.Linear`` for torchao's ``Float8Linear`` (``convert_to_float8_training`` with
``Float8LinearConfig.from_recipe_name(recipe)``): activations, weights and gradients are scaled and cast on every
call, as the fp8 pass does. Inference is ``quantize_(model, Float8DynamicActivationFloat8WeightConfig(
granularity=PerRow() or PerTensor()))``: the weights are quantized once, here, and each call scales and casts the
activations only. Put ``torch.compile`` around the result as around any model.

Which layers: every ``nn.Linear`` whose input and output features are both multiples of 16 (``torch._scaled_mm``'s
rule, as for the fp8 pass), except the model's output layer when ``keep_output`` (the default): a module named
``lm_head`` if there is one, otherwise the last ``nn.Linear`` in module order (a classifier or LM head, where fp8
costs the most accuracy; a tied ``lm_head`` also shares its weight with the embedding). ``skip`` takes more
module paths as fnmatch patterns, as the fp8 pass's ``skip`` option does. ``plan(model)`` tells the choice
without torchao; the converted model carries it as ``model.torchao_fp8`` (``converted``: the layers, ``kept``:
each layer left in its precision with the reason).

torchao is optional and imported only when a conversion asks for it: without it (or with one that fails to
import) both functions raise ``TorchaoMissing``, a ``MissingLibrary`` (as the zoo raises for a missing model
library) and an ``ImportError``, whose message says why. On the GPU machine torchao travels as a wheel: torchao
0.18.0 (built for torch >= 2.11 and CUDA 13) in the ignored folder ``.whl``, installed at the start of a command.

Two things torchao does to the whole process: ``convert_to_float8_training`` patches Inductor's Triton code for
min/max (a workaround for a Triton fp8 miscompile, numerically the same) for every later compile; and torchao's
inference configs set Inductor options (coordinate descent tuning) unless told not to, which ``convert_inference``
does (``inductor_config=False``) so that torchao compiles under the same Inductor settings as the other columns.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
from typing import Any, Iterable

import torch.nn as nn

from kpt_compiler.models.zoo import MissingLibrary

__all__ = ["TorchaoMissing", "TRAINING_RECIPES", "GRANULARITIES", "OUTPUT_NAMES", "available", "version", "plan",
           "convert_training", "convert_inference"]

TRAINING_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # Float8LinearConfig.from_recipe_name's names
GRANULARITIES = ("row", "tensor")  # PerRow(), PerTensor(); "rowwise" and "tensorwise" are taken too
OUTPUT_NAMES = ("lm_head",)  # the output layer by name; else the last nn.Linear


class TorchaoMissing(MissingLibrary, ImportError):
    """torchao is not installed here, or does not import; the message says why."""


@functools.lru_cache(maxsize=None)
def _import_failure() -> str | None:
    try:
        for name in ("torchao.float8", "torchao.quantization"):
            importlib.import_module(name)
    except ModuleNotFoundError as e:
        return f"not installed ({e})"
    except Exception as e:  # a torchao that does not fit this torch can fail in many ways
        return f"failed to import ({type(e).__name__}: {e})"
    return None


def available() -> str | None:
    """None where torchao's float8 APIs import, else the reason ("not installed (No module named 'torchao')")."""
    return _import_failure()


def version() -> str | None:
    """torchao's version, read from its metadata (no import), or None where it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("torchao")
    except PackageNotFoundError:
        return None


def _require() -> None:
    why = _import_failure()
    if why:
        raise TorchaoMissing(f"torchao {why}: the torchao baseline needs torchao (0.18.0 for torch 2.11; on the GPU "
                             f"machine, install the wheel from .whl)")


def plan(model: nn.Module, *, keep_output: bool = True, skip: Iterable[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The ``nn.Linear`` layers to convert (module paths, "" for a model that is itself one) and those to keep in
    their precision, each with the reason. Needs no torchao."""
    skip = tuple(skip)
    linears = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.Linear)]
    output = None
    if keep_output and linears:
        named = [p for p, _ in linears if p.rsplit(".", 1)[-1] in OUTPUT_NAMES]
        output = named[-1] if named else linears[-1][0]
    convert, kept = [], {}
    for path, m in linears:
        pattern = next((p for p in skip if fnmatch.fnmatchcase(path, p)), None)
        if path == output:
            kept[path] = ("the output layer (named lm_head)" if path.rsplit(".", 1)[-1] in OUTPUT_NAMES
                          else "the output layer (the last nn.Linear)")
        elif pattern is not None:
            kept[path] = f"matches skip pattern {pattern!r}"
        elif m.in_features % 16 or m.out_features % 16:
            kept[path] = f"{m.in_features} input and {m.out_features} output features: fp8 needs multiples of 16"
        else:
            convert.append(path)
    return convert, kept


def _record(model: nn.Module, mode: str, how: str, convert: list[str], kept: dict[str, str]) -> nn.Module:
    # a plain attribute (a dict is neither a parameter, a buffer nor a module): nothing in forward reads it
    model.torchao_fp8 = {"mode": mode, "recipe": how, "torchao": version(), "converted": convert, "kept": kept}
    return model


def convert_training(model: nn.Module, recipe: str = "tensorwise", *, keep_output: bool = True,
                     skip: Iterable[str] = ()) -> nn.Module:
    """``model`` with its chosen ``nn.Linear`` layers swapped for torchao's ``Float8Linear`` under ``recipe``
    (one of ``TRAINING_RECIPES``), in place where the model is not itself an ``nn.Linear``; returns the model."""
    if recipe not in TRAINING_RECIPES:
        raise ValueError(f"recipe must be one of {TRAINING_RECIPES}, got {recipe!r}")
    _require()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert, kept = plan(model, keep_output=keep_output, skip=skip)
    chosen = set(convert)
    model = convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                       module_filter_fn=lambda m, path: path in chosen)
    return _record(model, "training", recipe, convert, kept)


def _granularity(granularity: Any) -> Any:
    from torchao.quantization import PerRow, PerTensor

    if isinstance(granularity, str):
        name = granularity.removesuffix("wise")
        if name not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES} (or a torchao granularity), "
                             f"got {granularity!r}")
        return PerRow() if name == "row" else PerTensor()
    return granularity


def convert_inference(model: nn.Module, granularity: Any = "row", *, keep_output: bool = True,
                      skip: Iterable[str] = (), inductor_config: bool = False) -> nn.Module:
    """``model`` with its chosen ``nn.Linear`` layers quantized by torchao's ``quantize_`` to dynamic fp8
    activations and fp8 weights (``Float8DynamicActivationFloat8WeightConfig``), scaled per row (``"row"``) or
    per tensor (``"tensor"``), in place; returns the model. The weights must be on a GPU that has fp8 (compute
    capability 8.9 or newer): torchao checks. ``inductor_config=True`` lets torchao set its recommended Inductor
    options for the whole process."""
    if isinstance(granularity, str) and granularity.removesuffix("wise") not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES} (or a torchao granularity), got {granularity!r}")
    _require()
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_

    convert, kept = plan(model, keep_output=keep_output, skip=skip)
    chosen = set(convert)
    granularity = _granularity(granularity)
    config = Float8DynamicActivationFloat8WeightConfig(granularity=granularity, set_inductor_config=inductor_config)
    quantize_(model, config, filter_fn=lambda m, path: isinstance(m, nn.Linear) and path in chosen)
    return _record(model, "inference", type(granularity).__name__, convert, kept)
