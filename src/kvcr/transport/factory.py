"""The transport a runtime over real memory moves bytes with: one NIXL agent, made by the
factory ``runtime/build.py`` calls (an instance's, or a guard's served group's).

NIXL is imported when the factory is called, not when this module is: kvcr imports, and
its tests run on the fake transport, without it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcr.config import KVCRBackendConfigs, KVCRConfig
from kvcr.transport.base import Transport


def nixl_factory(
    config: KVCRConfig, backend_configs: KVCRBackendConfigs
) -> Callable[[], Transport]:
    """One agent serves the pools and the peers: the pools' backend when there are pools,
    the peers' otherwise (both are "UCX" for host DRAM)."""

    def factory() -> Transport:
        from kvcr.transport.nixl import NixlTransport

        local = backend_configs.local_dram
        backend = local.backend if local is not None else backend_configs.remote_fw_dram.backend
        # A stalled TCP write ends at the operation timeout (see transport/nixl.py).
        return NixlTransport(
            config.nixl_agent_name, backend, user_timeout_ms=config.operation_timeout_ms
        )

    return factory
