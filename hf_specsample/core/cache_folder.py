"""hf_specsample's folder on disk: what it keeps across processes (token counts, the small-rows kernel's builds).

A value at the bottom of the layers (`docs/ARCHITECTURE.md`, "Layers"): the kernel's build (`kernels.build`) and the
FR-Spec token counts (`prepare.vocabulary`) both live under it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "HF_SPECSAMPLE_CACHE"  # overrides the cache folder; see default_cache_dir()


def default_cache_dir() -> Path:
    """``$HF_SPECSAMPLE_CACHE`` if set, else ``$XDG_CACHE_HOME/hf_specsample``, else ``~/.cache/hf_specsample``."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "hf_specsample"
