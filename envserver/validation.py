"""Check a call's arguments against the tool's JSON schema before the tool runs.

Covers the subset ``transformers.utils.get_json_schema`` emits: ``type`` (a name or a list),
``nullable``, ``enum``, ``items``, ``prefixItems``, ``additionalProperties``, ``anyOf``, and the
top-level ``properties`` / ``required``. Messages name the argument and what was expected, since
they go back to the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_TYPE_CHECKS: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    # bool is an int subclass in Python, never an integer or number in JSON.
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}
# Schema keys that check more than the type (``_check``); ``description``, ``title`` and the like do not.
_CHECKED_KEYS = frozenset(("nullable", "anyOf", "enum", "items", "prefixItems", "additionalProperties"))


class ArgumentValidator:
    """Validates the ``arguments`` object of a call against a function's ``parameters`` schema."""

    def __init__(self, parameters: dict[str, Any]) -> None:
        self._properties: dict[str, Any] = parameters.get("properties", {})
        self._required: list[str] = parameters.get("required", [])
        self._required_names = frozenset(self._required)
        # A property whose schema is a single known type and nothing else that checks (the schema
        # of most tool arguments) is checked by its type test alone; any other goes through _check.
        self._type_only: dict[str, Any] = {
            name: _TYPE_CHECKS[schema["type"]] for name, schema in self._properties.items()
            if isinstance(schema.get("type"), str) and schema["type"] in _TYPE_CHECKS
            and not _CHECKED_KEYS.intersection(schema)}

    def __call__(self, arguments: object) -> str | None:
        """Return ``None`` when ``arguments`` is valid, else a message saying what is wrong."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {_json_type(arguments)}"
        if not self._required_names <= arguments.keys():
            missing = [name for name in self._required if name not in arguments]
            return f"missing required argument(s): {', '.join(missing)}"
        if not arguments.keys() <= self._properties.keys():
            unknown = [name for name in arguments if name not in self._properties]
            expected = ", ".join(self._properties) or "none"
            return f"unexpected argument(s): {', '.join(unknown)} (expected: {expected})"
        type_only = self._type_only
        for name, value in arguments.items():
            test = type_only.get(name)
            if test is not None and test(value):
                continue
            error = _check(value, self._properties[name], name)
            if error:
                return error
        return None


def _check(value: Any, schema: dict[str, Any], where: str) -> str | None:
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        if any(_check(value, option, where) is None for option in schema["anyOf"]):
            return None
        return f"{where}: {_json_type(value)} matches none of the allowed types"
    declared = schema.get("type")
    if declared is not None:
        types = declared if isinstance(declared, list) else [declared]
        if not any(_TYPE_CHECKS.get(t, lambda v: True)(value) for t in types):
            return f"{where}: expected {' or '.join(types)}, got {_json_type(value)}"
    if "enum" in schema and not _in_enum(value, schema["enum"]):
        return f"{where}: {value!r} is not one of {schema['enum']}"
    if isinstance(value, list):
        return _check_items(value, schema, where)
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            error = _check(item, schema["additionalProperties"], f"{where}[{key!r}]")
            if error:
                return error
    return None


def _check_items(value: list[Any], schema: dict[str, Any], where: str) -> str | None:
    if "prefixItems" in schema:
        prefix = schema["prefixItems"]
        if len(value) != len(prefix):
            return f"{where}: expected {len(prefix)} items, got {len(value)}"
        pairs: Iterable[tuple[Any, Any]] = zip(value, prefix, strict=True)
    elif isinstance(schema.get("items"), dict):
        pairs = ((item, schema["items"]) for item in value)
    else:
        return None
    for index, (item, item_schema) in enumerate(pairs):
        error = _check(item, item_schema, f"{where}[{index}]")
        if error:
            return error
    return None


def _in_enum(value: Any, allowed: list[Any]) -> bool:
    items = value if isinstance(value, list) else [value]  # list[Literal[...]] puts enum on the array
    return all(item in allowed for item in items)


def _json_type(value: object) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _TYPE_CHECKS[name](value):
            return name
    return type(value).__name__
