"""50 JSON schemas in the style of public structured-output benchmarks (JSONSchemaBench's
GitHub / Kubernetes / API-response shapes), written small enough that a 135M model completes each
within a short max_tokens: strings have a length (maxLength, or a bounded pattern), arrays maxItems, numbers bounds."""

from __future__ import annotations

# Plain-text strings: greedy SmolLM2 otherwise may fill a string with emoji, several byte tokens each.
S = {"type": "string", "pattern": "^[A-Za-z0-9 .,'-]{0,12}$"}
INT = {"type": "integer", "minimum": 0, "maximum": 999}


# The person schema of the engine-level tests (test_engine_structured.py, test_grammar_worker.py).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS: list[dict] = [
    obj({"name": S, "age": INT}),
    obj({"city": S, "population": {"type": "integer", "minimum": 1, "maximum": 10_000_000}}),
    obj({"title": S, "done": {"type": "boolean"}}),
    obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
    obj({"status": {"enum": ["open", "closed", "merged"]}, "number": INT}),
    obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "qty": INT}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"temperature": {"type": "number", "minimum": -50, "maximum": 50}}),
    obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": S}),
    obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": INT, "maxItems": 4}}),
    obj({"point": obj({"x": INT, "y": INT})}),
    obj({"user": obj({"login": S, "id": INT}), "repo": S}),
    obj({"metadata": obj({"name": S, "namespace": S}), "kind": {"const": "Pod"}}),
    obj({"a": obj({"b": obj({"c": INT})})}),
    obj({"items": {"type": "array", "items": obj({"name": S, "price": INT}), "minItems": 1, "maxItems": 2}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 2}, "maxItems": 2}}),
    obj({"name": S, "nickname": S}, required=["name"]),
    obj({"id": INT, "email": {"type": "string", "format": "email"}}, required=["id"]),
    obj({"day": {"type": "string", "format": "date"}}),
    obj({"uid": {"type": "string", "format": "uuid"}}),
    obj({"ok": {"type": "boolean"}, "error": {"type": ["string", "null"], "pattern": "^[a-z ]{0,12}$"}}),
    obj({"value": {"anyOf": [INT, {"type": "boolean"}]}}),
    obj({"shape": {"oneOf": [obj({"kind": {"const": "circle"}, "r": INT}), obj({"kind": {"const": "square"},
                                                                                    "side": INT})]}}),
    {"$defs": {"person": obj({"name": S, "age": INT})}, **obj({"author": {"$ref": "#/$defs/person"}})},
    obj({"level": {"type": "string", "enum": ["debug", "info", "warn", "error"]}, "msg": S}),
    obj({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180,
                                                                             "maximum": 180}}),
    obj({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]\\.[0-9]$"}}),
    obj({"word": {"type": "string", "minLength": 3, "maxLength": 8}}),
    obj({"code": {"type": "string", "pattern": "^[a-z]{3,8}$"}}),
    {"type": "array", "items": INT, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": obj({"k": S}), "minItems": 1, "maxItems": 2},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "boolean"},
    obj({"pr": obj({"number": INT, "merged": {"type": "boolean"}, "labels": {"type": "array", "items": S,
                                                                             "maxItems": 2}})}),
    obj({"replicas": {"type": "integer", "minimum": 1, "maximum": 10}, "image": S}),
    obj({"http": obj({"method": {"enum": ["GET", "POST"]}, "path": {"type": "string", "pattern": "^/[a-z]{1,8}$"}})}),
    obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}, "currency": {"enum": ["USD", "EUR"]}}),
    obj({"first": S, "last": S, "middle": S}, required=["first", "last"]),
    obj({"weekday": {"enum": ["mon", "tue", "wed", "thu", "fri"]}, "hour": {"type": "integer", "minimum": 0,
                                                                             "maximum": 23}}),
    obj({"pair": {"type": "array", "prefixItems": [S, INT], "items": False, "minItems": 2}}),
    obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"count": INT, "next": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    obj({"answer": {"type": "string", "enum": ["A", "B", "C", "D"]}, "confidence": {"type": "number", "minimum": 0,
                                                                                     "maximum": 1}}),
    obj({"event": obj({"name": S, "attendees": {"type": "array", "items": S, "maxItems": 2}})}),
    obj({"language": {"enum": ["python", "rust", "go"]}, "stars": INT, "fork": {"type": "boolean"}}),
    obj({"range": obj({"low": {"type": "integer", "minimum": 0, "maximum": 5}, "high": {"type": "integer",
                                                                                         "minimum": 5, "maximum": 9}})}),
    obj({"summary": {"type": "string", "pattern": "^[a-z ]{1,20}$"}, "keywords": {"type": "array", "items": S, "minItems": 1,
                                                                      "maxItems": 2}}),
]
assert len(SCHEMAS) == 50
