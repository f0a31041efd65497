"""The HTTP API: ``create_app`` composes the route modules (OpenAI, admin, browser pages, OpenAPI) over one
``GatewayState``; shared HTTP helpers (JSON bodies, OpenAI-shaped errors, bearer-key auth) live beside them."""
