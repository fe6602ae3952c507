"""Reading a guard service's Prometheus endpoint in tests (``--metrics-port 0``)."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from procs import GuardProcess, wait_until


def metrics_url(guard: GuardProcess) -> str:
    """The URL the service logged once its endpoint listened (port 0: any free port)."""
    found: list[str] = []

    def logged() -> bool:
        found[:] = re.findall(r"metrics_serving\S* url='?([^'\s]+)", guard.log())
        return bool(found)

    wait_until(logged, 30, "metrics_serving in the guard's log")
    return found[0]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample, by (name, labels)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def group_value(samples: dict, name: str, group: int, **labels: str) -> float:
    return samples[(name, tuple(sorted({"group": str(group), **labels}.items())))]
