"""The HTTP server's settings: where it listens, what it accepts, and the bounds on one request."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from deepinfer.errors import ConfigError


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request, each checked before any work proportional to what it bounds; a
    request over one gets a 400 naming the limit."""

    max_json_depth: int = 64
    """Deepest nesting of arrays and objects in a JSON body."""
    max_messages: int = 4096
    """Messages in one chat or Messages request."""
    max_stop_strings: int = 16
    """Stop strings (`stop`, `stop_sequences`) in one request."""
    max_stop_string_chars: int = 1024
    """Characters in one stop string."""
    max_stop_token_ids: int = 1024
    """Entries of `stop_token_ids`."""
    max_logit_bias: int = 1024
    """Entries of `logit_bias`."""
    max_tools: int = 256
    """Tools declared in one request."""
    max_schema_bytes: int = 256 << 10
    """Bytes of JSON of the tools' definitions together, and of a response format's schema."""


@dataclass(frozen=True)
class StoredResponseLimits:
    """Bounds on the Responses API's stored conversations (`previous_response_id`). A tenant
    (the API key's identity and `cache_salt`, as for the prefix cache) past its own bound loses
    its own least recently used responses; past the global bound, the least recently used of all
    go."""

    max_stored_responses: int = 4096
    """Responses kept for `previous_response_id`, all tenants together."""
    max_stored_chars: int = 64 << 20
    """Characters of conversation text (and bytes of response JSON) the stored responses hold,
    all tenants together."""
    max_stored_responses_per_tenant: int = 512
    """Responses one tenant keeps stored; its next one drops its own least recently used."""
    max_stored_chars_per_tenant: int = 8 << 20
    """Characters of conversation text (and bytes of response JSON) one tenant's stored
    responses hold."""

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if value < 1:
                raise ConfigError(f"server.stored_responses.{name} must be at least 1, got {value}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address the HTTP server listens on."""
    port: int = 8000
    """TCP port the HTTP server listens on."""
    api_key: str | None = None
    """When set, every API request must carry it (Bearer or x-api-key)."""
    max_body_bytes: int = 4 << 20
    """Request bodies larger than this get 413."""
    served_model_name: str | None = None
    """Name reported by /v1/models; None: the model file's stem."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """Bounds on one request's size and work."""
    stored_responses: StoredResponseLimits = field(default_factory=StoredResponseLimits)
    """Bounds on the Responses API's stored conversations, overall and per tenant."""
    web: bool = True
    """Serve the web pages: a chat playground at `/` and a live dashboard at `/dashboard`
    (static files; they call the API with the key the user types)."""
    header_timeout_s: float = 10.0
    """A connection that has not sent a whole request head this long after it opened (or after
    its previous response) is closed; bytes trickling in do not extend it."""
    body_timeout_s: float = 30.0
    """A request whose body stalls this long between two reads is answered 408 and closed."""
    body_grace_s: float = 20.0
    """A request body may take this long at any pace; after it, one that has arrived slower on
    average than `min_body_rate_bytes_per_s` is answered 408 and closed."""
    min_body_rate_bytes_per_s: float = 500.0
    """Slowest average pace of a request body past `body_grace_s`: each byte received extends
    the body's deadline by 1 / this seconds."""
    keep_alive_timeout_s: float = 5.0
    """An idle keep-alive connection is closed this long after its last response."""
    max_connections: int = 1024
    """Open connections served at once. Connections beyond it are still accepted, but while more
    are open (or more requests in flight) every request, on any connection, is answered 503 and
    its connection closed. Stalled connections count until the deadlines above close them; when
    one more opens, stalled connections of the addresses holding over an equal share (the cap
    over the addresses holding any) are closed, oldest first, to make room. A lone address keeps
    the whole cap."""

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self.limits).items():
            if value < 1:
                raise ConfigError(f"server.limits.{name} must be at least 1, got {value}")
        for name in (
            "header_timeout_s",
            "body_timeout_s",
            "body_grace_s",
            "min_body_rate_bytes_per_s",
            "keep_alive_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"server.{name} must be positive, got {getattr(self, name)}")
        if self.max_connections < 1 or self.max_body_bytes < 1:
            raise ConfigError("server.max_connections and max_body_bytes must be at least 1")
