"""Operator logging: every line about an InferenceDeployment names it.

Kopf's per-object logger attaches a ``k8s_ref`` (apiVersion, kind, namespace, name, uid)
to each record; Kopf's formatters turn it into a ``[namespace/name]`` prefix (text) or an
``object`` field (JSON). :func:`configure_logging` installs those formatters on the root
logger, so Kopf's own lines (``Handler 'reconcile-create' succeeded.``) name their
object, and :func:`object_logger` gives our own modules the same reference.
"""

from __future__ import annotations

import logging
from typing import Any, TypeAlias

from kvpilot.operator import constants as c

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# A module's logger, or one bound to a resource by :func:`object_logger`.
ObjectLog: TypeAlias = "logging.Logger | logging.LoggerAdapter[logging.Logger]"  # a string: 3.10 cannot subscript it


def configure_logging(level: str, log_format: str) -> None:
    """Route every logger through Kopf's object-aware formatter on stderr.

    Args:
        level: ``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR``.
        log_format: ``text`` (``[time] logger [LEVEL] [ns/name] message``) or ``json``
            (one object per line: ``message``, ``timestamp``, ``severity``, and
            ``object`` with the resource's apiVersion, kind, namespace and name).
    Raises:
        ValueError: an unknown ``log_format`` or ``level``, named with what is allowed.
    """
    import kopf

    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}; got {log_format!r}")
    if level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {level!r}")
    json_lines = log_format == "json"
    kopf.configure(debug=level == "DEBUG",
                   log_format=kopf.LogFormat.JSON if json_lines else kopf.LogFormat.FULL,
                   log_prefix=not json_lines, log_refkey="object")
    logging.getLogger().setLevel(level)


def object_ref(namespace: str | None, name: str | None) -> dict[str, Any]:
    """The ``extra`` of a log call about one InferenceDeployment (Kopf's ``k8s_ref``)."""
    return {"k8s_ref": {"apiVersion": c.API_VERSION, "kind": c.KIND, "namespace": namespace or "",
                        "name": name or ""}}


def object_logger(logger: logging.Logger, namespace: str | None, name: str | None) -> logging.LoggerAdapter[logging.Logger]:
    """``logger`` with every record carrying the InferenceDeployment's reference."""
    return logging.LoggerAdapter(logger, object_ref(namespace, name))
