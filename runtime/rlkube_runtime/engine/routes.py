"""HTTP routes of SGLang's native API: each parses nothing itself and hands off to the Engine."""

from __future__ import annotations

import hmac
import json
import logging

from aiohttp import web

from rlkube_runtime.engine.engine import Engine
from rlkube_runtime.engine.metrics import metrics_text
from rlkube_runtime.engine.protocol import ProtocolError, error_envelope

log = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("engine", Engine)
routes = web.RouteTableDef()


def _engine(request: web.Request) -> Engine:
    return request.app[ENGINE_KEY]


async def _body(request: web.Request):
    """The JSON body, or None when there is none (several control endpoints take no body)."""
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as err:
        raise ProtocolError("body", f"is not valid JSON ({err})") from None


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


@routes.get("/health_generate")
async def health_generate(request: web.Request) -> web.Response:
    return web.Response(status=200 if await _engine(request).health_generate() else 503)


@routes.post("/generate")
@routes.put("/generate")
async def generate(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).generate(await _body(request)))


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """SGLang's series (engine/metrics.py); open without the API key, as SGLang's."""
    engine = _engine(request)
    return web.Response(body=metrics_text(engine.scheduler, engine.model_path), content_type="text/plain",
                        charset="utf-8")


@routes.get("/get_model_info")
@routes.get("/model_info")
async def model_info(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).model_info())


@routes.get("/get_server_info")
@routes.get("/server_info")
async def server_info(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).server_info())


@routes.get("/get_weight_version")
async def weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": _engine(request).weight_version})


@routes.get("/get_load")
async def get_load(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).get_load())


@routes.get("/v1/loads")
async def loads(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).loads())


@routes.route("*", "/flush_cache")
async def flush_cache(request: web.Request) -> web.Response:
    if await _engine(request).flush_cache():
        return web.Response(text="Cache flushed.\n")
    return web.Response(status=400, text="Cache not flushed: requests are running or waiting.\n")


@routes.post("/abort_request")
async def abort_request(request: web.Request) -> web.Response:
    aborted = await _engine(request).abort(await _body(request))
    return web.json_response({"success": True, "num_aborted": aborted})


@routes.post("/pause_generation")
async def pause_generation(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).pause(await _body(request)))


@routes.post("/continue_generation")
async def continue_generation(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).resume())


@routes.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).update_weights_from_tensor(await _body(request)))


@routes.post("/init_weights_update_group")
async def init_weights_update_group(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).init_weights_update_group(await _body(request)))


@routes.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).update_weights_from_distributed(await _body(request)))


@routes.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).destroy_weights_update_group(await _body(request)))


@routes.post("/update_weights_from_disk")
async def update_weights_from_disk(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).update_weights_from_disk(await _body(request)))


@routes.post("/load_lora_adapter")
async def load_lora_adapter(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).load_lora_adapter(await _body(request)))


@routes.post("/unload_lora_adapter")
async def unload_lora_adapter(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).unload_lora_adapter(await _body(request)))


@routes.post("/update_weight_version")
async def update_weight_version(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).update_weight_version(await _body(request)))


@routes.route("*", "/release_memory_occupation")
async def release_memory_occupation(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).release_memory(await _body(request)))


@routes.route("*", "/resume_memory_occupation")
async def resume_memory_occupation(request: web.Request) -> web.Response:
    return web.json_response(await _engine(request).resume_memory(await _body(request)))


@web.middleware
async def error_envelope_middleware(request: web.Request, handler):
    """One error shape for every route: 400 naming the field, 500 with the cause; never a crash."""
    try:
        return await handler(request)
    except ProtocolError as err:
        return web.json_response(error_envelope(str(err), status=400, field=err.field), status=400)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        return web.json_response(error_envelope(err.reason, status=err.status), status=err.status)
    except Exception as err:
        log.exception("request to %s failed", request.path)
        return web.json_response(error_envelope(f"{type(err).__name__}: {err}", status=500), status=500)


def require_api_key(api_key: str):
    """SGLang's rule (sglang/srt/utils/auth.py): with an API key set, every request needs
    `Authorization: Bearer <key>` but OPTIONS and /health*, /metrics* (probes and scrapes), which
    answer without one; others get 401."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler):
        open_path = request.path.startswith(("/health", "/metrics"))
        given = request.headers.get("Authorization", "").encode()
        if request.method == "OPTIONS" or open_path or hmac.compare_digest(given, expected):
            return await handler(request)
        return web.json_response({"error": "Unauthorized"}, status=401)

    return middleware


def build_app(engine: Engine, api_key: str | None = None) -> web.Application:
    """The aiohttp application; the engine's scheduler starts and stops with it. With `api_key`,
    requests without it are refused (require_api_key)."""
    middlewares = [require_api_key(api_key)] if api_key else []
    app = web.Application(middlewares=[*middlewares, error_envelope_middleware], client_max_size=2**31)
    app[ENGINE_KEY] = engine
    app.add_routes(routes)

    async def lifecycle(app: web.Application):
        engine.start()
        yield
        engine.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
