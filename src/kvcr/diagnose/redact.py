"""What must not leave the machine in a diagnostic record: masking secret-named variables,
and scrubbing every known secret value (the cluster key above all) out of any text (pure
code, but for reading the key file that ``KVCR_CLUSTER_KEY_FILE`` names)."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvcr.transport.auth import KEY_ENV, KEY_FILE_ENV

#: Variable names whose values are never shown: the peer cluster key, and anything named
#: like a credential (cloud, registry and hub tokens sit in engine environments).
SECRET_NAME = re.compile(
    r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL|PRIVATE|COOKIE|SESSION|AUTH|SIGNATURE", re.IGNORECASE
)
REDACTED = "<redacted>"
#: Shorter values of secret-named variables are left for the mask alone: scrubbing "1" or
#: "true" out of every text would mangle the record and protect nothing.
MIN_SCRUBBED = 8
#: The cluster key is scrubbed down to this length: kvcr refuses keys under 16 bytes, but a
#: short (refused) key is still someone's secret.
MIN_KEY_SCRUBBED = 4
# user:password@ in a URL (a proxy, a registry, an etcd endpoint).
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s:]+:[^/@\s]+@")
# NAME=value, NAME: value, "name": "value" in free text (log lines), where NAME ends in a
# credential's word. Narrower than SECRET_NAME: log fields such as ``keys=1024`` or a block's
# ``key=b'...'`` are not secrets, and a ticket needs them.
_ASSIGNMENT = re.compile(
    r"(?P<name>\b[\w.-]*(?:KEY|SECRET|TOKEN|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?|COOKIE"
    r"|AUTH|AUTHORIZATION))(?P<sep>\"?\s*[=:]\s*\"?(?:Bearer\s+|Basic\s+)?)"
    r"(?P<value>[^\s\"',}]{4,})",
    re.IGNORECASE,
)


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def shown_value(name: str, value: str) -> str:
    """A variable's value as a record may show it: masked when the name looks secret,
    without the credentials of a URL otherwise."""
    if is_secret_name(name):
        return f"<set, {len(value)} characters, not shown>"
    return _URL_CREDENTIALS.sub(rf"\g<scheme>{REDACTED}@", value)


def masked(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: shown_value(name, value) for name, value in sorted(environ.items())}


def _forms(secret: bytes) -> set[bytes]:
    """The secret, and the encodings it could be written in (hex, base64)."""
    encoded = {
        secret,
        secret.hex().encode(),
        secret.hex().upper().encode(),
        base64.b64encode(secret),
        base64.urlsafe_b64encode(secret),
    }
    # Without the padding too: "=" is often dropped, and the rest still carries the key.
    return {form.rstrip(b"=") for form in encoded} | encoded


def cluster_key(environ: Mapping[str, str]) -> tuple[bytes | None, str | None]:
    """The cluster key this environment configures (however invalid for kvcr), and why it
    could not be read, if it could not. Never raises: a record is made of broken setups."""
    value = environ.get(KEY_ENV)
    if value:
        return value.encode(), None
    path = environ.get(KEY_FILE_ENV)
    if not path:
        return None, None
    try:
        return Path(path).read_bytes().strip() or None, None
    except OSError as exc:
        return None, f"{KEY_FILE_ENV}: cannot read the key file: {exc.strerror}"


class Scrubber:
    """Replaces every form of every known secret with ``<redacted>``, in bytes, text and
    JSON values; counts what it replaced."""

    def __init__(self, secrets: Iterable[bytes] = ()) -> None:
        self._forms: set[bytes] = set()
        self.replaced = 0
        for secret in secrets:
            self.add(secret)

    def add(self, secret: bytes, minimum: int = MIN_SCRUBBED) -> None:
        if len(secret) >= minimum:
            self._forms |= _forms(secret)

    def add_environment(self, environ: Mapping[str, str]) -> str | None:
        """The cluster key and every secret-named value of ``environ``; returns why the key
        file could not be read, if it could not (its key then cannot be scrubbed)."""
        key, problem = cluster_key(environ)
        if key is not None:
            self.add(key, MIN_KEY_SCRUBBED)
        for name, value in environ.items():
            if is_secret_name(name):
                self.add(value.encode())
        return problem

    @property
    def count(self) -> int:
        """How many byte strings are scrubbed (each secret in several forms)."""
        return len(self._forms)

    def bytes(self, data: bytes) -> bytes:
        # Longest first: a form that contains another is replaced whole.
        for form in sorted(self._forms, key=len, reverse=True):
            found = data.count(form)
            if found:
                self.replaced += found
                data = data.replace(form, REDACTED.encode())
        return data

    def text(self, text: str) -> str:
        return self.bytes(text.encode("utf-8", "surrogateescape")).decode(
            "utf-8", "surrogateescape"
        )

    def value(self, value: Any) -> Any:
        """A JSON value with every string (keys included) scrubbed: before serializing, as
        JSON escapes would hide a key that holds a quote or a backslash from :meth:`bytes`."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.text(str(k)): self.value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value


def mask_assignments(text: str) -> str:
    """Free text (log lines) with the value of every secret-looking ``NAME=value`` and the
    password of every URL masked: a secret this process cannot know (another process's key)
    may still be written so."""

    def mask(match: re.Match[str]) -> str:
        if match["name"].lower() == "key":  # a block's key, not a credential
            return match[0]
        return f"{match['name']}{match['sep']}{REDACTED}"

    return _URL_CREDENTIALS.sub(rf"\g<scheme>{REDACTED}@", _ASSIGNMENT.sub(mask, text))
