"""What the API server does with a CRD's structural schema, done offline for tests:
structural checks, defaulting, pruning, strict validation, JSON merge patch, and CEL
(``x-kubernetes-validations``) evaluated with cel-python.

Follows the Kubernetes docs "Extend the Kubernetes API with CustomResourceDefinitions"
(structural schema, pruning, defaulting, validation rules). Not a full reimplementation:
it covers the keywords our CRD uses and fails loudly on any other, so a new keyword cannot
slip through untested.
"""

from __future__ import annotations

import copy
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import celpy
import yaml
from celpy import celtypes

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "inferencedeployments.kvpilot.dev.yaml"
KNOWN_KEYWORDS = {
    "type", "description", "properties", "required", "items", "additionalProperties",
    "default", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength",
    "pattern", "maxItems", "minItems", "maxProperties", "minProperties", "format", "nullable", "anyOf", "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}
_DROP = object()


def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def root_schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def sub_schema(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    """The schema at a dotted property path, e.g. ``spec.autoscaling``."""
    for part in dotted.split("."):
        schema = schema["properties"][part]
    return schema


# ---------------------------------------------------------------- structural checks
def structural_problems(schema: dict[str, Any], path: str = "") -> list[str]:
    """Violations of the structural-schema rules (empty list = structural)."""
    problems = [f"{path}: unknown keyword {k}" for k in schema if k not in KNOWN_KEYWORDS]
    int_or_string = schema.get("x-kubernetes-int-or-string")
    untyped_ok = int_or_string or schema.get("x-kubernetes-preserve-unknown-fields")
    if "type" not in schema and not untyped_ok:
        problems.append(f"{path or '<root>'}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{path}: properties and additionalProperties together")
    if "anyOf" in schema and not int_or_string:
        problems.append(f"{path}: anyOf outside the int-or-string pattern")
    for branch in schema.get("anyOf", ()):
        bad = set(branch) - {"type"}
        if bad:
            problems.append(f"{path}: anyOf branch sets {sorted(bad)}")
    kind = schema.get("type")
    if "properties" in schema and kind != "object":
        problems.append(f"{path}: properties on type {kind}")
    if kind == "array" and "items" not in schema:
        problems.append(f"{path}: array without items")
    for name, sub in schema.get("properties", {}).items():
        problems += structural_problems(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("additionalProperties"), dict):
        problems += structural_problems(schema["additionalProperties"], f"{path}.*")
    if "items" in schema:
        problems += structural_problems(schema["items"], f"{path}[]")
    if "default" in schema:
        errors = validate(schema, schema["default"], f"{path}(default)")
        problems += [f"default invalid: {e}" for e in errors]
    return problems


# ---------------------------------------------------------------- defaulting, pruning
def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """A copy of ``obj`` with every missing field that has a ``default`` filled in,
    recursively (defaults of defaults included), as the API server does on read/write."""
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                obj[name] = apply_defaults(sub, obj[name])
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        obj = {k: apply_defaults(schema["additionalProperties"], v) for k, v in obj.items()}
    elif isinstance(obj, list) and "items" in schema:
        obj = [apply_defaults(schema["items"], v) for v in obj]
    return obj


def prune(schema: dict[str, Any], obj: Any, path: str = "") -> tuple[Any, list[str]]:
    """(``obj`` without the fields the schema does not declare, the dropped paths)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return copy.deepcopy(obj), []
    dropped: list[str] = []
    if isinstance(obj, dict) and schema.get("type") == "object":
        out = {}
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if props is not None and key in props:
                out[key], sub = prune(props[key], value, f"{path}.{key}")
            elif isinstance(extra, dict):
                out[key], sub = prune(extra, value, f"{path}.{key}")
            elif props is None and extra is None and path.endswith("metadata"):
                out[key], sub = copy.deepcopy(value), []
            else:
                dropped.append(f"{path}.{key}")
                continue
            dropped += sub
        return out, dropped
    if isinstance(obj, list) and "items" in schema:
        out_list = []
        for i, item in enumerate(obj):
            value, sub = prune(schema["items"], item, f"{path}[{i}]")
            out_list.append(value)
            dropped += sub
        return out_list, dropped
    return copy.deepcopy(obj), []


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge, ``None`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


# ---------------------------------------------------------------- validation
def _type_ok(kind: str, value: Any) -> bool:
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    raise AssertionError(f"unknown type {kind}")


def validate(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """OpenAPI v3 validation as the API server applies it (strict JSON types: an integer
    field refuses 1.5 and True; a number field accepts ints). Returns the errors."""
    if value is None:
        return [] if schema.get("nullable") else [f"{path}: null is not allowed"]
    if schema.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, (int, str)) and not isinstance(value, bool)
        return [] if ok else [f"{path}: must be an integer or a string, got {value!r}"]
    kind = schema.get("type")
    if kind and not _type_ok(kind, value):
        return [f"{path}: must be {kind}, got {type(value).__name__} {value!r}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if kind in ("integer", "number"):
        if "minimum" in schema:
            low = schema["minimum"]
            if value < low or (schema.get("exclusiveMinimum") and value == low):
                errors.append(f"{path}: {value} below minimum {low}")
        if "maximum" in schema:
            high = schema["maximum"]
            if value > high or (schema.get("exclusiveMaximum") and value == high):
                errors.append(f"{path}: {value} above maximum {high}")
    if kind == "string":
        if len(value) > schema.get("maxLength", 1 << 30) or len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: length {len(value)} out of bounds")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
        if schema.get("format") == "date-time":
            try:
                datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                errors.append(f"{path}: {value!r} is not an RFC 3339 date-time")
    if kind == "array":
        if len(value) > schema.get("maxItems", 1 << 30):
            errors.append(f"{path}: {len(value)} items above maxItems {schema['maxItems']}")
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: {len(value)} items below minItems {schema['minItems']}")
        for i, item in enumerate(value):
            errors += validate(schema["items"], item, f"{path}[{i}]")
    if kind == "object":
        if not schema.get("minProperties", 0) <= len(value) <= schema.get("maxProperties", 1 << 30):
            errors.append(f"{path}: {len(value)} properties out of [minProperties,"
                          " maxProperties]")
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path}.{key}: required")
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                errors += validate(props[key], item, f"{path}.{key}")
            elif isinstance(extra, dict):
                errors += validate(extra, item, f"{path}.{key}")
    return errors


# ---------------------------------------------------------------- CEL
def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """A JSON value as CEL sees it under ``schema``: ``number`` fields are doubles even when
    written as integers, ``integer`` fields are ints (Kubernetes' CEL type mapping)."""
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        return celtypes.MapType({
            celtypes.StringType(k): to_cel(props.get(k) or (extra if isinstance(extra, dict) else {}), v)
            for k, v in value.items()
        })
    if isinstance(value, list):
        return celtypes.ListType([to_cel(schema.get("items", {}), v) for v in value])
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if schema.get("type") == "number":
        return celtypes.DoubleType(float(value))
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    raise AssertionError(f"cannot convert {value!r}")


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(expr: str) -> Any:
    if expr not in _PROGRAMS:
        _PROGRAMS[expr] = _ENV.program(_ENV.compile(expr))
    return _PROGRAMS[expr]


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Messages of every failing ``x-kubernetes-validations`` rule, depth first, as the
    API server would report them (``messageExpression`` evaluated when given)."""
    if value is None:
        return []
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", ()):
        activation = {"self": to_cel(schema, value)}
        result = _program(rule["rule"]).evaluate(activation)
        if isinstance(result, Exception):
            raise AssertionError(f"{path}: rule {rule['rule']!r} raised {result!r}")
        if not bool(result):
            if "messageExpression" in rule:
                message = str(_program(rule["messageExpression"]).evaluate(activation))
            else:
                message = rule.get("message", f"failed rule: {rule['rule']}")
            errors.append(f"{path or '<root>'}: {message}")
    if isinstance(value, dict):
        for key, item in value.items():
            sub = schema.get("properties", {}).get(key)
            if sub is not None:
                errors += cel_errors(sub, item, f"{path}.{key}" if path else key)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def admit(crd: dict[str, Any], obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What ``kubectl apply`` of ``obj`` meets: prune, default, validate, CEL.

    Returns (the object as stored, the error messages; empty = accepted)."""
    schema = root_schema(crd)
    stored, _ = prune(schema, obj)
    stored = apply_defaults(schema, stored)
    errors = validate(schema, stored)
    if not errors:
        errors = cel_errors(schema, stored)
    return stored, errors
