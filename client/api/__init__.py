"""`swarmlm api`: an OpenAI-compatible HTTP server over one swarm client.

- app: the FastAPI app (routes, authorization, streaming, error shapes); create_app(backend, config)
- schemas: request bodies, strictly validated, unsupported fields refused; errors: OpenAI's error shape
- jobs: admission (bounded queue, 429 beyond) and worker threads bridged to the event loop
- generation: one generation from a backend's tokens (stop strings, EOS, max_tokens, cancellation)
- engine: SwarmBackend, the swarm client and tokenizer behind it (a session per request, HF-exact sampling)
- text: incremental detokenizing and stop-string matching (pure); responses: OpenAI's response shapes
- metrics: Prometheus metrics, one registry per app; config: ApiConfig; cli: the command
- server: serving_in_background(app), uvicorn in a thread (benchmarks, tests, embedding programs)

May import protocol, swarm and the client's core (model, decoding, ...); not client.training or client.demo.
"""

from protocol.lazy import lazy_exports

_EXPORTS = {
    "ApiConfig": ("client.api.config", "ApiConfig"),
    "SwarmBackend": ("client.api.engine", "SwarmBackend"),
    "create_app": ("client.api.app", "create_app"),
    "serving_in_background": ("client.api.server", "serving_in_background"),
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports("client.api", _EXPORTS)
