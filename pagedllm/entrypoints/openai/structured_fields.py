"""Request fields that ask for constrained output -> one StructuredOutputsParams (or None).

The forms a request may use (one of them at a time):
    response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema"}}
                      | {"type": "structural_tag", "structures": [...], "triggers": [...]} | {"type": "text"}
    structured_outputs  vLLM 0.21: {"json": ...} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} | ...
    guided_json / guided_regex / guided_choice / guided_grammar   older vLLM (+ guided_decoding_backend)
Every error is a ValueError whose message starts with the offending field (the server's 400 names it).
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.structured_output.params import StructuredOutputsParams, check_backend, coerce_structured_outputs

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _from_response_format(fmt: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format with type 'json_schema' needs a json_schema object {name, schema}.")
        schema = spec.get("schema")
        if schema is None:
            # OpenAI's SDK sends the schema under "schema"; vLLM also reads "json_schema" itself.
            raise ValueError("response_format.json_schema needs a 'schema' (a JSON schema object).")
        if not isinstance(schema, dict):
            raise ValueError(f"response_format.json_schema.schema must be an object, got {type(schema).__name__}.")
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=json.dumps(fmt))
    raise ValueError(
        f"response_format type {kind!r} is not supported; use text, json_object, json_schema or structural_tag."
    )


def structured_outputs_from_request(request: Any) -> StructuredOutputsParams | None:
    sources: list[tuple[str, StructuredOutputsParams | None]] = []
    fmt = getattr(request, "response_format", None)
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise ValueError("response_format must be an object with a 'type'.")
        try:
            sources.append(("response_format", _from_response_format(fmt)))
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith("response_format") else f"response_format is invalid: {msg}") from None
    if request.structured_outputs is not None:
        backend = request.structured_outputs.get("backend")
        if backend is not None and not isinstance(backend, str):
            raise ValueError(f"structured_outputs.backend must be a string, got {type(backend).__name__}.")
        try:
            sources.append(("structured_outputs", coerce_structured_outputs(request.structured_outputs)))
        except (ValueError, TypeError) as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith("structured_outputs") else f"structured_outputs is invalid: {msg}") from None
    for field, kind in _GUIDED.items():
        value = getattr(request, field)
        if value is None:
            continue
        if field == "guided_json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"guided_json is not valid JSON: {e}.") from None
        try:
            sources.append((field, StructuredOutputsParams(**{kind: value})))
        except ValueError as e:
            raise ValueError(f"{field} is invalid: {e}") from None
    if request.guided_whitespace_pattern is not None:
        raise ValueError("guided_whitespace_pattern is not supported by the xgrammar backend.")
    check_backend(request.guided_decoding_backend)
    active = [(name, p) for name, p in sources if p is not None]
    if len(active) > 1:
        raise ValueError(f"{active[0][0]} and {active[1][0]} both constrain the output; give only one.")
    if not active:
        return None
    params = active[0][1]
    if request.guided_decoding_backend is not None:
        params._backend = request.guided_decoding_backend
    return params


def constraint_field(request: Any, tool_mode: str = "none") -> tuple[str, str] | None:
    """The request field whose constraint became the params' structured_outputs, as (param, the
    name its errors should start with), for errors found later (the grammar compiled before
    queueing: "structured_outputs.regex cannot be compiled: ..." -> "guided_regex cannot be ...").
    None when the request constrains nothing."""
    if tool_mode in ("required", "named"):
        return "tools", f"the tools' parameters schema (tool_choice {tool_mode!r})"
    fmt = getattr(request, "response_format", None)
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        kind = fmt.get("type")
        return "response_format", "response_format.json_schema.schema" if kind == "json_schema" else "response_format"
    if request.structured_outputs is not None:
        return "structured_outputs", "structured_outputs"
    for name in _GUIDED:
        if getattr(request, name) is not None:
            return name, name
    return None
