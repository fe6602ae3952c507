"""The service serving a pool group whose holder died: a KVCR over the group's pools, in the
service process, on the group's control endpoint.

It starts warm from the group's journal (so it holds exactly the blocks the dead worker had
committed), has no engine (no framework regions, so nothing is ever pinned) and is only a
source: peers' pulls aimed at the dead worker's incarnation are refused at once (``Over``),
after which they ask this new incarnation and get whatever it holds. At hand back it is
closed: it flushes its mirror, so the next holder recovers the same state.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from kvcr.api import KVCR, KVCRBindings
from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions, RemoteFWDramOptions
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.guard.pools import GroupMapping
from kvcr.guard.rules import Terms
from kvcr.types import PinRequestId

_WILDCARDS = {"", "0.0.0.0", "::", "*"}
_instances = itertools.count(1)


class CannotServe(Exception):
    """The group cannot be served (nothing to do with a failure of the service)."""


class GroupServer:
    def __init__(self, kv: KVCR, channel: ZmqPeerControlChannel) -> None:
        self.kv = kv
        self.channel = channel

    @classmethod
    def start(
        cls, index: int, terms: Terms, mapping: GroupMapping, listener: Any, log: Any
    ) -> GroupServer:
        """Blocking (NIXL start-up and registration): run it in a thread."""
        host, port = listener.getsockname()[:2]
        advertise = terms.advertise or host
        if advertise in _WILDCARDS:
            raise CannotServe(
                f"group {index}: the endpoint is bound to {host!r} and its holder did not say "
                "which address peers use"
            )
        channel = ZmqPeerControlChannel(host, port, advertise)
        channel.adopt_listener(listener.fileno())
        layouts = list(terms.layouts)
        pools = [
            (name, address, size)
            for (name, _), address, (_, size) in zip(
                layouts, mapping.pool_addresses, mapping.layout.pools
            )
        ]
        journal_offset, journal_size = mapping.layout.journal
        journal = memoryview(mapping.mmap)[journal_offset : journal_offset + journal_size]
        started = False
        try:
            kv = KVCR._over_journal(
                KVCRConfig(f"kvcr-guard-{os.getpid()}-g{index}-{next(_instances)}", layouts),
                KVCRBindings(
                    request_pin=lambda keys: PinRequestId(0),  # never called: no engine memory
                    poll_pin_results=list,
                    release_pin=lambda handle: True,
                    framework_control=channel,
                ),
                KVCRBackendConfigs(
                    local_dram=LocalDramOptions(pools=pools),
                    remote_fw_dram=RemoteFWDramOptions(
                        eager_ctrl_connect=False, backend=terms.backend
                    ),
                ),
                journal,
                index,
            )
            started = True
        finally:
            if not started:
                # The runtime owns the view once it runs; before that it is ours to let go
                # of (a live view would keep the group from ever being unmapped).
                journal.release()
                channel.close()
        log.info("serving", group=index, blocks=len(kv._runtime.index), endpoint=channel.endpoint)
        return cls(kv, channel)

    def close(self) -> bool:
        """Blocking: stop serving once no transfer reads the pools. False if a transfer
        might still read them after the abandon deadline (then the group must not be lent
        again); the journal holds what this server held either way."""
        try:
            self.kv.close()
        finally:
            self.channel.close()
        # Its runtime objects refer to each other and would wait for a full garbage
        # collection; nothing else can post to this server's inbox, so close its fd now.
        self.kv._runtime.inbox.close()
        return not self.kv._runtime.leaked
