"""OpenAI-compatible HTTP serving: `launch` (CLI), `api` (app and routes), `openai_serving` (completions and
chat, JSON and SSE), `protocol` (schemas, errors, sampling params), `async_engine` (the engine thread),
`metrics` (Prometheus)."""
