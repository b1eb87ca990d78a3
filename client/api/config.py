"""Configuration of `swarmlm api`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ApiConfig:
    """What the HTTP server admits and how it answers (the swarm client has its own ClientConfig)."""

    model_id: str
    """The model's name in requests and in /v1/models (the DHT prefix of MODEL)."""
    aliases: tuple[str, ...] = ()
    """Other names requests may use for it (e.g. MODEL as given on the command line)."""
    api_key: str | None = None
    """When set, every /v1 request must carry `Authorization: Bearer <api_key>`; /health and /metrics stay open."""
    max_concurrency: int = 8
    """Generations running at once (one inference session each); more requests wait in a queue."""
    max_queued: int = 32
    """Requests waiting for a generation slot at most; beyond that a request is refused with 429 at once."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body; a larger one is refused with 413 before it is read whole."""
    default_max_tokens: int = 256
    """Tokens generated when a chat request sets no max_tokens (completions default to 16, as OpenAI's)."""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        for name in ("max_concurrency", "max_body_bytes", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for an open server)")
