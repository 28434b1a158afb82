"""Structured output and logit bias on the wire -> `StructuredSpec` and bias pairs.

OpenAI `response_format` (`text`, `json_object`, `json_schema` with `name`/`schema`/`strict`),
vLLM's `guided_json` / `guided_regex` / `guided_choice` and `structured_outputs` ({json, regex,
choice, grammar, json_object}), Anthropic's `output_config.format` (or `output_format`, its older
spelling: {"type": "json_schema", "schema"}).
At most one of them per request. Malformed input is a 400 naming the field; a schema the grammar
library cannot compile is refused at submit (`InvalidRequestError`, also a 400).
"""

from __future__ import annotations

from typing import Any

import msgspec

from deepinfer.api.http.errors import ApiError, ErrorKind, is_set
from deepinfer.request import StructuredKind, StructuredSpec


def invalid(param: str, message: str) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, f"{param}: {message}", param=param)


class _JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    """Required, as OpenAI does; it names the schema only (its size is bounded by the limits)."""
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class _ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    json_schema: _JsonSchemaFormat | None = None


class _StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _OutputFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    schema: dict[str, Any] | None = None


def _decode(raw: msgspec.Raw, kind: Any, param: str) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise invalid(param, str(exc)) from None


def _schema_spec(schema: str | dict[str, Any], param: str) -> StructuredSpec:
    if isinstance(schema, str):
        try:
            decoded = msgspec.json.decode(schema)
        except msgspec.DecodeError as exc:
            raise invalid(param, f"is not valid JSON: {exc}") from None
        if not isinstance(decoded, dict):
            raise invalid(param, "must be a JSON schema object")
        return StructuredSpec(StructuredKind.JSON_SCHEMA, schema, param)
    return StructuredSpec(StructuredKind.JSON_SCHEMA, msgspec.json.encode(schema).decode(), param)


def response_format_spec(raw: msgspec.Raw) -> StructuredSpec | None:
    """OpenAI's `response_format` (empty `raw`: absent)."""
    if not len(raw):
        return None
    fmt: _ResponseFormat = _decode(raw, _ResponseFormat, "response_format")
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredSpec(StructuredKind.JSON_OBJECT, "", "response_format")
    if fmt.type != "json_schema":
        raise invalid(
            "response_format.type",
            f"unsupported {fmt.type!r}; use 'text', 'json_object' or 'json_schema'",
        )
    spec = fmt.json_schema
    if spec is None:
        raise invalid("response_format.json_schema", "is required for type 'json_schema'")
    if spec.schema is None:
        return StructuredSpec(StructuredKind.JSON_OBJECT, "", "response_format.json_schema")
    return _schema_spec(spec.schema, "response_format.json_schema.schema")


def _choice_spec(choice: list[str], param: str) -> StructuredSpec:
    if not choice or not all(choice):
        raise invalid(param, "must be a non-empty list of non-empty strings")
    return StructuredSpec(StructuredKind.CHOICE, msgspec.json.encode(choice).decode(), param)


def structured_outputs_spec(raw: msgspec.Raw) -> StructuredSpec | None:
    """vLLM's `structured_outputs` object: exactly one of its constraints."""
    if not len(raw):
        return None
    so: _StructuredOutputs = _decode(raw, _StructuredOutputs, "structured_outputs")
    specs: list[StructuredSpec] = []
    if so.json is not None:
        specs.append(_schema_spec(so.json, "structured_outputs.json"))
    if so.regex is not None:
        specs.append(StructuredSpec(StructuredKind.REGEX, so.regex, "structured_outputs.regex"))
    if so.choice is not None:
        specs.append(_choice_spec(so.choice, "structured_outputs.choice"))
    if so.grammar is not None:
        param = "structured_outputs.grammar"
        specs.append(StructuredSpec(StructuredKind.GRAMMAR, so.grammar, param))
    if so.json_object:
        specs.append(StructuredSpec(StructuredKind.JSON_OBJECT, "", "structured_outputs"))
    if len(specs) > 1:
        raise invalid("structured_outputs", "set only one of json, regex, choice, grammar")
    return specs[0] if specs else None


def openai_spec(
    *,
    response_format: msgspec.Raw,
    guided_json: msgspec.Raw,
    guided_regex: str | None,
    guided_choice: list[str] | None,
    structured_outputs: msgspec.Raw,
) -> StructuredSpec | None:
    """The one constraint of an OpenAI chat or completion request, or None."""
    found: list[StructuredSpec] = []
    if (spec := response_format_spec(response_format)) is not None:
        found.append(spec)
    if len(guided_json):
        schema = _decode(guided_json, str | dict[str, Any], "guided_json")
        found.append(_schema_spec(schema, "guided_json"))
    if guided_regex is not None:
        found.append(StructuredSpec(StructuredKind.REGEX, guided_regex, "guided_regex"))
    if guided_choice is not None:
        found.append(_choice_spec(guided_choice, "guided_choice"))
    if (spec := structured_outputs_spec(structured_outputs)) is not None:
        found.append(spec)
    if len(found) > 1:
        raise invalid(found[1].param, f"conflicts with {found[0].param}: set only one constraint")
    return found[0] if found else None


def anthropic_spec(output_format: msgspec.Raw, config_format: msgspec.Raw) -> StructuredSpec | None:
    """Anthropic's `output_config.format` or its older spelling `output_format` (each
    {"type": "json_schema", "schema": {...}}), or None. Both may be sent only if they agree."""
    old = _anthropic_format(output_format, "output_format")
    new = _anthropic_format(config_format, "output_config.format")
    if old is not None and new is not None and _json(old.source) != _json(new.source):
        raise invalid("output_config.format", "differs from output_format: send one of them")
    return new or old


def _json(text: str) -> Any:
    return msgspec.json.decode(text)


def _anthropic_format(raw: msgspec.Raw, param: str) -> StructuredSpec | None:
    if not is_set(raw):
        return None
    fmt: _OutputFormat = _decode(raw, _OutputFormat, param)
    if fmt.type != "json_schema":
        raise invalid(f"{param}.type", f"unsupported {fmt.type!r}; use 'json_schema'")
    if fmt.schema is None:
        raise invalid(f"{param}.schema", "is required for type 'json_schema'")
    return _schema_spec(fmt.schema, f"{param}.schema")


def logit_bias_pairs(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token_id": bias}` as sorted (id, bias) pairs; the ranges are checked by
    `SamplingParams`, the vocabulary at submit."""
    if not bias:
        return ()
    pairs: list[tuple[int, float]] = []
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid("logit_bias", f"keys must be token ids, got {key!r}") from None
        pairs.append((token_id, float(value)))
    return tuple(sorted(pairs))
