"""The drills, in the issue's order. Each module holds one drill or a few that share their shape."""

from __future__ import annotations

from chaos.drills.base import Drill
from chaos.drills.bad_input import BadInput
from chaos.drills.batch_interactive import BatchInteractive
from chaos.drills.batch_kills import BatchKills
from chaos.drills.disconnect_storm import DisconnectStorm
from chaos.drills.gateway_kill import GatewayKill
from chaos.drills.hostile_schemas import HostileSchemas
from chaos.drills.lora_churn import LoraChurn
from chaos.drills.overload import Overload
from chaos.drills.redis_outage import RedisOutage
from chaos.drills.rolling_restart import RollingRestart
from chaos.drills.slow_readers import SlowReaders
from chaos.drills.slow_steps import SlowSteps
from chaos.drills.stalled_streams import StalledStreams
from chaos.drills.store_trouble import StoreTrouble
from chaos.drills.worker_faults import WorkerFreeze, WorkerKill
from chaos.drills.worker_hijack import WorkerHijack


def all_drills() -> list[Drill]:
    # Issue 24's drills (hostile-schemas, stalled-streams, worker-hijack) follow the first issue's eleven, then
    # issue 26's (batch-interactive, batch-kills), then issue 25's (lora-churn).
    return [WorkerKill(), WorkerFreeze(), SlowSteps(), DisconnectStorm(), Overload(), SlowReaders(), RedisOutage(),
            StoreTrouble(), GatewayKill(), BadInput(), RollingRestart(), HostileSchemas(),
            StalledStreams(), WorkerHijack(), BatchInteractive(), BatchKills(), LoraChurn()]


def by_name() -> dict[str, Drill]:
    return {d.name: d for d in all_drills()}
