"""``kvcr diagnose``: the minimum diagnostic record of a machine that runs kvcr, in one
command (versions and import paths, NIXL backends, UCX transports and devices, a NIXL
self-test, the control port, the guard service); with ``--bundle``, that and the tier
config, its endpoints and a log's last minutes in one archive (:mod:`kvcr.diagnose.bundle`).
See :mod:`kvcr.diagnose.cli`."""

from kvcr.diagnose.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
