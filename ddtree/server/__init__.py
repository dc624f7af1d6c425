"""OpenAI-compatible HTTP serving: `launch` (CLI), `api` (app and routes), `openai_serving` (completions and
chat, JSON and SSE), `protocol` (schemas, errors, sampling params), `async_engine` (the engine thread),
`metrics` (Prometheus); SGLang's native `/generate` and `/get_model_info` in `native_api` (schemas in
`native_protocol`); log-prob rendering in `logprob_format`; `--dp-size` replicas behind one server in
`dp/`."""
