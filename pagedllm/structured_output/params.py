"""`StructuredOutputsParams` (vLLM 0.21's name) and `GuidedDecodingParams` (older vLLM's): what a
request's output must match. Exactly one constraint is set:

    json            a JSON schema (dict, pydantic model class, or its JSON text)
    regex           a regular expression the whole output matches
    choice          a list of strings; the output is exactly one of them
    grammar         an EBNF (GBNF) grammar whose `root` rule the output matches
    json_object     True: any JSON object (OpenAI's response_format {"type": "json_object"})
    structural_tag  vLLM's structural tag JSON ({"type": "structural_tag", "structures": [...], "triggers": [...]})

Checks that need no tokenizer happen here (ValueError naming the field); the grammar itself is
compiled, and its errors reported, by the backend (structured_output/backend_xgrammar.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The backends a request may name (vLLM's names). "auto" and "xgrammar" pick the one built here.
SUPPORTED_BACKENDS = ("auto", "xgrammar")
KNOWN_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # vLLM's options. disable_fallback has nothing to fall back to here (one backend); it is accepted.
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # Set by the frontend, not by users: the grammar starts after the first of these token ids
    # appears in the output (a reasoning model's "</think>"), so the thinking text is free.
    _reasoning_end_token_ids: list[int] = field(default_factory=list)
    _backend: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            # A pydantic model class, as vLLM accepts: its JSON schema.
            schema_fn = getattr(self.json, "model_json_schema", None)
            if schema_fn is None:
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema (dict or string) or a pydantic model, "
                    f"got {type(self.json).__name__}."
                )
            self.json = schema_fn()
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object, structural_tag; "
                f"got {', '.join(set_kinds) if set_kinds else 'none'}."
            )
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend.")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise ValueError(f"structured_outputs.choice entries must be non-empty strings, got {c!r}.")
        for name in ("regex", "grammar", "structural_tag"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}.") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object.")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool, bool]:
        """What decides the compiled grammar (not the reasoning end or stop tokens)."""
        kind = self.kind
        value = getattr(self, kind)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True)
        return kind, str(value), self.disable_any_whitespace, self.disable_additional_properties


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """Older vLLM's name (SamplingParams(guided_decoding=GuidedDecodingParams(...))), with `backend`."""

    backend: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend is not None:
            self._backend = self.backend


def check_backend(name: str | None, where: str = "guided_decoding_backend") -> None:
    """Refuse a backend that is not built here, naming the ones that are."""
    if name is None:
        return
    base = name.split(":", 1)[0]
    if base not in SUPPORTED_BACKENDS:
        known = "" if base in KNOWN_BACKENDS else " (unknown backend)"
        raise ValueError(
            f"{where}={name!r}{known} is not available; this server decodes with: {', '.join(SUPPORTED_BACKENDS)}."
        )


def coerce_structured_outputs(value: Any) -> StructuredOutputsParams | None:
    """A dict (as JSON requests and some users give it) -> StructuredOutputsParams."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        allowed = set(StructuredOutputsParams.__dataclass_fields__) - {"_reasoning_end_token_ids", "_backend"}
        unknown = sorted(set(value) - allowed - {"backend"})
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields: {', '.join(unknown)}.")
        kwargs = {k: v for k, v in value.items() if k != "backend"}
        params = StructuredOutputsParams(**kwargs)
        if value.get("backend") is not None:
            check_backend(value["backend"], "structured_outputs.backend")
            params._backend = value["backend"]
        return params
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}.")
