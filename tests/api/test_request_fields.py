"""No request field is dropped silently: each field of each route's request type is read by the
API's code (honoured, or refused by name when set: `tests/api/test_audit.py` sends each refused
one) or is informational by design, and has a row in docs/api.md's table for its route; every
body field the official SDKs send is declared; unknown fields are accepted, as documented."""

from __future__ import annotations

import ast
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from anthropic.types import message_count_tokens_params, message_create_params
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from deepinfer.api.anthropic import schemas as anthropic_schemas
from deepinfer.api.anthropic.schemas import CountTokensRequest, MessagesRequest, ToolIn
from deepinfer.api.openai import schemas as openai_schemas
from deepinfer.api.openai import token_routes
from deepinfer.api.openai.schemas import ChatCompletionRequest, CompletionRequest, FunctionTool
from deepinfer.api.openai.token_routes import DetokenizeRequest, TokenizeRequest
from deepinfer.api.responses import fields as responses_fields
from deepinfer.api.responses.schemas import ResponsesRequest
from deepinfer.api.responses.tools import NamedChoice, ResponsesTool
from tests.api.field_reads import field_reads
from tests.api.live_server import LiveServer

ROOT = Path(__file__).parents[2]
API = ROOT / "deepinfer" / "api"
DOCS = ROOT / "docs" / "api.md"

SENT_AS_HEADERS = frozenset({"user_profile_id", "workspace_id"})
"""Parameters of the anthropic SDK's `messages.create` that travel as headers, not in the body."""


@dataclass(frozen=True)
class RouteFields:
    route: str
    request: type[msgspec.Struct]
    informational: frozenset[str]
    section: str
    """The docs/api.md heading (its start) whose table lists the fields."""
    sdk_params: tuple[Any, ...] = ()
    """The official SDK's TypedDicts of the request body."""
    body: dict[str, Any] | None = None
    """A minimal valid body (None: a GET route or one not served over HTTP here)."""


MESSAGES = [{"role": "user", "content": "hi"}]
ROUTES = [
    RouteFields(
        "/v1/chat/completions", ChatCompletionRequest, openai_schemas.INFORMATIONAL_FIELDS,
        "### OpenAI: `POST /v1/chat/completions`", (chat_create_params.CompletionCreateParamsBase,),
        {"messages": MESSAGES, "max_tokens": 2},
    ),
    RouteFields(
        "/v1/completions", CompletionRequest, openai_schemas.INFORMATIONAL_FIELDS,
        "### OpenAI: `POST /v1/chat/completions`", (completion_create_params.CompletionCreateParamsBase,),
        {"prompt": "hi", "max_tokens": 2},
    ),
    RouteFields(
        "/v1/responses", ResponsesRequest, responses_fields.INFORMATIONAL_FIELDS,
        "### OpenAI Responses", (response_create_params.ResponseCreateParamsBase,),
        {"input": "hi", "max_output_tokens": 2},
    ),
    RouteFields(
        "/v1/messages", MessagesRequest, anthropic_schemas.INFORMATIONAL_FIELDS,
        "### Anthropic", (message_create_params.MessageCreateParamsBase,),
        {"messages": MESSAGES, "max_tokens": 2},
    ),
    RouteFields(
        "/v1/messages/count_tokens", CountTokensRequest, anthropic_schemas.INFORMATIONAL_FIELDS,
        "### Anthropic", (message_count_tokens_params.MessageCountTokensParams,),
        {"messages": MESSAGES},
    ),
    RouteFields(
        "/tokenize", TokenizeRequest, token_routes.INFORMATIONAL_FIELDS,
        "### Token utilities", body={"prompt": "hi"},
    ),
    RouteFields(
        "/detokenize", DetokenizeRequest, token_routes.INFORMATIONAL_FIELDS,
        "### Token utilities", body={"tokens": [70, 71]},
    ),
]  # fmt: skip
IDS = [r.route for r in ROUTES]

DECODED_LATER: tuple[type[msgspec.Struct], ...] = (ToolIn, FunctionTool, ResponsesTool, NamedChoice)
"""Structs decoded from a raw field after the request limits sized it."""

NESTED_WITHOUT_EFFECT: dict[str, str] = {}


def _request_type_names() -> set[str]:
    return {
        c.__name__
        for r in ROUTES
        for c in r.request.__mro__
        if issubclass(c, msgspec.Struct) and c is not msgspec.Struct
    }


@pytest.fixture(scope="module")
def reads() -> dict[str, set[str]]:
    return field_reads(API, _request_type_names())


def _fields(struct: type[msgspec.Struct]) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(struct)}


def _docs_rows(section: str) -> list[tuple[set[str], str]]:
    """(the field names a row's first cell names in backticks, the row's status cell) for each
    row of the table under `section`."""
    text = DOCS.read_text()
    start = text.index("\n" + section)
    end = re.compile(r"\n##").search(text, start + 1)
    body = text[start : end.start() if end else len(text)]
    rows: list[tuple[set[str], str]] = []
    for line in body.splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        )
        if len(cells) < 2 or cells[0] in ("field", "route") or set(cells[0]) <= {"-", " "}:
            continue
        names = {m.group(1) for m in re.finditer(r"`([a-z_][a-z0-9_]*)", cells[0])}
        rows.append((names, " | ".join(cells[1:])))
    return rows


@pytest.mark.parametrize("r", ROUTES, ids=IDS)
def test_every_field_is_read_or_informational(r: RouteFields, reads: dict[str, set[str]]) -> None:
    read = set().union(*(reads.get(c.__name__, set()) for c in r.request.__mro__))
    fields = _fields(r.request)
    unread = fields - read - r.informational
    assert not unread, f"{r.route}: {unread} declared, never read and not informational"


@pytest.mark.parametrize("r", ROUTES, ids=IDS)
def test_every_field_has_a_row(r: RouteFields) -> None:
    rows = _docs_rows(r.section)
    documented = set().union(*(names for names, _ in rows))
    missing = _fields(r.request) - documented
    assert not missing, f"{r.route}: no row in docs/api.md's {r.section} table for {missing}"
    for name in _fields(r.request) & r.informational:
        statuses = [status for names, status in rows if name in names]
        assert any("informational" in s for s in statuses), (name, statuses)


@pytest.mark.parametrize("r", [r for r in ROUTES if r.sdk_params], ids=lambda r: r.route)
def test_every_sdk_body_field_is_declared(r: RouteFields) -> None:
    """A field the SDK sends but the server does not declare would be dropped as an unknown
    one: that is how `output_config.format` went unhonoured."""
    sent: set[str] = set()
    for params in r.sdk_params:
        for cls in params.__mro__:
            sent |= set(getattr(cls, "__annotations__", {}))
    missing = sent - SENT_AS_HEADERS - _fields(r.request)
    assert not missing, f"{r.route}: the SDK sends {sorted(missing)}, undeclared"


def _nested(struct: type[msgspec.Struct], seen: set[type[msgspec.Struct]]) -> None:
    for f in msgspec.structs.fields(struct):
        stack: list[Any] = [f.type]
        while stack:
            tp = stack.pop()
            stack += typing.get_args(tp)
            if isinstance(tp, type) and issubclass(tp, msgspec.Struct) and tp not in seen:
                seen.add(tp)
                _nested(tp, seen)


def test_nested_fields_are_read() -> None:
    """The fields of the structs inside requests (messages, blocks, tools, options) are read
    somewhere in the API's code (their types are not tracked: any attribute of that name)."""
    seen: set[type[msgspec.Struct]] = set(DECODED_LATER)
    for r in ROUTES:
        _nested(r.request, seen)
    for struct in DECODED_LATER:
        _nested(struct, seen)
    attributes = {
        node.attr
        for path in API.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
    }
    unread = {
        f"{s.__name__}.{f.name}"
        for s in seen
        for f in msgspec.structs.fields(s)
        if f.name not in attributes
    }
    assert unread == set(NESTED_WITHOUT_EFFECT)


def test_the_walk_finds_an_unread_field(tmp_path: Path) -> None:
    """The walk is not vacuous: of a request type's fields, it sees exactly those the code reads,
    however the value reached the code."""
    (tmp_path / "routes.py").write_text(
        "class Pending:\n    req: Req | None\n\n"
        "async def handler(ctx, request):\n    req = await ctx.read_json(request, Req)\n"
        "    return req.a, helper(req)\n\n"
        "def helper(r: list[Base]) -> int:\n    return getattr(r, 'b', 0)\n\n"
        "def later(p: Pending) -> None:\n    print(p.req.c)\n\n"
        "def unrelated(x) -> None:\n    print(x.d)\n"
    )
    found = field_reads(tmp_path, {"Req", "Base"})
    assert found == {"Req": {"a", "c"}, "Base": {"b"}}


def test_request_types_accept_unknown_fields() -> None:
    for r in ROUTES:
        assert not r.request.__struct_config__.forbid_unknown_fields, r.route


@pytest.mark.parametrize("r", [r for r in ROUTES if r.body is not None], ids=lambda r: r.route)
def test_unknown_fields_have_no_effect(fake_server: LiveServer, r: RouteFields) -> None:
    assert r.body is not None
    url = fake_server.url + r.route
    plain = httpx.post(url, json=r.body, timeout=30)
    extra = httpx.post(url, json={**r.body, "x_unknown_field": {"a": [1]}}, timeout=30)
    assert plain.status_code == extra.status_code == 200, extra.text
    assert _stable(plain.json()) == _stable(extra.json())


def _stable(body: Any) -> Any:
    """A response without what differs between two identical requests (ids, times, usage)."""
    if isinstance(body, dict):
        return {
            k: _stable(v)
            for k, v in body.items()
            if k not in ("id", "created", "created_at", "completed_at", "usage")
        }
    if isinstance(body, list):
        return [_stable(v) for v in body]
    return body
