"""Serving: the engines and the sglang-router as processes, and the HTTP clients that talk to them.

`sglang_args` derives an SGLang server's command line from the job (pure, and the pinned SGLang /
sglang-router pair); `launch` starts SGLang servers or the built-in engine as child processes and
waits until they are ready; `router` starts the sglang-router and adds and removes its workers;
`client` is the async HTTP side: `RolloutClient` for generation through the router, `EngineAdmin`
for one engine's control API; `engine_metrics` passes the engines' own /metrics through the
driver's. Generation itself (rollout/) only sees the client it is handed.
"""
