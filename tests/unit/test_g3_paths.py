"""Placeholders in G3 paths (``kvcr.g3.paths``): which templates ``G3Options`` accepts, the
safe file name ``{agent}`` expands to, and the checks made when ``KVCR(...)`` expands them
(before any memory or NIXL agent is touched)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_sim import EngineSim, Recorder
from kvcr import KVCR
from kvcr.config import PAGE_SIZE, G3Options
from kvcr.g3.paths import instances_glob, safe_name

BLOCK = 16 * PAGE_SIZE


def g3(*paths: object) -> G3Options:
    return G3Options(paths=tuple(paths), capacity_bytes_per_file=4 * BLOCK)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "template",
    [
        "g3-{agent}.bin",
        "g3-{guard_index}.bin",
        "{agent}/g3-{guard_index}.bin",
        "{agent}-{agent}.bin",  # the same placeholder twice
        "g3.bin",  # none: the one-instance configuration of before
    ],
)
def test_accepted_templates_are_kept_as_written(tmp_path, template) -> None:
    options = g3(tmp_path / "other.bin", tmp_path / template)
    assert options.paths == (tmp_path / "other.bin", tmp_path / template)
    # A template is part of the options' value: it rebuilds equal from its own fields.
    assert G3Options(**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)}) == (
        options
    )


def test_an_empty_format_spec_is_no_spec() -> None:
    # str.format reads '{agent:}' as '{agent}'; string.Formatter cannot tell them apart.
    assert g3("/g3/{agent:}.bin").paths == (Path("/g3/{agent:}.bin"),)


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("g3-{rank}.bin", "unknown placeholder '{rank}'"),
        ("g3-{Agent}.bin", "unknown placeholder '{Agent}'"),
        ("g3-{}.bin", "unknown placeholder '{}'"),
        ("g3-{0}.bin", "unknown placeholder '{0}'"),
        ("g3-{agent.name}.bin", "unknown placeholder '{agent.name}'"),
        ("g3-{agent[0]}.bin", "unknown placeholder '{agent[0]}'"),
        ("g3-{agent!r}.bin", "no conversion or format spec, got '{agent!r}'"),
        ("g3-{agent!s}.bin", "no conversion or format spec, got '{agent!s}'"),
        ("g3-{guard_index:03}.bin", "no conversion or format spec, got '{guard_index:03}'"),
        ("g3-{agent:>3}.bin", "no conversion or format spec, got '{agent:>3}'"),
        ("g3-{agent:{guard_index}}.bin", "no conversion or format spec"),
        ("g3-{agent.bin", "unbalanced brace"),
        ("g3-agent}.bin", "unbalanced brace"),
        ("g3-{{agent}}.bin", "literal brace"),
        ("g3-{{.bin", "literal brace"),
        ("{agent}/g3-}}.bin", "literal brace"),
    ],
)
def test_a_malformed_template_is_refused_naming_the_path_and_the_placeholders(
    tmp_path, template, why
) -> None:
    with pytest.raises(ValueError) as caught:
        g3(tmp_path / "ok-{agent}.bin", tmp_path / template)
    text = str(caught.value)
    assert text.startswith("G3Options: paths[1]: "), text
    assert why in text
    assert "{agent}" in text and "{guard_index}" in text  # what is accepted instead
    assert len(text) < 1000


def test_a_huge_unknown_placeholder_gives_a_bounded_message() -> None:
    with pytest.raises(ValueError, match=r"G3Options: paths\[0\]: unknown placeholder") as caught:
        g3("/g3/{" + "x" * 100_000 + "}")
    assert len(str(caught.value)) < 1000


def test_two_spellings_of_one_template_are_one_file_for_every_instance(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"G3Options: paths\[1\]: .* aliases"):
        g3(tmp_path / "g3-{agent}.bin", tmp_path / "sub" / ".." / "g3-{agent}.bin")


# --- the safe file name of {agent} ----------------------------------------------------------


@pytest.mark.parametrize(
    ("agent", "name"),
    [
        ("vllm-worker-0", "vllm-worker-0"),
        ("engine.0_dp-1", "engine.0_dp-1"),
        ("rank/0", "rank_0"),
        ("../../etc/passwd", ".._.._etc_passwd"),
        ("dp 0:tp 1", "dp_0_tp_1"),
        ("agént", "ag_nt"),
        ("a\x00b", "a_b"),
        (".", "_"),
        ("..", "__"),
        ("", "_"),
        ("...", "..."),  # an ordinary file name
        (".hidden", ".hidden"),
    ],
)
def test_an_agent_name_becomes_one_safe_file_name(agent, name) -> None:
    assert safe_name(agent) == name


@given(st.text())
def test_a_safe_name_is_always_a_single_plain_file_name(agent) -> None:
    name = safe_name(agent)
    assert re.fullmatch(r"[A-Za-z0-9._-]+", name)
    assert name not in (".", "..")
    assert Path(name).name == name  # one component, nothing to climb out with
    if re.fullmatch(r"[A-Za-z0-9._-]+", agent) and agent not in (".", ".."):
        assert name == agent  # names that are safe already stay as they are


# --- expansion at KVCR(...) -------------------------------------------------------------------


def kvcr_with(options: G3Options, name: str = "w0") -> KVCR:
    engine = EngineSim(name=name, layouts=[("", BLOCK)], pool_blocks=4)
    backends = dataclasses.replace(engine.backend_configs, g3=options)
    return KVCR(engine.config, Recorder().bindings(), backends)


def test_guard_index_without_a_guard_is_refused_at_construction(tmp_path) -> None:
    options = g3(tmp_path / "a.bin", tmp_path / "g3-{guard_index}.bin")  # fine on its own
    with pytest.raises(ValueError) as caught:
        kvcr_with(options)
    text = str(caught.value)
    assert text.startswith("G3Options: paths[1] (")
    assert "{guard_index} needs a guard" in text and "guard_config" in text
    assert not list(tmp_path.iterdir())  # refused before any file was made


def test_two_templates_that_expand_to_one_file_are_refused_naming_both(tmp_path) -> None:
    options = g3(tmp_path / "g3-{agent}.bin", tmp_path / "g3-w0.bin")  # distinct as written
    with pytest.raises(ValueError) as caught:
        kvcr_with(options, name="w0")
    text = str(caught.value)
    assert text.startswith("G3Options: paths[1] (")
    assert "g3-w0.bin" in text and "g3-{agent}.bin" in text
    assert f"the same file {tmp_path / 'g3-w0.bin'}" in text and "agent 'w0'" in text
    assert not list(tmp_path.iterdir())


def test_templates_that_meet_through_the_safe_name_are_refused(tmp_path) -> None:
    # 'a/b' is made safe as 'a_b': the path that names it literally is the same file.
    options = g3(tmp_path / "{agent}" / "g3", tmp_path / "a_b" / "g3")
    with pytest.raises(ValueError, match=r"paths\[1\] .* and paths\[0\] .* the same file"):
        kvcr_with(options, name="a/b")


def test_the_glob_of_every_instances_file_matches_the_rest_of_the_template_literally() -> None:
    assert instances_glob(Path("/d[1]/g3-{agent}.bin")) == "/d[[]1]/g3-*.bin"
    assert instances_glob(Path("/d/{agent}/g3.bin")) == "/d/*/g3.bin"
    assert instances_glob(Path("/d/g3-{guard_index}.bin")) is None
