"""NIXL as kvcr imports it (kvcr.transport.nixl_agent picks the package), imported once per run."""

from __future__ import annotations

import functools
import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import attrs

#: What to do when NIXL is missing or broken.
REINSTALL = (
    "install kvcr's NIXL dependency into this environment: `uv sync` in a checkout, or "
    "`pip install nixl-cu13==1.5.1` (keep torch out: see docs/dev-guide.md)"
)


@attrs.frozen
class Nixl:
    agent: Any  # nixl_agent
    config: Any  # nixl_agent_config
    module: str  # the module the two come from (nixl_cu13._api, or nixl._api)
    path: str
    distribution: str | None
    version: str | None


class NixlUnavailable(Exception):
    """NIXL does not import; the message says why."""


@functools.cache
def load() -> Nixl:
    """Import NIXL the way the transport does. Raises NixlUnavailable."""
    try:
        from kvcr.transport.nixl_agent import nixl_agent, nixl_agent_config
    # Not only ImportError: a broken wheel fails with OSError from the dynamic loader.
    except Exception as exc:
        raise NixlUnavailable(f"{type(exc).__name__}: {exc}") from exc
    module = nixl_agent.__module__
    path = str(Path(sys.modules[module].__file__ or module).resolve())
    dist = distribution_of(module)
    version = None
    if dist is not None:
        version = importlib.metadata.version(dist)
    return Nixl(nixl_agent, nixl_agent_config, module, path, dist, version)


def distribution_of(module: str) -> str | None:
    """The installed distribution that provides top-level module ``module`` (or None)."""
    top = module.partition(".")[0]
    names = importlib.metadata.packages_distributions().get(top) or []
    return names[0] if names else None
