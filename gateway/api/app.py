"""The Quart (quart-trio) application: ``create_app`` composes the route modules over one ``GatewayState``.

Route modules: ``generation_routes`` (the OpenAI generation routes), ``responses_routes`` (the Responses API,
which reuses the generation routes' steps), ``files_routes`` and ``batch_routes`` (the Batch API),
``service_routes`` (health, ready, version, models, own usage, metrics), ``token_routes`` (tokenize/detokenize),
``admin`` (the /admin JSON API), ``adapter_routes`` (registering LoRA adapters),
``openapi`` (/openapi.json), ``web`` (browser pages, security headers, CORS, /admin/workers) and ``worker_admin``
(drain a worker); ``hooks`` holds the app-wide response hooks and the error handlers that make every error
OpenAI-shaped JSON.
"""

from __future__ import annotations

from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from gateway.api import (batch_routes, files_routes, generation_routes, hooks, openapi, responses_routes,
                         service_routes, token_routes)
from gateway.api.adapter_routes import create_adapter_blueprint
from gateway.api.admin import create_admin_blueprint
from gateway.api.context import bind_state
from gateway.api.http_json import close_if_body_unread, read_body_first
from gateway.api.web import create_web_blueprint
from gateway.api.worker_admin import create_worker_admin_blueprint
from gateway.base.errors import APIError
from gateway.api.state import GatewayState


def create_app(state: GatewayState) -> QuartTrio:
    app = QuartTrio("kvgate")
    cfg = state.config
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # streams set it too; a long completion must not be cut at 60 s
    app.config["BODY_TIMEOUT"] = 60
    bind_state(app, state)
    # Registration order is the hooks' order: keep it (after_request functions run last-registered first).
    app.after_request(hooks.add_ratelimit_headers)
    generation_routes.register(app)
    responses_routes.register(app)
    files_routes.register(app, cfg.batch.max_file_bytes)  # uploads get a body limit of their own
    batch_routes.register(app)
    service_routes.register(app)
    token_routes.register(app)
    app.register_blueprint(create_admin_blueprint(state.tenancy.store, cfg.tenancy.admin_token,
                                                  lambda: _tenancy_changed(state), state.lora))
    app.register_blueprint(create_adapter_blueprint())  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    app.add_url_rule("/openapi.json", "openapi", openapi.route(cfg.model_name), methods=["GET"])  # fuzzers, SDKs
    app.before_request(hooks.refuse_while_draining)
    app.before_request(read_body_first)  # a keep-alive connection must not wedge on an unread body
    app.after_request(close_if_body_unread)
    app.register_blueprint(create_web_blueprint(state))  # pages, security headers, CORS, /admin/workers
    app.register_blueprint(create_worker_admin_blueprint(state))  # POST /admin/workers/<id>/drain
    app.register_error_handler(APIError, hooks.on_api_error)
    app.register_error_handler(HTTPException, hooks.on_http_error)
    app.register_error_handler(Exception, hooks.on_unexpected)
    return app


def _tenancy_changed(state: GatewayState) -> None:
    """After an admin mutation: keys, quotas and tenants apply at once, and a suspended or deleted tenant's
    adapters (unregistered with it) stop resolving at once."""
    state.tenancy.auth.invalidate()
    state.tenancy.adapters.invalidate()
