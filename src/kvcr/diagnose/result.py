"""What a diagnose check finds, and what the whole run amounts to (pure code)."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

#: Exit codes of ``kvcr diagnose``: argparse's own 2 stays the bad-flags code.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_FLAGS = 2


class Status(enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIPPED = "skipped"


def _fix_when_not_ok(instance: CheckResult, _: attrs.Attribute[Any], fix: str | None) -> None:
    # A warning or failure without a way out is a dead end for the operator reading it.
    if instance.status in (Status.WARN, Status.FAIL) and not fix:
        raise ValueError(f"check {instance.name!r}: a {instance.status.value} result needs a fix")


@attrs.frozen
class CheckResult:
    """One check: ``summary`` is its line in the table, ``details`` its record for tickets
    (JSON values only), ``fix`` what to do when it is not ok, and ``extra`` lines shown under
    the table in text output (the guard's group table)."""

    name: str = attrs.field(validator=attrs.validators.min_len(1))
    status: Status = attrs.field(validator=attrs.validators.instance_of(Status))
    summary: str
    details: Mapping[str, Any] = attrs.field(factory=dict)
    fix: str | None = attrs.field(default=None, validator=_fix_when_not_ok)
    extra: tuple[str, ...] = ()

    @classmethod
    def ok(cls, name: str, summary: str, details: Mapping[str, Any] | None = None) -> CheckResult:
        return cls(name, Status.OK, summary, details or {})

    @classmethod
    def warn(
        cls, name: str, summary: str, fix: str, details: Mapping[str, Any] | None = None
    ) -> CheckResult:
        return cls(name, Status.WARN, summary, details or {}, fix)

    @classmethod
    def fail(
        cls, name: str, summary: str, fix: str, details: Mapping[str, Any] | None = None
    ) -> CheckResult:
        return cls(name, Status.FAIL, summary, details or {}, fix)

    @classmethod
    def skipped(cls, name: str, why: str) -> CheckResult:
        return cls(name, Status.SKIPPED, why)


def _as_tuple(checks: Iterable[CheckResult]) -> tuple[CheckResult, ...]:
    return tuple(checks)


@attrs.frozen
class Report:
    """Every check of one run, in the order they ran; names are unique (they key the JSON)."""

    checks: tuple[CheckResult, ...] = attrs.field(converter=_as_tuple)

    @checks.validator
    def _unique(self, _: attrs.Attribute[Any], checks: Sequence[CheckResult]) -> None:
        names = [c.name for c in checks]
        if len(set(names)) != len(names):
            raise ValueError(f"check names repeat: {names}")

    def counts(self) -> dict[str, int]:
        return {s.value: sum(c.status is s for c in self.checks) for s in Status}

    @property
    def failed(self) -> bool:
        return any(c.status is Status.FAIL for c in self.checks)

    @property
    def exit_code(self) -> int:
        """Warnings and skipped checks still pass: only a failure makes the run fail."""
        return EXIT_FAILED if self.failed else EXIT_OK

    @property
    def outcome(self) -> str:
        if self.failed:
            return Status.FAIL.value
        if any(c.status is Status.WARN for c in self.checks):
            return Status.WARN.value
        return Status.OK.value

    def get(self, name: str) -> CheckResult:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)
