"""/openapi.json matches the app's routes both ways: every route served is documented (except the browser pages and
their static files, listed in gateway.api.openapi.BROWSER_ROUTES), and every documented operation is served.

The app is built with stand-ins for the pool, tokenizer and tenancy (no worker, no model): ``create_app`` only
registers routes with them. The document itself is also checked for the shape the chaos drill's fuzzer relies on.
"""

from __future__ import annotations

import re
from pathlib import Path
from unittest.mock import MagicMock

from gateway.config import GatewayConfig, TenancyConfig
from gateway.api.openapi import BROWSER_ROUTES, document

IGNORED_METHODS = {"HEAD", "OPTIONS"}


def _served(tmp_path: Path) -> set[tuple[str, str]]:
    from gateway.api.app import create_app

    state = MagicMock()
    state.config = GatewayConfig(tenancy=TenancyConfig(db_path=str(tmp_path / "kvgate.db"),
                                                       admin_token="a" * 32))
    app = create_app(state)
    served = set()
    for rule in app.url_map.iter_rules():
        if rule.rule in BROWSER_ROUTES or rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule)
        served |= {(path, m.lower()) for m in (rule.methods or set()) - IGNORED_METHODS}
    return served


def test_document_matches_routes(tmp_path: Path) -> None:
    documented = {(path, method) for path, ops in document()["paths"].items() for method in ops}
    served = _served(tmp_path)
    assert not served - documented, f"served but not documented: {sorted(served - documented)}"
    assert not documented - served, f"documented but not served: {sorted(documented - served)}"


def test_every_operation_declares_the_error_shape() -> None:
    doc = document()
    error = doc["components"]["schemas"]["Error"]["properties"]["error"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith("/Error"), \
                (path, method)
            for p in op.get("parameters", []):
                assert p["in"] != "path" or "{" + p["name"] + "}" in path, (path, p["name"])
