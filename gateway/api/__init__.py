"""The HTTP API: ``create_app`` composes the route modules (OpenAI, admin, browser pages, OpenAPI) over one
``GatewayState`` (``state``); shared HTTP helpers (JSON bodies, bearer-key auth) live beside them. The OpenAI-shaped
errors are ``gateway.base.errors``, which every layer raises."""
