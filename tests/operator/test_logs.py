"""Operator log lines name their InferenceDeployment, as text or as JSON."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from kvpilot.operator import cli
from kvpilot.operator.logs import configure_logging, object_logger, object_ref


@pytest.fixture
def root_logging():
    """Restore the root logger and asyncio's logger after configure_logging rewired them."""
    root, aio = logging.getLogger(), logging.getLogger("asyncio")
    saved = (root.handlers[:], root.level, aio.handlers[:], aio.propagate)
    yield
    root.handlers[:], aio.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    aio.propagate = saved[3]


def emit_lines():
    # Our own modules' lines, through the adapter and through extra=.
    object_logger(logging.getLogger("kvpilot.operator.autoscaling.loop"), "llm", "chat").warning(
        "autoscaler: %s", "api down")
    logging.getLogger("kvpilot.operator.handlers.children").info("status refresh failed", extra=object_ref("llm", "chat"))
    # A Kopf per-object line carries the same k8s_ref (as kopf's ObjectLogger sets it).
    logging.getLogger("kopf.objects").info("Handler 'reconcile-create' succeeded.",
                                           extra={"k8s_ref": {"kind": "InferenceDeployment",
                                                              "namespace": "llm", "name": "chat"}})
    logging.getLogger("kvpilot.operator.debug").debug("not shown at INFO")


def test_text_lines_carry_the_namespace_and_name(root_logging, capfd):
    configure_logging("INFO", "text")
    emit_lines()
    lines = [x for x in capfd.readouterr().err.splitlines() if x]
    assert len(lines) == 3, lines
    assert all("[llm/chat]" in x for x in lines), lines
    assert "[WARNING ] [llm/chat] autoscaler: api down" in lines[0]


def test_json_lines_carry_the_object(root_logging, capfd):
    configure_logging("INFO", "json")
    emit_lines()
    records = [json.loads(x) for x in capfd.readouterr().err.splitlines() if x]
    assert [r["message"] for r in records] == ["autoscaler: api down", "status refresh failed",
                                              "Handler 'reconcile-create' succeeded."]
    assert all(r["object"]["namespace"] == "llm" and r["object"]["name"] == "chat" for r in records)
    assert records[0]["object"]["kind"] == "InferenceDeployment" and records[0]["severity"] == "warn"


def test_bad_format_or_level_is_refused_by_name(root_logging, monkeypatch):
    with pytest.raises(ValueError, match="--log-format must be one of text, json; got 'yaml'"):
        configure_logging("INFO", "yaml")
    with pytest.raises(ValueError, match="--log-level must be"):
        configure_logging("LOUD", "text")
    # The environment variable bypasses argparse's choices: the operator exits naming it.
    monkeypatch.setenv("KVPILOT_LOG_FORMAT", "yaml")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    with pytest.raises(SystemExit, match="--log-format must be one of text, json; got 'yaml'"):
        cli.run(args)
