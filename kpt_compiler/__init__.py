"""kernelpytorch: a torch.compile backend.

    model = torch.compile(model, backend="kernelpytorch", options={"dump_dir": "kpt_dump"})

Importing this package registers the backend (the ``torch_dynamo_backends`` entry point does the same for a
process that never imports it). ``last_report()`` says what the compiler did to the newest graph.
"""

from __future__ import annotations

import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import os as _os
import sys as _sys

# ``kpt_compiler.passes`` and ``kpt_compiler.kernels`` live in the repository's passes/ and kernels/ (a
# package-dir mapping in pyproject.toml). An editable install of this checkout maps them; an installed copy
# holds them. But Python run from a repository root imports that root's kpt_compiler/ first, which has neither:
# after a plain `pip install .`, or with an editable install of another checkout (whose passes/ would then be
# mixed in). There, and only for those two names, a finder serves this checkout's passes/ and kernels/.
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))


class _BesideFinder(_importlib_abc.MetaPathFinder):
    """Finds ``kpt_compiler.passes`` and ``kpt_compiler.kernels`` in the folders beside this package."""

    def find_spec(self, name, path=None, target=None):
        folder = {f"{__name__}.passes": "passes", f"{__name__}.kernels": "kernels"}.get(name)
        if folder is None:
            return None
        location = _os.path.join(_ROOT, folder)
        return _importlib_util.spec_from_file_location(name, _os.path.join(location, "__init__.py"),
                                                        submodule_search_locations=[location])


_found = _importlib_util.find_spec(f"{__name__}.passes")
if (_found is None or not (_found.origin or "").startswith(_ROOT + _os.sep)) and all(
        _os.path.isfile(_os.path.join(_ROOT, sub, "__init__.py")) for sub in ("passes", "kernels")):
    _sys.meta_path.insert(0, _BesideFinder())

from .backend import BACKEND_NAME, kernelpytorch  # noqa: E402
from .errors import OptionError, PassFailed, PassSkipped
from .options import CompileOptions, parse_options
from .pipeline import DEFAULT_PIPELINE, describe_pipeline
from .registry import (
    GraphPass,
    PassContext,
    PassGroup,
    graph_pass,
    register_group,
    register_pass,
    registered_groups,
    registered_passes,
    unregister_pass,
)
from .report import GraphReport, clear_reports, last_report, reports
from .target import Target, detect_target

__version__ = "0.1.0"


def release_weights(model):
    """Free the bf16 (fp16, fp32) copies of the weights the fp8 and fp4 passes quantized: each such frozen
    parameter becomes its fp8 or fp4 copy. Returns what it released and what it left (passes/_fp8_release.py and
    passes/_fp4_release.py say what still works afterwards)."""
    from .passes._fp4_release import release_weights as release_fp4
    from .passes._fp8_release import release_weights as release_fp8

    return release_fp8(model) + release_fp4(model)


def prune_2_4(model, *, skip=(), min_features: int = 64, keep_mask: bool = True):
    """Prune every eligible ``nn.Linear`` weight of ``model`` to 2:4 structured sparsity (two of each four along
    the input features kept, by magnitude), in place; with ``keep_mask`` fine-tuning keeps the pattern. Returns
    per layer the share of zeros and the weight's SQNR (passes/_sparse24.py)."""
    from .passes._sparse24 import prune

    return prune(model, skip=skip, min_features=min_features, keep_mask=keep_mask)


def refresh_weights(model) -> int:
    """Make again the static fp8, fp4 and 2:4 copies of ``model``'s parameters after a write their check cannot
    see (through ``param.data``, a fused optimizer's step). Returns how many it refreshed."""
    from .passes import fp4, sparsity_2_4
    from .passes._fp8_static import refresh_weights as refresh

    return refresh(model) + fp4.refresh_weights(model) + sparsity_2_4.refresh_weights(model)

__all__ = [
    "kernelpytorch",
    "CompileOptions",
    "OptionError",
    "parse_options",
    "GraphPass",
    "PassGroup",
    "PassContext",
    "PassFailed",
    "PassSkipped",
    "graph_pass",
    "register_pass",
    "unregister_pass",
    "registered_passes",
    "register_group",
    "registered_groups",
    "DEFAULT_PIPELINE",
    "describe_pipeline",
    "GraphReport",
    "last_report",
    "reports",
    "clear_reports",
    "Target",
    "detect_target",
    "release_weights",
    "refresh_weights",
    "prune_2_4",
]


def _register_backend() -> None:
    """Register with Dynamo unless its entry-point discovery already will.

    When Dynamo loads our entry point it imports this package and registers the loaded function itself;
    registering here as well would make it fail with "duplicate name".
    """
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS or isinstance(registry._BACKENDS.get(BACKEND_NAME), EntryPoint):
        return
    registry.register_backend(compiler_fn=kernelpytorch, name=BACKEND_NAME)


_register_backend()
