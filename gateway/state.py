"""What the routes of one gateway share, built and run by ``gateway.server`` (one owner per piece: the pool
owns the workers, the tenancy parts own tenants and usage, the metrics and tracing own their registries)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.admission import QuotaGate
from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.gateway_metrics import GatewayMetrics
from gateway.ledger import UsageLedger
from gateway.pool import WorkerPool
from gateway.tokenizer import GatewayTokenizer
from gateway.tracing import Tracing
from tenancy.store import TenancyStore


@dataclass
class Tenancy:
    """Everything about tenants the routes use."""

    store: TenancyStore
    auth: Authenticator
    quota: QuotaGate
    ledger: UsageLedger


@dataclass
class GatewayState:
    config: GatewayConfig
    tokenizer: GatewayTokenizer
    pool: WorkerPool
    tenancy: Tenancy
    metrics: GatewayMetrics
    tracing: Tracing = field(default_factory=Tracing)  # no exporter: OTel's no-op tracer
    created: int = field(default_factory=lambda: int(time.time()))
