"""Child program for guard-service tests: claims a pool group and then obeys stdin.

Run as ``python claimant_proc.py SOCKET INDEX DIGEST LAYOUT_BLOCK``. It prints one JSON line
per event to stdout: ``{"claimed": lease, "port": p}`` or ``{"refused": message}``, then
reads commands, one per line:

- ``release``: release the hold and print ``{"released": true}``;
- ``fork``: fork a child that tries to use the hold; print what the child saw;
- ``exec``: replace this program (same pid) by one that just waits for stdin to close.
"""

from __future__ import annotations

import json
import os
import sys

from kvcr import KVCRClient
from kvcr.errors import KVCRServiceError


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


def forked_child_view(hold: object, path: str) -> dict[str, object]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: is anything of the hold here?
        os.close(read)
        with open("/proc/self/maps") as maps:
            mapped = path in maps.read()
        try:
            hold.release()  # type: ignore[attr-defined]
            released = "released"
        except KVCRServiceError as exc:
            released = str(exc)
        os.write(write, json.dumps({"mapped": mapped, "release": released}).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        seen = json.loads(pipe.read())
    os.waitpid(pid, 0)
    return seen


def main() -> None:
    socket_path, index, digest, block = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    try:
        hold = KVCRClient(socket_path).claim(index, [("", block)], digest, ("127.0.0.1", 0))
    except KVCRServiceError as exc:
        say(refused=str(exc))
        return
    say(claimed=hold.lease, port=hold.control_address[1])
    path = hold.group_path
    for line in sys.stdin:
        command = line.strip()
        if command == "release":
            hold.release()
            say(released=True)
        elif command == "fork":
            say(**forked_child_view(hold, path))
        elif command == "exec":
            sys.stdout.flush()
            os.execv(sys.executable, [sys.executable, "-c", "import sys; sys.stdin.read()"])


if __name__ == "__main__":
    main()
