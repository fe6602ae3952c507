"""The benchmarks' harness, the one module the scripts import: result rows and their output
(table and JSON lines), the command line and a script's ``main``, buffers, percentiles, CPU
accounting; and, from ``engine_loop.py``, kvcr instances and the guard service, the raw NIXL
baselines and the engine's loop (poll until done), re-exported here.

A script is the cases it measures: ``main`` hands :func:`run_main` a function that takes the
parsed arguments and returns its rows and notes. Importing this module sets the NIXL/UCX
environment defaults, then imports nixl (through ``engine_loop``).
"""

from __future__ import annotations

import os

# Must be set before nixl is imported (nixl-on-cpu.md); inherited by child processes.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import argparse
import json
import mmap
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from engine_loop import *  # noqa: F403  (the engine side: see engine_loop.__all__)

KIB = 1 << 10
MIB = 1 << 20


# -- results -----------------------------------------------------------------------------


@attrs.define
class Row:
    bench: str
    case: str
    value: float
    unit: str
    baseline: float | None = None
    target: str = ""
    ok: bool | None = None  # None: no target

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or not self.baseline:
            return None
        return self.value / self.baseline

    def as_json(self) -> str:
        ratio = self.ratio
        return json.dumps(
            {
                "bench": self.bench,
                "case": self.case,
                "value": round(self.value, 4),
                "unit": self.unit,
                "baseline": None if self.baseline is None else round(self.baseline, 4),
                "ratio": None if ratio is None else round(ratio, 4),
                "target": self.target,
                "ok": self.ok,
            }
        )


def idle_row(case: str, pct: float) -> Row:
    """An idle-CPU row: ``pct`` % of a core, target <= 2 %."""
    return Row("idle", case, pct, "% core", target="<=2 %", ok=pct <= 2.0)


def _fmt(x: float | None, by_magnitude: bool) -> str:
    """``x`` with 3 significant digits or so; ``by_magnitude=False`` picks the decimals by the
    signed value (a negative value gets 3), as local.py always has."""
    if x is None:
        return "-"
    size = abs(x) if by_magnitude else x
    if size >= 100:
        return f"{x:.0f}"
    if size >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if size >= 0.1 else f"{x:.3f}"


def print_table(rows: Sequence[Row], header: str, by_magnitude: bool = True) -> None:
    cols = ["bench", "case", "value", "unit", "baseline", "ratio", "target", "status"]
    table = [
        [
            r.bench,
            r.case,
            _fmt(r.value, by_magnitude),
            r.unit,
            _fmt(r.baseline, by_magnitude),
            _fmt(r.ratio, by_magnitude),
            r.target or "",
            "" if r.ok is None else ("PASS" if r.ok else "MISS"),
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    right = {2, 4, 5}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    print(header)
    print(line(cols))
    print(line(["-" * w for w in widths]))
    previous = None
    for r, t in zip(rows, table):
        if previous is not None and r.bench != previous:
            print()
        previous = r.bench
        print(line(t))
    print(flush=True)


def report(
    rows: Sequence[Row],
    notes: Sequence[str],
    title: str,
    args: argparse.Namespace,
    elapsed: float,
    by_magnitude: bool = True,
) -> None:
    """The human table, target count and notes (unless ``--json-only``), then one JSON line
    per row."""
    if not args.json_only:
        mode = "quick" if args.quick else "full"
        print_table(
            rows,
            f"{title} ({mode}, {elapsed:.0f} s, {os.cpu_count()} CPUs, "
            f"Python {sys.version.split()[0]})",
            by_magnitude,
        )
        missed = [r for r in rows if r.ok is False]
        print(f"targets: {sum(r.ok is True for r in rows)} PASS, {len(missed)} MISS")
        for note in notes:
            print(f"note: {note}")
        print()
    for row in rows:
        print(row.as_json())


def arguments(description: str, quick_help: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """``--quick``, ``--json-only`` and ``--runs N``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json-only", action="store_true", help="print only the JSON lines")
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="full runs in fresh processes, reported as median and spread (default 1)",
    )
    return parser.parse_args(argv)


def repeated(script: str, args: argparse.Namespace, title: str) -> int:
    """Run ``script`` ``args.runs`` times, each in a fresh process, and report every row as
    the median of its runs with their spread (min-max); a target holds only if it held in
    every run. Prints a table (unless ``--json-only``) and one JSON line per row with
    ``runs``, ``min`` and ``max`` added."""
    started = time.monotonic()
    runs: list[list[dict[str, Any]]] = []
    for run in range(args.runs):
        log(f"run {run + 1}/{args.runs}", args.json_only)
        command = [sys.executable, script, "--json-only", *(["--quick"] if args.quick else [])]
        done = subprocess.run(command, check=False, capture_output=True, text=True)
        if done.returncode:  # its stderr says why: it would be lost with the captured output
            sys.stderr.write(done.stderr)
            raise SystemExit(f"{script}: run {run + 1} failed (exit {done.returncode})")
        out = done.stdout
        runs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    merged: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rows in runs:
        for row in rows:
            merged.setdefault((row["bench"], row["case"]), []).append(row)
    table: list[Row] = []
    spreads: list[str] = []
    for (bench, case), samples in merged.items():
        values = [r["value"] for r in samples]
        bases = [r["baseline"] for r in samples if r["baseline"] is not None]
        oks = [r["ok"] for r in samples]
        ok = None if all(o is None for o in oks) else all(o is True for o in oks)
        ratios = [r["ratio"] for r in samples if r["ratio"] is not None]
        row = Row(
            bench,
            case,
            statistics.median(values),
            samples[0]["unit"],
            statistics.median(bases) if bases else None,
            samples[0]["target"],
            ok if len(samples) == args.runs else False,
        )
        table.append(row)
        spread = f"{min(values):.3g}-{max(values):.3g}"
        if ratios:
            spread += f" (ratio {min(ratios):.3g}-{max(ratios):.3g})"
        spreads.append(spread)
    elapsed = time.monotonic() - started
    if not args.json_only:
        print_table(table, f"{title}: median of {args.runs} runs ({elapsed:.0f} s)")
        print("spread (min-max over the runs) per row:")
        for row, spread in zip(table, spreads):
            print(f"  {row.bench} {row.case}: {spread}")
        missed = [r for r in table if r.ok is False]
        print(f"targets: {sum(r.ok is True for r in table)} PASS (every run), {len(missed)} MISS")
        print()
    for row, samples in zip(table, merged.values()):
        line = json.loads(row.as_json())
        values = [r["value"] for r in samples]
        line.update(runs=len(samples), min=min(values), max=max(values))
        print(json.dumps(line))
    return 0


def run_main(
    measure: Callable[[argparse.Namespace], tuple[list[Row], list[str]]],
    argv: Sequence[str] | None,
    title: str,
    quick_help: str,
    load: tuple[str, str] | None = None,
    children: bool = False,
    by_magnitude: bool = True,
) -> int:
    """A script's ``main``: the command line (the first paragraph of the docstring of
    ``measure``'s module describes the script); with ``--runs N``, :func:`repeated`; else
    ``measure(args)`` gives the rows and notes, and :func:`report` prints them. ``load``:
    (who, what needs the cores) for a closing note on the CPU other processes took meanwhile
    (:class:`MachineLoad`, ``children`` counted as this process's)."""
    script = sys.modules[measure.__module__]
    doc = script.__doc__ or ""
    args = arguments(doc.split("\n\n", maxsplit=1)[0], quick_help, argv)
    if args.runs > 1:
        assert script.__file__ is not None
        return repeated(script.__file__, args, title)
    started = time.monotonic()
    machine = MachineLoad(children) if load else None
    rows, notes = measure(args)
    elapsed = time.monotonic() - started
    if machine is not None and load is not None:
        notes.append(machine.note(elapsed, *load))
    report(rows, notes, title, args, elapsed, by_magnitude)
    return 0


_STARTED = time.monotonic()


def log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"# {time.monotonic() - _STARTED:5.1f} s  {msg}", file=sys.stderr, flush=True)


# -- buffers and statistics --------------------------------------------------------------


def touched(nbytes: int, fill: int = 0) -> np.ndarray:
    """A buffer whose pages are all faulted in (np.zeros would map them lazily)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(fill)
    return buf


def shared_pages(nbytes: int, fill: int = 0) -> np.ndarray:
    """Memory as engines give it to kvcr: a shared mapping (vLLM's secondary pool, the
    guard's /dev/shm pools), so 4 KiB pages (no transparent huge pages for shared memory
    here), all faulted in. The mapping lives as long as the array."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(mapping, dtype=np.uint8)
    buf.fill(fill)
    return buf


def hugetlb_pages(directory: Path, nbytes: int, fill: int) -> np.ndarray:
    """A shared mapping of a file on a hugetlbfs mount (as ``kvcr-guard --huge-pages``
    maps its groups): 2 MiB pages, reserved when the file is allocated."""
    size = -(-nbytes // (2 * MIB)) * 2 * MIB
    fd, name = tempfile.mkstemp(dir=directory)
    try:
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(name)  # the mapping keeps the pages until it goes
    buf = np.frombuffer(mapping, dtype=np.uint8)[:nbytes]
    buf.fill(fill)
    return buf


def bench_pages(nbytes: int, fill: int = 0) -> np.ndarray:
    """The scripts' memory: ``shared_pages``, or with ``KVCR_BENCH_HUGETLBFS=DIR`` (a
    hugetlbfs mount with free 2 MiB pages) huge pages from there, as ``kvcr-guard
    --huge-pages`` gives them."""
    directory = os.environ.get("KVCR_BENCH_HUGETLBFS")
    if directory:
        return hugetlb_pages(Path(directory), nbytes, fill)
    return shared_pages(nbytes, fill)


def page_kind(buf: np.ndarray) -> str:
    """What backs ``buf``: "hugetlb-2MiB" (hugetlbfs), "thp" if any of it is in transparent
    huge pages, else "4KiB"."""
    start = buf.ctypes.data
    end = start + buf.nbytes
    kind = "4KiB"
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "KernelPageSize:" and int(line.split()[1]) > 4:
                kind = f"hugetlb-{int(line.split()[1]) // 1024}MiB"
            elif inside and head == "AnonHugePages:" and int(line.split()[1]) > 0:
                kind = "thp"
    return kind


def randomized(nbytes: int, seed: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    np.random.default_rng(seed).random(out=buf.view(np.float64))
    return buf


def crcs(buf: np.ndarray, block: int, count: int) -> list[int]:
    return [zlib.crc32(buf[i * block : (i + 1) * block]) for i in range(count)]


def check_crcs(what: str, buf: np.ndarray, block: int, count: int, expected: list[int]) -> None:
    """Raise unless the ``count`` blocks of ``buf`` have the CRCs ``expected``."""
    if crcs(buf, block, count) != expected:
        raise RuntimeError(what)


def memcpy(dst: np.ndarray, src: np.ndarray) -> float:
    """Seconds of ``np.copyto(dst, src)``: the memcpy baseline (one thread)."""
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


def gbps(nbytes: int, seconds: Sequence[float]) -> tuple[float, float]:
    """GB/s of moving ``nbytes`` in the median and in the best of ``seconds``."""
    return nbytes / 1e9 / statistics.median(seconds), nbytes / 1e9 / min(seconds)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# -- CPU accounting ----------------------------------------------------------------------


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds of one thread, via its CPU clock (or /proc as a fallback)."""
    assert thread.ident is not None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, AttributeError):
        with open(f"/proc/self/task/{thread.native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuSpan:
    """Wall seconds, this process's CPU seconds and one thread's, from construction until
    ``end()``."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        self.wall0, self.proc0 = time.monotonic(), time.process_time()
        self.thread0 = thread_cpu_s(thread)

    def end(self) -> dict[str, float]:
        wall = time.monotonic() - self.wall0
        return {
            "wall": wall,
            "proc": time.process_time() - self.proc0,
            "thread": thread_cpu_s(self.thread) - self.thread0,
        }


def idle_cpu(
    thread: threading.Thread, seconds: float, begin: Callable[[], object] | None = None
) -> dict[str, float]:
    """:class:`CpuSpan` of ``thread`` over ``seconds`` of idling, after 1 s to settle
    (``begin`` runs then). The main thread sleeps: the process's CPU is kvcr's (and
    NIXL's)."""
    time.sleep(1.0)
    if begin is not None:
        begin()
    span = CpuSpan(thread)
    time.sleep(seconds)
    return span.end()


def cpu_busy_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal ...
    busy = sum(fields[:3]) + sum(fields[5:7])
    steal = fields[7] if len(fields) > 7 else 0
    return busy / tick, steal / tick


class MachineLoad:
    """How much CPU the rest of the machine takes from construction until ``note()``: kvcr
    needs both cores (engine thread and runtime thread) where memcpy and raw NIXL need one, so
    background load lowers kvcr's ratios. ``children``: count this process's (waited-for)
    children as its own."""

    def __init__(self, children: bool = False) -> None:
        self.children = children
        self.busy0, self.own0 = cpu_busy_s(), self._own()

    def _own(self) -> float:
        own = time.process_time()
        if self.children:
            t = os.times()
            own += t.children_user + t.children_system
        return own

    def note(self, wall: float, who: str, needs: str) -> str:
        busy1 = cpu_busy_s()
        own = self._own() - self.own0
        others = max(0.0, busy1[0] - self.busy0[0] - own)
        steal = busy1[1] - self.busy0[1]
        return (
            f"machine load during the run: other processes {100 * others / wall:.0f} % of a "
            f"core, steal {100 * steal / wall:.0f} % ({who} {100 * own / wall:.0f} %); {needs}, "
            "so compare runs with low background load"
        )
