"""Structured output and logit_bias on the wire: each field's spec (api/tools/structured.py), 400s
naming the malformed field (fake engine), and on the real model through the official SDKs: a
pydantic model parsed by `chat.completions.parse`, 32 corpus schemas at once at temperature 0
and 1, uncompilable schemas and out-of-vocabulary biases refused with a 400."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import msgspec
import openai
import pydantic
import pytest

from deepinfer.api.http.errors import ApiError
from deepinfer.api.tools.structured import anthropic_spec, logit_bias_pairs, openai_spec
from deepinfer.request import StructuredKind
from tests.api.live_server import LiveServer


def _raw(value: object) -> msgspec.Raw:
    return msgspec.Raw(json.dumps(value).encode()) if value is not None else msgspec.Raw()


def _spec(**fields: Any) -> Any:
    return openai_spec(
        response_format=_raw(fields.get("response_format")),
        guided_json=_raw(fields.get("guided_json")),
        guided_regex=fields.get("guided_regex"),
        guided_choice=fields.get("guided_choice"),
        structured_outputs=_raw(fields.get("structured_outputs")),
    )


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_each_field_gives_its_spec() -> None:
    assert _spec() is None and _spec(response_format={"type": "text"}) is None
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    cases = {
        StructuredKind.JSON_SCHEMA: [
            _spec(response_format=rf),
            _spec(guided_json=SCHEMA),
            _spec(guided_json=json.dumps(SCHEMA)),
            _spec(structured_outputs={"json": SCHEMA}),
            anthropic_spec(_raw({"type": "json_schema", "schema": SCHEMA}), msgspec.Raw()),
            anthropic_spec(msgspec.Raw(), _raw({"type": "json_schema", "schema": SCHEMA})),
        ],
        StructuredKind.JSON_OBJECT: [_spec(response_format={"type": "json_object"})],
        StructuredKind.REGEX: [
            _spec(guided_regex="a+"),
            _spec(structured_outputs={"regex": "a+"}),
        ],
        StructuredKind.CHOICE: [_spec(guided_choice=["a", "b"])],
        StructuredKind.GRAMMAR: [_spec(structured_outputs={"grammar": 'start: "x"'})],
    }
    for kind, specs in cases.items():
        for spec in specs:
            assert spec is not None and spec.kind is kind
            if kind is StructuredKind.JSON_SCHEMA:
                assert json.loads(spec.source) == SCHEMA
    assert logit_bias_pairs({"5": 1.5, "2": -100}) == ((2, -100.0), (5, 1.5))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format",
        ),
        ({"guided_json": "[1, 2"}, "guided_json"),
        ({"guided_json": 5}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"yaml": "a"}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)
def test_malformed_fields_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        _spec(**fields)
    assert info.value.param == param


def test_malformed_over_http(fake_server: LiveServer) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for extra, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"guided_choice": [""]}, "guided_choice"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
    ]:
        r = httpx.post(f"{fake_server.url}/v1/chat/completions", json=base | extra)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    body = {"max_tokens": 4, "messages": base["messages"], "output_format": {"type": "text"}}
    r = httpx.post(f"{fake_server.url}/v1/messages", json=body)
    assert r.status_code == 400 and "output_format" in r.text
    ok = base | {"response_format": {"type": "json_object"}, "logit_bias": {"5": 3}}
    assert httpx.post(f"{fake_server.url}/v1/chat/completions", json=ok).status_code == 200


# ---- the real model


def _corpus(count: int) -> list[dict[str, Any]]:
    import importlib.util

    path = Path(__file__).parents[2] / "sampling" / "structured" / "schema_corpus.py"
    spec = importlib.util.spec_from_file_location("schema_corpus", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.schema_corpus(count))


@pytest.fixture
def oai(real_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population: int = pydantic.Field(ge=0, le=100_000_000)


@pytest.mark.slow
def test_parse_returns_a_pydantic_object(oai: openai.OpenAI) -> None:
    completion = oai.chat.completions.parse(
        model="m",
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=200,
        temperature=0.0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and completion.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_n_choices_each_follow_the_schema(oai: openai.OpenAI) -> None:
    """`n > 1`: every choice samples under its own copy of the grammar."""
    completion = oai.chat.completions.parse(
        model="m",
        messages=[{"role": "user", "content": "Describe a city as JSON."}],
        response_format=City,
        max_tokens=200,
        temperature=1.0,
        seed=3,
        n=3,
    )
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert isinstance(choice.message.parsed, City) and choice.finish_reason == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_32_schemas_at_once(real_server: LiveServer, temperature: float) -> None:
    schemas = _corpus(32)

    async def one(client: openai.AsyncOpenAI, i: int, schema: dict[str, Any]) -> tuple[str, str]:
        r = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Reply with JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema},
            },
            max_tokens=300,
            temperature=temperature,
            seed=i,
        )
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    async def run() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(
            base_url=real_server.url + "/v1", api_key="x", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, i, s) for i, s in enumerate(schemas)))

    checker = jsonschema.FormatChecker()
    for (text, reason), schema in zip(asyncio.run(run()), schemas, strict=True):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema, format_checker=checker)


@pytest.mark.slow
def test_bad_schemas_and_biases_are_400(oai: openai.OpenAI, real_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="m", messages=messages, response_format=bad)  # type: ignore[arg-type]
    assert "frobnicate" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="m", messages=messages, logit_bias={"999999": 5})
    assert "logit_bias" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="m", prompt="x", extra_body={"guided_regex": "a("})
    with anthropic.Anthropic(base_url=real_server.url, api_key="x", max_retries=0) as ant:
        msg = ant.messages.create(
            model="m",
            max_tokens=60,
            messages=[{"role": "user", "content": "A yes/no JSON answer."}],
            extra_body={
                "output_format": {
                    "type": "json_schema",
                    "schema": {
                        "type": "object",
                        "properties": {"ok": {"type": "boolean"}},
                        "required": ["ok"],
                        "additionalProperties": False,
                    },
                }
            },
        )
    assert isinstance(json.loads(msg.content[0].text)["ok"], bool)  # type: ignore[union-attr]


@pytest.mark.slow
def test_logit_bias_forces_a_token(oai: openai.OpenAI, real_server: LiveServer) -> None:
    tokenizer = real_server.config.app.state.engine.tokenizer
    r = oai.completions.create(
        model="m", prompt="Hello", max_tokens=3, temperature=0.0, logit_bias={"42": 100}
    )
    assert r.choices[0].text == tokenizer.decode([42, 42, 42])


def _chain(depth: int) -> dict[str, Any]:
    """A schema whose definitions chain `depth` deep through `anyOf` (~66 bytes a link)."""
    defs: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(depth)
    }
    defs[f"d{depth}"] = {"type": "string"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "$defs": defs}


@pytest.mark.slow
def test_every_grammar_field_survives_a_compiler_crasher(real_server: LiveServer) -> None:
    """Each of the ten fields that compile a grammar, carrying a schema (or a lark rule chain)
    that overflows the grammar library's compiler: a 400 in the API's own envelope (for forced
    tools, whose schemas the prompt carries, the context's limit may refuse it first), and the
    server goes on serving."""
    deep = _chain(2500)
    lark = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(12000)) + '\nr12000: "x"'
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    forced = {"type": "function", "function": {"name": "f"}}
    user = [{"role": "user", "content": "hi"}]
    chat = {"messages": user, "max_tokens": 4}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", chat | {"response_format": rf}),
        ("/v1/chat/completions", chat | {"guided_json": deep}),
        ("/v1/chat/completions", chat | {"structured_outputs": {"json": deep}}),
        ("/v1/chat/completions", chat | {"structured_outputs": {"grammar": lark}}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_json": deep}),
        ("/v1/chat/completions", chat | {"tools": [tool], "tool_choice": forced}),
        (
            "/v1/messages",
            chat | {"output_format": {"type": "json_schema", "schema": deep}},
        ),
        (
            "/v1/messages",
            chat
            | {
                "tools": [{"name": "f", "input_schema": deep}],
                "tool_choice": {"type": "tool", "name": "f"},
            },
        ),
        (
            "/v1/responses",
            {
                "input": "hi",
                "max_output_tokens": 4,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": deep}},
            },
        ),
        (
            "/v1/responses",
            {
                "input": "hi",
                "max_output_tokens": 4,
                "tools": [{"type": "function", "name": "f", "parameters": deep}],
                "tool_choice": {"type": "function", "name": "f"},
            },
        ),
    ]
    with httpx.Client(base_url=real_server.url, timeout=120) as client:
        for path, body in cases:
            assert len(json.dumps(body)) < 256 << 10
            r = client.post(path, json=body)
            assert r.status_code == 400, (path, list(body), r.text[:500])
            error = r.json()["error"]
            # a tool's schema is rendered into the prompt too: past the context, that comes first
            refused = "tools" in body and "context" in error["message"]
            assert refused or "grammar compiler" in error["message"], (path, error)
            ok = client.post("/v1/chat/completions", json=chat)
            assert ok.status_code == 200, ok.text
