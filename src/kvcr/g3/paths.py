"""Placeholders in G3 paths: one ``G3Options.paths`` for every data-parallel rank.

An engine that starts one KVCR per local rank hands every rank the same configuration, but a
G3 file has one owner (``files.py`` locks it). So a path may name the instance:

- ``{agent}``: the instance's NIXL agent name, made safe for a file name (:func:`safe_name`);
- ``{guard_index}``: the index of the guard pool group it holds (only with a guard).

They are expanded once per instance, when it is built (:func:`expand`). Every other brace
is an error, ``{{`` and ``}}`` included: with ``str.format``'s escapes, a path that named a
file with braces in it before placeholders existed would now silently name another file,
and the G3 data in the old one would be lost without a word. Refusing keeps one rule
(a brace starts a placeholder) and makes an expanded path a plain file name.
"""

from __future__ import annotations

import glob
import re
import reprlib
import string
from collections.abc import Sequence
from pathlib import Path

PLACEHOLDERS = ("agent", "guard_index")
ACCEPTED = (
    "G3 paths accept only the placeholders {agent} (the NIXL agent name) and {guard_index} "
    "(the guard's pool group index), and no other braces"
)

NEEDS_GUARD = (
    "{guard_index} needs a guard (KVCR's guard_config), whose pool group index it expands "
    "to; without one, use {agent}"
)

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 120
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def _shown(text: str) -> str:
    return _short.repr(text)


def placeholders(template: str, where: str) -> frozenset[str]:
    """The placeholders ``template`` uses; a ValueError starting with ``where`` if it has
    an unknown one, one with a conversion or format spec, or any other brace."""
    try:
        # parse is lazy: a malformed template fails while it is being iterated.
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"{where}: unbalanced brace in {_shown(template)} ({exc}); {ACCEPTED}"
        ) from None
    found: set[str] = set()
    for literal, field, spec, conversion in parsed:
        if "{" in literal or "}" in literal:  # what is left of an escaped '{{' or '}}'
            raise ValueError(
                f"{where}: {_shown(template)} has a literal brace ('{{{{' or '}}}}'); {ACCEPTED}"
            )
        if field is None:
            continue
        if field not in PLACEHOLDERS:
            raise ValueError(
                f"{where}: unknown placeholder {_shown('{' + field + '}')} in "
                f"{_shown(template)}; {ACCEPTED}"
            )
        if conversion is not None or spec:
            suffix = (f"!{conversion}" if conversion is not None else "") + (
                f":{spec}" if spec else ""
            )
            raise ValueError(
                f"{where}: placeholder {{{field}}} takes no conversion or format spec, got "
                f"{_shown('{' + field + suffix + '}')} in {_shown(template)}; {ACCEPTED}"
            )
        found.add(field)
    return frozenset(found)


def safe_name(name: str) -> str:
    """``name`` as one file name component: every character but ``[A-Za-z0-9._-]`` becomes
    ``_`` (so no ``/`` can climb out of the directory), and the names that are not a file of
    their own (empty, ``.``, ``..``) become underscores."""
    safe = _UNSAFE.sub("_", name)
    if safe in ("", ".", ".."):
        return "_" * max(1, len(safe))
    return safe


def file_identity(path: Path) -> tuple[Path, object]:
    """The resolved name of ``path`` and what identifies its file: (device, inode) when it
    exists (hard links and bind mounts alias by inode), else the resolved name (symlinks and
    ``..`` alias by name). OSError, RuntimeError (a symlink loop) or ValueError when it
    cannot be resolved."""
    resolved = path.expanduser().resolve()
    try:
        st = resolved.stat()
    except OSError:
        return resolved, resolved
    return resolved, (st.st_dev, st.st_ino)


def expand(
    templates: Sequence[Path],
    *,
    agent: str,
    guard_index: int | None,
    where: str = "G3Options: paths",
) -> tuple[Path, ...]:
    """This instance's files: ``templates`` with ``{agent}`` and ``{guard_index}`` expanded.
    A ValueError naming the paths if ``{guard_index}`` has no guard, or two of them expand to
    one file."""
    values = {"agent": safe_name(agent)}
    if guard_index is not None:
        values["guard_index"] = str(guard_index)
    files: list[Path] = []
    seen: dict[object, int] = {}
    for i, template in enumerate(templates):
        text = str(template)
        if "guard_index" in placeholders(text, f"{where}[{i}]") and guard_index is None:
            raise ValueError(f"{where}[{i}] ({_shown(text)}): {NEEDS_GUARD}")
        path = Path(text.format(**values))
        try:
            resolved, identity = file_identity(path)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ValueError(
                f"{where}[{i}] ({_shown(text)}) expands to {path}, which cannot be resolved: {exc}"
            ) from None
        for same in (identity, resolved):
            if same in seen:
                j = seen[same]
                raise ValueError(
                    f"{where}[{i}] ({_shown(text)}) and paths[{j}] "
                    f"({_shown(str(templates[j]))}) expand to the same file {path} for agent "
                    f"{_shown(agent)}"
                    + ("" if guard_index is None else f" and guard index {guard_index}")
                )
        seen[identity] = seen[resolved] = i
        files.append(path)
    return tuple(files)


def instances_glob(template: Path) -> str | None:
    """A glob of the files ``template`` names for every instance (``{agent}`` as ``*``,
    the rest matched literally), or None when the template does not name the instance.
    Templates are checked (:func:`placeholders`), so every brace is a placeholder."""
    text = str(template)
    if "{agent}" not in text:
        return None
    return "*".join(glob.escape(part) for part in text.split("{agent}"))


def in_use(path: Path, template: Path, index: int) -> str:
    """Why a second instance cannot have the G3 file at ``path`` (expanded from
    ``G3Options.paths[index]``, ``template``), and how to give each instance its own."""
    text = str(template)
    held = "in use by another live KVCR instance (it holds the file's lock; one owner per file)"
    if "{" in text:  # a placeholder: templates have no other braces
        return (
            f"{held}. G3Options.paths[{index}] ({_shown(text)}) expanded to this same file for "
            "both instances: each needs its own NIXL agent name ({agent}) or guard index "
            "({guard_index})"
        )
    example = path.with_name(f"{path.stem}-{{agent}}{path.suffix}")
    return (
        f"{held}. If data-parallel ranks share G3Options.paths, put {{agent}} (the NIXL agent "
        f"name) or {{guard_index}} (the guard's pool group index) in paths[{index}] so that "
        f"each rank gets its own file, e.g. {_shown(str(example))}"
    )
