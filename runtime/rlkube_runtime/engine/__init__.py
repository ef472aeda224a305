"""rlkube's built-in rollout engine: SGLang's native HTTP protocol over a transformers causal LM.

It lets CPU runs and tests exercise the same rollout client, router and weight-sync path as
production SGLang servers. Start it with `python -m rlkube_runtime.engine --model-path DIR`.

Modules, one job each: `protocol` (request/response shapes and validation), `sampling` (seeded
per-request sampling and logprobs), `kv_batch` (the joined left-padded KV cache), `sequence` (one
generation and its stop rules), `scheduler` (the continuous-batching loop thread), `weights`
(weight transport, loading and offload), `engine` (the object routes hand off to), `routes`
(the aiohttp app).
"""
