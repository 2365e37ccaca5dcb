"""The target: which device a compiled graph runs on, and what that device can do.

Detected from the example inputs Dynamo hands the backend (the device of their tensors), checked against
the ``device`` option. Passes read capabilities from here (``target.has_fp8``), never from torch.cuda directly,
so tests can ask what a pass would do on another device (``Target("cuda", "NVIDIA A100-SXM4-80GB", (8, 0))``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from .errors import OptionError

__all__ = ["Target", "detect_target"]


@dataclasses.dataclass(frozen=True)
class Target:
    device: str  # "cuda", "cpu" or "xla"
    name: str  # e.g. "NVIDIA H100 80GB HBM3", "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability
    memory_bytes: int | None = None
    multiprocessors: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def has_fp8(self) -> bool:
        """e4m3/e5m2 matrix products: Ada (8.9) and Hopper (9.0) and later."""
        return self.is_cuda and self.capability is not None and self.capability >= (8, 9)

    @property
    def has_sparse_2_4(self) -> bool:
        """Semi-structured (2:4) sparse matrix products: Ampere (8.0) and later."""
        return self.is_cuda and self.capability is not None and self.capability >= (8, 0)

    @property
    def has_triton(self) -> bool:
        return self.is_cuda

    @property
    def card(self) -> str:
        """The card as calibration files name it: ``NVIDIA H100 80GB HBM3 (sm_90)``; the device type elsewhere."""
        if self.is_cuda and self.capability is not None:
            return f"{self.name} (sm_{self.capability[0]}{self.capability[1]})"
        return self.name

    def describe(self) -> str:
        if self.is_cuda:
            mem = f", {self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else ""
            return f"cuda: {self.name} (sm_{self.capability[0]}{self.capability[1]}{mem})"
        return self.device if self.name == self.device else f"{self.device}: {self.name}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["capability"] = list(self.capability) if self.capability else None
        return d


def _input_devices(example_inputs: Sequence[Any]) -> list[torch.device]:
    devices = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device not in devices:
            devices.append(x.device)
    return devices


def cuda_target(index: int | None = None) -> Target:
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    return Target(
        device="cuda",
        name=props.name,
        capability=(props.major, props.minor),
        memory_bytes=props.total_memory,
        multiprocessors=props.multi_processor_count,
    )


def _graph_devices(gm: Any) -> list[torch.device]:
    """The devices of the tensors a graph makes (Dynamo's example values, nested ones included)."""
    from torch.utils._pytree import tree_leaves

    devices = []
    for node in getattr(getattr(gm, "graph", None), "nodes", ()):
        for x in tree_leaves(node.meta.get("example_value", node.meta.get("val"))):
            if isinstance(x, torch.Tensor) and x.device not in devices:
                devices.append(x.device)
    return devices


def _host_scalars_only(example_inputs: Sequence[Any]) -> bool:
    """No tensor input but 0-d CPU ones (the scalars Dynamo passes as tensors once a float changes)."""
    return all(not isinstance(x, torch.Tensor) or (x.device.type == "cpu" and x.dim() == 0) for x in example_inputs)


def detect_target(example_inputs: Sequence[Any], asked: str = "auto", gm: Any = None) -> Target:
    """The device the graph's inputs live on; ``asked`` (the ``device`` option) must agree unless it is "auto".
    Under "auto", a graph whose only tensor inputs are host scalars, or that takes none (a mask built from sizes
    alone), runs where the tensors it makes are, read off ``gm`` (CUDA over the CPU, as for inputs)."""
    devices = _input_devices(example_inputs)
    if asked == "auto" and _host_scalars_only(example_inputs):
        devices += [d for d in _graph_devices(gm) if d not in devices]
    types = {d.type for d in devices}
    if "xla" in types:
        found = "xla"
    elif "cuda" in types:
        found = "cuda"
    elif types <= {"cpu", "meta"}:
        found = "cpu"
    else:
        raise OptionError(
            f"kernelpytorch compiles for cuda, cpu and xla; this graph's inputs are on {sorted(types)}"
        )
    # what is missing first: moving the inputs to a device this machine lacks would not help
    if asked == "cuda" and not torch.cuda.is_available():
        raise OptionError("options['device']='cuda', but torch sees no CUDA device here (torch.cuda.is_available() "
                          f"is False; torch {torch.__version__}); use device='cpu' or 'auto'")
    if asked == "xla" or found == "xla":
        try:
            import torch_xla  # noqa: F401
        except ImportError as e:
            raise OptionError(
                "options['device']='xla' needs torch_xla, which is not installed here (pip install torch==2.9.0 "
                "torch_xla==2.9.0 in an environment of its own: torch_xla 2.9 works only with torch 2.9)"
            ) from e
    if asked != "auto" and asked != found and devices:
        raise OptionError(
            f"options['device']={asked!r}, but the graph's inputs are on {found!r}: move the model and its inputs "
            f"to {asked!r} (for example model.to({asked!r})), or leave device='auto'"
        )
    if found == "xla" or asked == "xla":
        return Target(device="xla", name="xla")
    if found == "cuda" or asked == "cuda":
        index = next((d.index for d in devices if d.type == "cuda" and d.index is not None), None)
        return cuda_target(index)
    return Target(device="cpu", name="cpu")
