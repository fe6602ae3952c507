"""The guard service: a trio server that owns the pool groups and lends them (contract 10).

Startup, in this order, so that no worker ever sees a half-built service:

1. take the socket's lock file (``<socket>.lock``): one service per socket path;
2. replace a stale socket (nobody listening), refuse a live one;
3. reclaim group files that a dead service left in ``--pool-dir`` (nobody holds their lock);
4. adopt, *detached*, the group files a dead service left that a live worker still maps (that
   worker re-attaches; the file is never touched meanwhile); a file of other
   ``--pool-sizes-gb`` makes its group unusable for this service, with the reason;
5. create every other group file, fully allocated (a full disk fails here, never as a SIGBUS
   later);
6. bind and listen on the Unix socket (mode 0600).

Then one supervisor nursery runs a :class:`Guard` task per group, which watches the
holder's pidfd, and the accept loop, which serves each connection in a task of its own
(``connections.py``: requests, claims, releases, status). A Guard that fails
takes the whole service down (non-zero exit): a service that cannot fence its leases must
not keep lending. On the way out (also on SIGINT / SIGTERM) the socket and the group files
are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
from pathlib import Path
from typing import Any

import attrs
import trio

from kvcr.guard.connections import Connections
from kvcr.guard.guard import Guard
from kvcr.guard.metrics import (
    GroupReading,
    MetricsEndpoint,
    ServiceCollector,
    Tally,
    registry_of,
)
from kvcr.guard.pools import (
    GroupFile,
    adopt_group_file,
    create_group_file,
    group_file_path,
    plan_group,
    reclaim_orphans,
)
from kvcr.guard.rules import Groups, GroupState


class ServiceStartError(RuntimeError):
    """The service cannot start; the message names the flag, path or resource."""


@attrs.frozen
class ServiceConfig:
    socket_path: Path
    pool_dir: Path
    guard_count: int
    pool_sizes: list[int]  # bytes, page-rounded, one per ordered pool of every group
    compatibility_digest: str
    idle_timeout_s: float = 5.0  # a connection that sends nothing for this long is closed
    allowed_gid: int | None = None  # besides the service's uid: members of this group
    huge_page_size: int | None = None  # --huge-pages: the pools' page size (hugetlbfs)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # --metrics-port: serve Prometheus metrics (0: any port)
    heartbeat_timeout_s: float | None = None  # --heartbeat-timeout-ms: fence silent holders


class GuardService:
    def __init__(self, config: ServiceConfig, log: Any) -> None:
        self.config = config
        self.log = log
        self.groups = Groups(config.guard_count, config.pool_sizes, config.compatibility_digest)
        self.layout = plan_group(config.pool_sizes)
        self.guards: list[Guard] = []
        self.tally = Tally.of(config.guard_count)
        self._lock_fd: int | None = None
        self._listener: trio.socket.SocketType | None = None
        self._socket_id: tuple[int, int] | None = None
        self.connections = Connections(
            self.groups,
            self.guards,  # filled by _start
            self.layout,
            self.tally,
            config.idle_timeout_s,
            config.allowed_gid,
            log,
            heartbeat=config.heartbeat_timeout_s is not None,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start (see module docstring), serve until cancelled, and clean up."""
        try:
            self._start()
            assert self._listener is not None
            async with trio.open_nursery() as supervisor:
                for guard in self.guards:
                    guard.nursery = supervisor
                    supervisor.start_soon(self._supervise, guard)
                    supervisor.start_soon(guard.follow)
                    if self.groups[guard.index].state is GroupState.DETACHED:
                        supervisor.start_soon(guard.wait_detached)
                supervisor.start_soon(self.connections.accept, self._listener, supervisor)
                if self.config.metrics_port is not None:
                    await self._start_metrics(supervisor)
                self.log.info(
                    "service_ready",
                    socket=str(self.config.socket_path),
                    groups=self.config.guard_count,
                    pools=len(self.config.pool_sizes),
                    group_bytes=self.layout.total_size,
                    heartbeat_timeout_ms=None
                    if self.config.heartbeat_timeout_s is None
                    else round(1000 * self.config.heartbeat_timeout_s),
                )
                task_status.started(self)
        finally:
            self._stop()

    async def _start_metrics(self, nursery: trio.Nursery) -> None:
        """Serve the metrics endpoint beside the service; if it cannot bind, or fails later,
        the service logs why and goes on lending pools without it."""
        cfg = self.config
        assert cfg.metrics_port is not None
        collector = ServiceCollector(self.tally, self._readings)
        endpoint = MetricsEndpoint(registry_of(collector), self.log)
        where = f"--metrics-host {cfg.metrics_host} --metrics-port {cfg.metrics_port}"
        try:
            listener = await endpoint.bind(cfg.metrics_host, cfg.metrics_port)
        except OSError as exc:
            self.log.error("metrics_failed", reason=f"{where}: cannot listen: {exc}")
            return
        host, port = listener.socket.getsockname()[:2]
        self.log.info("metrics_serving", url=f"http://{host}:{port}/metrics")

        async def serve() -> None:
            try:
                await endpoint.serve(listener)
            except Exception as exc:
                self.log.error("metrics_failed", reason=f"{where}: {exc!r}")

        nursery.start_soon(serve)

    def _readings(self) -> list[GroupReading]:
        return [
            GroupReading(status, guard.serving_blocks(), guard.serving_g3_blocks())
            for status, guard in zip(self.connections.status(), self.guards)
        ]

    async def _supervise(self, guard: Guard) -> None:
        try:
            await guard.run()
        except BaseException as exc:
            if not isinstance(exc, trio.Cancelled):
                self.log.error("guard_failed", group=guard.index, error=repr(exc))
            raise
        raise RuntimeError(f"guard of group {guard.index} stopped")

    def _start(self) -> None:
        cfg = self.config
        self._lock_socket(cfg.socket_path)
        self._clear_stale_socket(cfg.socket_path)
        reclaimed, kept = reclaim_orphans(cfg.pool_dir)
        for path in reclaimed:
            self.log.info("orphan_reclaimed", path=str(path))
        held = {group_file_path(cfg.pool_dir, i): i for i in range(cfg.guard_count)}
        for path in kept:
            if path not in held:
                self.log.warning("group_file_in_use", path=str(path), reason="not a group here")
        for index in range(cfg.guard_count):
            path = group_file_path(cfg.pool_dir, index)
            group_file = self._adopt(index) if path in kept else self._create(index)
            try:
                self.guards.append(
                    Guard(
                        index,
                        group_file,
                        self.groups,
                        self.log,
                        self.tally.groups[index],
                        cfg.heartbeat_timeout_s,
                    )
                )
            except BaseException:
                if group_file is not None:
                    group_file.close(unlink=path not in kept)
                raise
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # The socket is created 0600 (0660 with an allowed group), never briefly wider.
            old_umask = os.umask(0o177 if cfg.allowed_gid is None else 0o117)
            try:
                listener.bind(str(cfg.socket_path))
                if cfg.allowed_gid is not None:
                    os.chown(cfg.socket_path, -1, cfg.allowed_gid)
            finally:
                os.umask(old_umask)
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise ServiceStartError(
                f"--socket-path {cfg.socket_path}: cannot bind: {exc}"
            ) from None
        st = os.stat(cfg.socket_path)
        self._socket_id = (st.st_dev, st.st_ino)
        self._listener = trio.socket.from_stdlib_socket(listener)
        self.log.info(
            "pools_created",
            groups=cfg.guard_count,
            group_bytes=self.layout.total_size,
            page_bytes=cfg.huge_page_size or os.sysconf("SC_PAGE_SIZE"),
            huge_pages=cfg.huge_page_size is not None,
        )

    def _create(self, index: int) -> GroupFile:
        cfg = self.config
        try:
            return create_group_file(cfg.pool_dir, index, self.layout, cfg.allowed_gid)
        except FileExistsError:
            raise ServiceStartError(
                f"--pool-dir {cfg.pool_dir}: group file for group {index} appeared while the "
                "service started (another process writes this directory)"
            ) from None
        except OSError as exc:
            raise ServiceStartError(f"--pool-dir {cfg.pool_dir}: {exc}") from None

    def _adopt(self, index: int) -> GroupFile | None:
        """The group file a live worker of a dead service still maps: adopted detached, or
        None (the group unusable here) if it does not fit this service's flags."""
        path = group_file_path(self.config.pool_dir, index)
        try:
            adopted = adopt_group_file(self.config.pool_dir, index, self.layout)
        except (OSError, ValueError) as exc:
            reason = (
                f"{exc}; restart the service with the flags of the one that created it, or "
                "stop the worker that maps it"
            )
            self.groups.detach(index, reason)
            self.log.error("group_file_unfit", group=index, path=str(path), reason=reason)
            return None
        self.groups.detach(index)
        self.log.warning(
            "group_detached",
            group=index,
            path=str(path),
            reason="a live worker of the service that ran before maps it; it can re-attach",
        )
        return adopted

    def _lock_socket(self, path: Path) -> None:
        lock_path = f"{path}.lock"
        try:
            fd = os.open(lock_path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise ServiceStartError(
                f"--socket-path {path}: cannot open {lock_path}: {exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ServiceStartError(
                f"--socket-path {path}: another kvcr-guard is running on this socket"
            ) from None
        self._lock_fd = fd

    def _clear_stale_socket(self, path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ServiceStartError(f"--socket-path {path}: exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
            self.log.info("stale_socket_replaced", socket=str(path))
            return
        except OSError as exc:
            raise ServiceStartError(f"--socket-path {path}: cannot probe: {exc}") from None
        finally:
            probe.close()
        raise ServiceStartError(f"--socket-path {path}: a live service listens on it")

    def _stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                st = os.stat(self.config.socket_path)
                if (st.st_dev, st.st_ino) == self._socket_id:
                    os.unlink(self.config.socket_path)
        for guard in self.guards:
            try:
                guard.close()
            except Exception as exc:  # the other groups are still cleaned up
                self.log.warning("group_cleanup_failed", group=guard.index, error=repr(exc))
        self.guards.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the lock file stays: unlinking it would race a new service
            self._lock_fd = None
        self.log.info("service_stopped")
