"""OpenAI-compatible HTTP serving: `launch` (CLI), `api` (routes), `protocol` (schemas, errors),
`async_engine` (the engine thread), `metrics` (Prometheus)."""
