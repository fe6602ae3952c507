"""Fixtures of ``tests/vllm`` (the harness is ``vllm_harness.py``): every test skips, with
the reason, where vLLM is not installed; ``model_dir`` and ``engines``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tiny_model import write_model
from vllm_harness import SHM, Engine, vllm_missing

VLLM_MISSING = vllm_missing()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if VLLM_MISSING is not None:
        pytest.skip(VLLM_MISSING)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture
def engines(tmp_path: Path, model_dir: Path) -> Iterator[Callable[..., Engine]]:
    """``engines(tier, **options)`` starts an :class:`Engine`; the teardown ends every
    engine the test started and checks that nothing of theirs is left: no process, and
    in ``/dev/shm`` nothing new but vLLM's own offload-region files and multiprocessing
    segments of these engines, which vLLM cannot remove when it kills its worker (they are
    removed here)."""
    shm_before = set(SHM.iterdir())
    started: list[Engine] = []

    def start(tier: dict[str, Any], **options: Any) -> Engine:
        engine = Engine(model_dir, tmp_path, tier, **options)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.end()
    ours = {path for engine in started for path in engine.shm_files()}
    # vLLM's multiprocessing shared memory (psm_*, up to 250 MB each) is its resource
    # tracker's to remove, and the tracker died with the engine's process group: the new
    # segments that no live process maps are the ended engines'.
    ours |= unmapped({p for p in set(SHM.glob("psm_*")) - shm_before})
    for path in ours:
        path.unlink(missing_ok=True)
    # A segment still mapped is another live process's, such as a vLLM beside this one.
    left = sorted(
        p.name for p in set(SHM.iterdir()) - shm_before - ours if not p.name.startswith("psm_")
    )
    assert not left, f"files left in /dev/shm: {left}"


def unmapped(paths: set[Path]) -> set[Path]:
    """Those of ``paths`` that no process on this machine maps (another session's vLLM
    may run beside this one)."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(maxsplit=5)[-1] for line in maps.read_text().splitlines())
        except OSError:  # a process that ended meanwhile
            continue
    return {path for path in paths if str(path) not in mapped}
