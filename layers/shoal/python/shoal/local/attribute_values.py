"""DynamoDB's attribute values without a walk of their shape, in the emulator's process: botocore's
validation of the requests and parse of the answers (``parse_attribute_values_directly``,
installed with the in-process transport), and moto's parse of the requests
(``parse_requested_attribute_values_directly``, one of ``shoal.local.aws.adapt_moto``'s changes).

Each walks a JSON document by the operation's shape: every attribute of every item is a ``map``
entry whose value is the ten-member ``AttributeValue`` structure, and for each the walker looks
every member up by its JSON name, then dispatches on the member's type. In a fan-out to 1,000
WebSocket subscribers under ``shoal dev`` (py-spy ``--gil``, 2026-12-07) botocore's parse of
the answers was 15 % of the process's time, the push's batch read of its sessions' heads and
states most of it; of a session's delivery-state put (the write every push makes), botocore's
validation took a ninth of the CPU and moto's parse read 500 dictionary keys. Deployed, each
function pays botocore's part on its own CPU; here every function and the emulator share one.

An attribute value's parse is the value itself, but for binaries, which are base64-decoded with
the parser's own blob parser; it is valid when it has one member of the right type, as deep as
it goes (the model puts no other constraint on it). This builds and checks exactly that (the
tests compare each with the walk's own answer for the same documents), and hands anything else
(several members, an unknown one, a null, a wrong type: whatever the walk would parse
otherwise or report) to the walk. Every other shape is walked as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: the members whose JSON is their parse
_AS_IS = frozenset({"S", "N", "NULL", "BOOL"})
_ATTRIBUTE_VALUE = "AttributeValue"


class _NotPlain(ValueError):
    """A value left to the parser's own walk."""


def attribute_value(value: Any, blob: Callable[[Any], Any]) -> dict[str, Any]:
    """``value``, one attribute value as JSON, as a shape walk parses it; ``_NotPlain`` for
    anything but one well-formed attribute value."""
    if not isinstance(value, dict) or len(value) != 1:
        raise _NotPlain
    ((kind, inner),) = value.items()
    if inner is None:
        raise _NotPlain
    if kind in _AS_IS:
        return {kind: inner}
    if kind == "M" and isinstance(inner, dict):
        return {"M": {key: attribute_value(v, blob) for key, v in inner.items()}}
    if kind == "L" and isinstance(inner, list):
        return {"L": [attribute_value(v, blob) for v in inner]}
    if kind in ("SS", "NS") and isinstance(inner, list):
        return {kind: list(inner)}
    if kind == "B":
        return {"B": blob(inner)}
    if kind == "BS" and isinstance(inner, list):
        return {"BS": [blob(v) for v in inner]}
    raise _NotPlain


def _attribute_map(shape: Any) -> bool:
    """Whether ``shape`` is a map of attribute values by name (an item, a key)."""
    return bool(shape.value.name == _ATTRIBUTE_VALUE and shape.key.type_name == "string")


#: what botocore's validation takes for a blob (a file-like object too: left to the walk)
_BLOBS = (bytes, bytearray, str)
_SEQUENCES = (list, tuple)


def valid_attribute_value(value: Any) -> bool:
    """Whether botocore's validation finds ``value`` a valid attribute value (False also for
    a value this does not decide: the walk then reports or passes it)."""
    if type(value) is not dict or len(value) != 1:
        return False
    ((kind, inner),) = value.items()
    if kind in ("S", "N"):
        return isinstance(inner, str)
    if kind in ("BOOL", "NULL"):
        return isinstance(inner, bool)
    if kind == "M":
        return isinstance(inner, dict) and all(
            isinstance(key, str) and valid_attribute_value(v) for key, v in inner.items()
        )
    if kind == "L":
        return isinstance(inner, _SEQUENCES) and all(valid_attribute_value(v) for v in inner)
    if kind in ("SS", "NS"):
        return isinstance(inner, _SEQUENCES) and all(isinstance(v, str) for v in inner)
    if kind == "B":
        return isinstance(inner, _BLOBS)
    if kind == "BS":
        return isinstance(inner, _SEQUENCES) and all(isinstance(v, _BLOBS) for v in inner)
    return False


def _plain_maps(parser: Any) -> bool:
    """Whether ``parser`` builds its structures and maps as plain dicts (moto's parser takes
    the type from its caller; DynamoDB's handler asks for dicts)."""
    return getattr(parser, "MAP_TYPE", dict) is dict


def _directly(base: type, structure: str, mapping: str) -> type:
    """``base`` (a parser class) with its ``structure`` and ``mapping`` handlers parsing
    attribute values directly."""
    walk_structure = getattr(base, structure)
    walk_map = getattr(base, mapping)

    def handle_structure(self: Any, shape: Any, value: Any) -> Any:
        if shape.name == _ATTRIBUTE_VALUE and _plain_maps(self):
            try:
                return attribute_value(value, self._blob_parser)
            except _NotPlain:
                pass
        return walk_structure(self, shape, value)

    def handle_map(self: Any, shape: Any, value: Any) -> Any:
        if _attribute_map(shape) and isinstance(value, dict) and _plain_maps(self):
            blob = self._blob_parser
            try:
                return {key: attribute_value(v, blob) for key, v in value.items()}
            except _NotPlain:
                pass
        return walk_map(self, shape, value)

    return type(
        base.__name__,
        (base,),
        {structure: handle_structure, mapping: handle_map, "shoal_attribute_values": True},
    )


def parse_attribute_values_directly() -> None:
    """botocore's JSON-protocol parser (DynamoDB's, among others) builds attribute values
    directly, and its validation checks them directly. Process-wide and idempotent; botocore
    looks its parser class up for each answer (``ResponseParserFactory.create_parser``), and
    every client's validation is a ``ParamValidator``, so clients made before take both."""
    from botocore import parsers

    _validate_attribute_values_directly()

    # (the stubs type the table's values as parsers; they are parser classes)
    protocols: dict[str, Any] = parsers.PROTOCOL_PARSERS
    base = protocols["json"]
    if not getattr(base, "shoal_attribute_values", False):
        protocols["json"] = _directly(base, "_handle_structure", "_handle_map")


def parse_requested_attribute_values_directly() -> None:
    """moto's JSON-protocol request parser builds attribute values directly. Process-wide and
    idempotent; moto looks its parser class up for each request (as ``shoal.local.moto_json``
    does)."""
    from moto.core import parse

    base = parse.PROTOCOL_PARSERS["json"]
    if not getattr(base, "shoal_attribute_values", False):
        parse.PROTOCOL_PARSERS["json"] = _directly(base, "_parse_structure", "_parse_map")


def _validate_attribute_values_directly() -> None:
    from botocore.validate import ParamValidator

    validator: Any = ParamValidator
    if getattr(validator, "shoal_attribute_values", False):
        return
    walk_structure = validator._validate_structure
    walk_map = validator._validate_map

    def validate_structure(self: Any, params: Any, shape: Any, errors: Any, name: str) -> None:
        if shape.name == _ATTRIBUTE_VALUE and valid_attribute_value(params):
            return
        walk_structure(self, params, shape, errors, name)

    def validate_map(self: Any, params: Any, shape: Any, errors: Any, name: str) -> None:
        # the keys: strings with no minimum length (the model's names and placeholders)
        if (
            _attribute_map(shape)
            and "min" not in shape.key.metadata
            and type(params) is dict
            and all(isinstance(k, str) and valid_attribute_value(v) for k, v in params.items())
        ):
            return
        walk_map(self, params, shape, errors, name)

    validate_structure.shoal_walk = walk_structure  # type: ignore[attr-defined]  # the tests
    validate_map.shoal_walk = walk_map  # type: ignore[attr-defined]
    validator._validate_structure = validate_structure
    validator._validate_map = validate_map
    validator.shoal_attribute_values = True
