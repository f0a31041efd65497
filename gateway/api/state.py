"""What the routes of one gateway share, built and run by ``gateway.server`` (one owner per piece: the pool
owns the workers, the tenancy parts own tenants and usage, the metrics and tracing own their registries)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.pipeline.adapters import AdapterCatalog
from gateway.pipeline.admission import QuotaGate
from gateway.api.auth import Authenticator
from gateway.batches.stored import StoredBatches
from gateway.config import GatewayConfig
from gateway.telemetry.gateway_metrics import GatewayMetrics
from gateway.pipeline.ledger import UsageLedger
from gateway.fleet.pool import WorkerPool
from gateway.pipeline.tokenizer import GatewayTokenizer
from gateway.responses.stored import StoredResponses
from gateway.telemetry.tracing import Tracing
from tenancy.lora_check import LoraContext
from tenancy.store import TenancyStore


@dataclass
class Tenancy:
    """Everything about tenants the routes use."""

    store: TenancyStore
    auth: Authenticator
    quota: QuotaGate
    ledger: UsageLedger
    responses: StoredResponses  # the Responses API's stored objects (same database as the store)
    batches: StoredBatches  # the Batch API's files, batches and runner lease (same database)
    adapters: AdapterCatalog  # the LoRA adapters a request's `model` may name (same database)


@dataclass
class GatewayState:
    config: GatewayConfig
    tokenizer: GatewayTokenizer
    pool: WorkerPool
    tenancy: Tenancy
    metrics: GatewayMetrics
    tracing: Tracing = field(default_factory=Tracing)  # no exporter: OTel's no-op tracer
    created: int = field(default_factory=lambda: int(time.time()))
    lora: LoraContext | None = None  # --lora-dir and the base model's shapes: adapters may be registered
    draining: bool = False  # set on SIGTERM: new API requests get 503 and /ready is false; in-flight ones finish
