"""The engine-facing facade: ``KVCR`` (contract section 5; ``KVCRBindings``, section 4, is
in ``bindings.py``).

Every method validates its input on the calling (engine) thread, then either reads state the
runtime publishes or sends a command (``runtime/commands.py``), and returns in microseconds.
The runtime runs in one thread of its own (``instance.py``); nothing here waits for it,
except construction (until memory is registered) and ``close``. ``poll_completed``,
``get_stats`` and ``close`` also make the engine calls the runtime queued
(``runtime/engine_calls.py``), one thread at a time: ``get_stats`` and ``close`` wait for
another engine thread's turn to end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

from kvcr.bindings import KVCRBindings
from kvcr.config import KVCRBackendConfigs, KVCRConfig, KVCRGuardConfig
from kvcr.engine_protocols import TelemetryStats
from kvcr.hint_book import HintBook
from kvcr.hints import HASH_LIMIT, RouterHint, parse_router_hint
from kvcr.instance import Instance
from kvcr.runtime.commands import (
    Abort,
    Align,
    Confirm,
    Connect,
    Deliver,
    Deposit,
    Fetch,
    Hinted,
    Release,
)
from kvcr.runtime.moves import Untaken
from kvcr.store.index import MISS, BlockIndex
from kvcr.types import (
    BlockKey,
    CacheTier,
    MemoryRef,
    OpHandle,
    OpResult,
    QueryStatus,
    ReleaseHandle,
    ReleaseResult,
)

__all__ = ["KVCR", "KVCRBindings"]

REMOTE = (QueryStatus.FETCHABLE, CacheTier.REMOTE_G2)


def _drain(queue: Any) -> Iterator[Any]:
    """Pop until empty; safe when several engine threads drain the same deque."""
    while True:
        try:
            yield queue.popleft()
        except IndexError:
            return


class KVCR:
    def __init__(
        self,
        config: KVCRConfig,
        bindings: KVCRBindings,
        backend_configs: KVCRBackendConfigs,
        guard_config: KVCRGuardConfig | None = None,
    ) -> None:
        self._attach(Instance.open(config, bindings, backend_configs, guard_config))
        try:
            # A warm start's inventory reaches the engine before construction returns.
            self._instance.serve_engine()
        except BaseException:  # an engine callback interrupted (KeyboardInterrupt, ...)
            self.close()
            raise

    @classmethod
    def over(cls, instance: Instance) -> KVCR:
        """The facade over an instance assembled elsewhere: ``kvcr.testing`` runs one in the
        caller's trio loop this way. Engines use the constructor."""
        self = cls.__new__(cls)
        self._attach(instance)
        return self

    def _attach(self, instance: Instance) -> None:
        self._instance = instance
        shared = instance.shared
        self._config = instance.config
        self._bindings = instance.bindings
        self._memory = instance.context.memory
        self._log = instance.log
        self._op_ids = instance.context.op_ids
        self._open_ops = shared.open_ops
        # Operations under a "move" hint, until the engine has taken all their results.
        self._moves = Untaken()
        self._live_handles = shared.live_handles
        self._engine = instance.engine
        self._index: BlockIndex = shared.g2_index
        self._g3_view = shared.g3_view
        self._outbox = shared.outbox
        self._commands = shared.commands
        self._hints = HintBook()
        self._timed = shared.telemetry.enabled  # phase timers (hint_age) cost nothing when off
        self._key_adapter = instance.bindings.key_adapter
        remote = instance.backend_configs.remote_fw_dram
        self._opportunistic = remote.opportunistic_query
        self._eager_connect = remote.eager_ctrl_connect
        self._greeted: set[str] = set()
        self._closed = False

    @property
    def config(self) -> KVCRConfig:
        return self._config

    # -- engine-facing calls ---------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ValueError(f"{what}: this KVCR instance is closed")

    def _keys(self, what: str, keys: object) -> list[BlockKey]:
        if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
            raise ValueError(
                f"{what}: keys must be a list of bytes keys, got {type(keys).__name__}"
            )
        out = list(keys)
        for position, key in enumerate(out):
            if not isinstance(key, bytes):
                raise ValueError(f"{what}: key #{position} must be bytes, got {type(key).__name__}")
        if len(set(out)) != len(out):
            seen: set[bytes] = set()
            for position, key in enumerate(out):
                if key in seen:
                    raise ValueError(f"{what}: key #{position} ({key!r}) appears twice")
                seen.add(key)
        return out

    def _resolve(self, what: str, blocks: object) -> dict[BlockKey, tuple[int, ...]]:
        if type(blocks) is not dict and not isinstance(blocks, Mapping):  # dict: no ABC check
            raise ValueError(
                f"{what}: blocks must be a mapping of key -> [MemoryRef, ...], got "
                f"{type(blocks).__name__}"
            )
        return self._memory.resolve_blocks(what, blocks)

    def _open(self, keys: list[BlockKey]) -> int:
        """A new operation's handle, its pending set registered before the runtime hears
        of it (abort reads the set at once)."""
        handle = self._op_ids()
        self._open_ops[handle] = set(keys)
        return handle

    def submit_hint(self, hints: Any, request_id: str | None = None) -> None:
        """Remember the router's hint for ``request_id``. A bad hint is a ValueError and
        leaves the instance and any earlier hint of the request as they were."""
        self._check_open("submit_hint")
        hint = parse_router_hint(hints)
        self._hints.submit(request_id, hint, time.monotonic() if self._timed else 0.0)
        if self._log.isEnabledFor(logging.DEBUG):  # a filtered event still costs ~3 us
            self._log.debug(
                "hint_submitted",
                endpoint=hint.source_control_endpoint,
                blocks=len(hint.ordered_hashes),
            )
        endpoint = hint.source_control_endpoint
        # Only endpoints not greeted yet; a known link is re-greeted on use when needed.
        eager = self._eager_connect and self._bindings.framework_control is not None
        if eager and endpoint not in self._greeted:
            self._greeted.add(endpoint)
            self._commands.put(Connect(endpoint))

    def discard_hint(self, request_id: str | None) -> None:
        self._check_open("discard_hint")
        self._hints.discard(request_id)

    def query(
        self, keys: Sequence[BlockKey], request_id: str | None = None
    ) -> list[tuple[QueryStatus, CacheTier | None]]:
        self._check_open("query")
        answers = self._index.answers(keys)
        g3 = self._g3_view.index
        if g3 is not None and g3.ready_count:  # the file tier: after local G2, before a peer
            for i, answer in enumerate(answers):
                if answer is MISS:
                    answers[i] = g3.answer(keys[i])
        # Without a control channel no peer can be asked: a hint covers nothing.
        hint = self._live_hint(request_id) if self._bindings.framework_control else None
        if hint is not None:
            missed = [i for i, answer in enumerate(answers) if answer is MISS]
            for i in self._covered(hint, keys, missed) if missed else ():
                answers[i] = REMOTE
        return answers

    def _covered(self, hint: RouterHint, keys: Sequence[BlockKey], at: list[int]) -> list[int]:
        """Those of ``at`` (positions in ``keys``) whose key the hint covers: one loop with
        the adapter's decode and the hint's set at hand (``query`` runs it for every
        missed key, on the engine's thread); a key the adapter cannot decode is not."""
        if self._opportunistic:
            return at
        if self._key_adapter is None:
            return []
        decode = self._key_adapter.decode
        try:
            decoded = [decode(keys[i]) for i in at]
        except (ValueError, TypeError):
            decoded = []  # a key the adapter refuses: key by key below, each one logged
        # The usual decode gives router hashes as ints in range: a set lookup each, with no
        # call per key. Anything else (bytes, out of range) goes key by key, as covers says.
        if decoded and set(map(type, decoded)) == {int}:
            ints = cast("list[int]", decoded)
            if min(ints) >= 0 and max(ints) < HASH_LIMIT:
                hashes = hint.block_hashes
                return [i for i, h in zip(at, ints) if h in hashes]
        return [i for i in at if self._hint_covers(hint, keys[i])]

    def _live_hint(self, request_id: object) -> RouterHint | None:
        """The request's hint, unless it failed (remote failures arrive from the runtime)."""
        if self._outbox.failed_hints:  # checked first: a generator costs ~0.4 us
            for failed in _drain(self._outbox.failed_hints):
                self._hints.mark_failed(failed)
        if not len(self._hints):
            return None
        hint = self._hints.get(request_id)
        return None if hint is None or self._hints.failed(request_id) else hint

    def _remote(self, request_id: object, keys: Iterable[BlockKey]) -> Hinted | None:
        """Where the request's hint sends keys this instance does not hold, and which."""
        if self._bindings.framework_control is None:
            return None
        hint = self._live_hint(request_id)
        if hint is None:
            return None
        index = self._index
        covered = frozenset(k for k in keys if k not in index and self._hint_covers(hint, k))
        if not covered:
            return None
        move = hint.mode == "move"  # the hint's contract value, checked by RouterHint
        age = 0.0
        if self._timed:  # the hint_age timer: submission -> this call
            age = time.monotonic() - (self._hints.submitted_at(request_id) or 0.0)
        return Hinted(hint.source_control_endpoint, request_id, covered, move, hint.no_retain, age)

    def _hint_covers(self, hint: RouterHint, key: BlockKey) -> bool:
        if self._opportunistic:
            return True
        if self._key_adapter is None:
            return False
        try:
            return hint.covers(self._key_adapter.decode(key))
        except (ValueError, TypeError) as exc:
            self._log.warning("key_adapter_decode_unusable", error=str(exc))
            return False

    def align_sequence(
        self, ordered_keys: Sequence[BlockKey], use_current_time: bool = False
    ) -> None:
        self._check_open("align_sequence")
        self._commands.put(Align(list(ordered_keys), bool(use_current_time)))

    def deposit(
        self,
        blocks: Mapping[BlockKey, list[MemoryRef]],
        no_evict: bool = False,
        hints: Mapping[str, Any] | None = None,
    ) -> OpHandle:
        self._check_open("deposit")
        sources = self._resolve("deposit", blocks)
        keys = list(sources)
        handle = self._open(keys)
        self._commands.put(Deposit(handle, keys, sources, bool(no_evict), hints))
        return handle

    def fetch(
        self,
        keys: Sequence[BlockKey],
        request_id: str | None = None,
        expected_layout: Sequence[tuple[str, int]] | None = None,
        hints: Mapping[str, Any] | None = None,
    ) -> OpHandle:
        self._check_open("fetch")
        key_list = self._keys("fetch", keys)
        if expected_layout is not None and [tuple(x) for x in expected_layout] != [
            tuple(x) for x in self._config.pool_layouts
        ]:
            raise ValueError(
                f"fetch: expected_layout {list(expected_layout)} differs from this instance's "
                f"pool_layouts {self._config.pool_layouts}"
            )
        remote = self._remote(request_id, key_list)
        handle = self._open(key_list)
        self._follow_move(handle, key_list, remote)
        self._commands.put(Fetch(handle, key_list, remote))
        return handle

    def deliver(
        self, blocks: Mapping[BlockKey, list[MemoryRef]], request_id: str | None = None
    ) -> OpHandle:
        self._check_open("deliver")
        destinations = self._resolve("deliver", blocks)
        remote = self._remote(request_id, destinations)
        keys = list(destinations)
        handle = self._open(keys)
        self._follow_move(handle, keys, remote)
        self._commands.put(Deliver(handle, keys, destinations, remote))
        return handle

    def _follow_move(self, handle: int, keys: list[BlockKey], remote: Hinted | None) -> None:
        """A ``move`` hint's peer may drop its copies only once the engine has every result
        of the operation: :meth:`poll_completed` confirms then (engine thread only)."""
        if remote is not None and remote.move:
            self._moves.follow(handle, keys)

    def release(self, handles: Iterable[ReleaseHandle]) -> list[ReleaseResult]:
        self._check_open("release")
        results: list[ReleaseResult] = []
        accepted = []
        for handle in handles:
            try:
                self._live_handles.remove(handle)
            except (KeyError, TypeError):
                results.append((handle, False))
            else:
                accepted.append(handle)
                results.append((handle, True))
        if accepted:
            self._commands.put(Release(accepted))
        return results

    def poll_completed(self) -> list[OpResult]:
        if not self._outbox.results and self._engine.idle():
            # What a turn would find: nothing. Something the runtime queues meanwhile is
            # for the next poll, as it would be if it came just after the turn.
            return []
        with self._engine.turn() as mine:
            if not mine:  # another engine thread is making the engine calls right now
                return []
            # Count results before making the engine calls: the runtime queues an
            # operation's inventory and resilience events (uncertain) before its entries,
            # so every result counted here has its events delivered first.
            results = self._outbox.results
            ready = len(results)
            self._engine.serve()
            taken = [results.popleft() for _ in range(ready)]  # only the turn's holder pops
            if self._moves:
                for handle in self._moves.taken(taken):
                    self._commands.put(Confirm(handle))
            return taken

    def abort(self, op_handle: OpHandle, keys: Sequence[BlockKey] | None = None) -> bool:
        self._check_open("abort")
        pending = self._open_ops.get(op_handle)
        if not pending:
            return False
        key_list = None if keys is None else list(keys)
        if key_list is not None and not any(k in pending for k in key_list):
            return False
        self._commands.put(Abort(op_handle, key_list))
        return True

    def get_stats(self) -> TelemetryStats | None:
        with self._engine.turn(wait=True) as mine:
            if mine:
                self._engine.serve()
            return self._instance.shared.telemetry.snapshot()

    def close(self) -> None:
        self._closed = True
        self._instance.close()

    def __enter__(self) -> KVCR:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
