"""The guard service program: ``kvcr-guard`` and ``python -m kvcr.kvcr_service`` (contract 10).

See :mod:`kvcr.guard.service` for what it does and :mod:`kvcr.guard.cli` for its flags.
"""

from __future__ import annotations

import sys

from kvcr.guard.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
