"""Autotuning choices kept on disk, so a restarted job launches our kernels without tuning them again (issue 20's
warm restarts).

``_launch.launch_tuned`` autotunes a kernel on a key's first call in a process and keeps the chosen config in
``_launch._chosen``. Triton's own ``cache_results`` cannot keep these: it gives up on configs with a
``pre_hook``, which our TMA GEMMs have. ``install()`` puts a ``ChoicesOnDisk`` in ``_launch._chosen``'s place: a
dict that, on a miss, reads the choice from a file and, when a choice is made, writes one.

A file is named by the hash of everything that decides the choice: the kernel's own cache key (Triton's hash of
its source and what it calls), the source of every file of this package (the configs and launchers live there),
the card's name, triton's and torch's versions and the autotuner's key (sizes and dtypes). Any change misses.
The files live in Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR``), under ``kpt_autotune``;
Inductor's ``force_disable_caches`` turns reading them off. Not under Triton's interpreter (nothing is tuned there).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

from . import _launch

_stats = {"read": 0, "written": 0}


@functools.lru_cache(maxsize=None)
def _package_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _card(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def folder() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "kpt_autotune"


def _disabled() -> bool:
    from torch._inductor import config

    return bool(config.force_disable_caches) or _launch.INTERPRETED or not torch.cuda.is_available()


def _file(kernel, key: tuple) -> Optional[Path]:
    try:
        kernel_key = kernel.cache_key
    except AttributeError:  # not a JITFunction: keep the choice in this process only
        return None
    import triton

    text = "\0".join([kernel_key, _package_hash(), _card(torch.cuda.current_device()), triton.__version__,
                      torch.__version__, repr(key)])
    name = getattr(kernel, "__name__", "kernel")[:60]
    return folder() / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


class ChoicesOnDisk(dict):
    """``_launch._chosen`` with a file behind each entry: ``get`` reads one on a miss, setting writes it."""

    def get(self, item, default=None):
        config = dict.get(self, item)  # every launch asks: one lookup, the disk only on a miss
        if config is not None:
            return config
        if _disabled():
            return default
        path = _file(*item)
        if path is None or not path.exists():
            return default
        try:
            config = json.loads(path.read_text())["config"]
        except (OSError, ValueError, KeyError):
            return default  # a torn or foreign file: tune again, and overwrite it
        _stats["read"] += 1
        dict.__setitem__(self, item, config)
        return config

    def __setitem__(self, item, config) -> None:
        dict.__setitem__(self, item, config)
        if _disabled():
            return
        path = _file(*item)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # written whole, then renamed: another rank tuning the same kernel writes the same name
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
                json.dump({"kernel": getattr(item[0], "__name__", "?"), "key": repr(item[1]), "config": config}, f)
            os.replace(f.name, path)
            _stats["written"] += 1
        except (OSError, TypeError):
            pass  # a read-only cache folder or a config JSON cannot hold: the choice stays in this process


def install() -> None:
    """Put a ``ChoicesOnDisk`` in ``_launch._chosen``'s place, keeping what the process chose already."""
    if not isinstance(_launch._chosen, ChoicesOnDisk):
        _launch._chosen = ChoicesOnDisk(_launch._chosen)


def stats() -> dict:
    """How many choices this process read from disk and wrote."""
    return dict(_stats)
