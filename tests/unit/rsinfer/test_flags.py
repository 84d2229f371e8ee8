"""The command line's flags (rsinfer/flags.py): every setting in exactly one `--help` group, the common groups
first, and each command showing only its own flags."""

from __future__ import annotations

import argparse
import inspect
from collections import Counter

import pytest
from pydantic_settings import BaseSettings

import rsinfer.command_settings
import shared.settings
from rsinfer.cli import SERVICES, build_parser
from rsinfer.flags import FLAG_GROUPS, GROUP_OF

SETTINGS = [c for module in (shared.settings, rsinfer.command_settings)
            for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, BaseSettings) and c is not BaseSettings]
EVERY_FIELD = {name for cls in SETTINGS for name in cls.model_fields}


def subcommand(name: str) -> argparse.ArgumentParser:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def help_of(name: str, monkeypatch) -> list[str]:
    monkeypatch.setenv("COLUMNS", "80")
    return subcommand(name).format_help().splitlines()


def flags_of(name: str) -> set[str]:
    return {s for a in subcommand(name)._actions for s in a.option_strings}


def test_every_setting_is_in_exactly_one_group():
    listed = Counter(name for _, _, names in FLAG_GROUPS for name in names)
    assert not [n for n, k in listed.items() if k > 1], "a field listed in two groups"
    assert EVERY_FIELD - set(GROUP_OF) == set(), "a setting with no group: add it to rsinfer/flags.py FLAG_GROUPS"
    assert set(GROUP_OF) - EVERY_FIELD == set(), "FLAG_GROUPS names a field no settings class has"
    assert FLAG_GROUPS[0][0] == "server" and FLAG_GROUPS[0][2][:4] == ("host", "port", "model", "served_model_name")


def test_up_help_starts_with_the_server_group(monkeypatch):
    lines = help_of("up", monkeypatch)
    titles = [line[:-1] for line in lines if line.endswith(":") and not line.startswith(" ")]
    expected = [t for t, _, names in FLAG_GROUPS if set(names) & set(SERVICES["up"][0].model_fields)]
    assert titles == ["options", *expected]  # argparse's own `-h` first, then the groups in their order
    assert titles[1] == "server"
    port = next(k for k, line in enumerate(lines) if line.lstrip().startswith("--port "))
    assert port < 40, port
    assert lines[0] == "usage: rsinfer up [flags]"  # not a hundred flags before the first group


@pytest.mark.parametrize("command", ["inspect", "drain", "healthcheck"])
def test_the_tools_show_only_their_own_flags(command, monkeypatch):
    text = "\n".join(help_of(command, monkeypatch))
    for other in ("--lora", "--max-lora", "--storage", "--max-file-bytes", "--heartbeat-interval", "--log-level",
                  "--request-ttl-s", "--otlp-endpoint", "--max-body-bytes", "--api-key"):
        assert other not in text, (command, other)
    if command != "healthcheck":  # whose --ready reads a heartbeat
        assert "--heartbeat" not in text
    assert len(text.splitlines()) < 60


def test_the_tools_flags_are_what_they_use():
    redis = {"--redis-url", "--redis-password", "--redis-password-file", "--redis-tls-ca", "--redis-cluster",
             "--namespace"}
    assert flags_of("inspect") == {"-h", "--help", "--all", "--port", "--watch", *redis}
    assert flags_of("drain") == {"-h", "--help", "--wait", "--port", "--admin-socket", "--drain-timeout-s"}
    assert flags_of("healthcheck") == {"-h", "--help", "--role", "--max-stall-s", "--ready", "--port", *redis,
                                       "--worker-id", "--heartbeat-ttl-s", "--liveness-file"}


@pytest.mark.parametrize("command", list(SERVICES))
def test_a_process_has_a_flag_per_setting_named_as_before(command):
    """Flags and environment variables are the fields' names (charts and scripts use them)."""
    fields = SERVICES[command][0].model_fields
    expected = {"-h", "--help"}
    for name, field in fields.items():
        flag = "--" + name.replace("_", "-")
        expected |= {flag, "--no-" + flag[2:]} if field.annotation in (bool, bool | None) else {flag}
    assert flags_of(command) == expected
