"""The batch runner: a task in every gateway's outer nursery; the one holding the lease (``tenancy.batch_lease``)
runs every tenant's batches, the others wait to take over.

The leader loops: it reads the batches with work left and moves each on (``validating``: copy its input file's
lines in; ``cancelling`` or past its window: stop, finish once its lines in flight are done; out of pending lines:
``finalizing``, then the output and error files and ``completed``), then starts pending lines up to ``in_flight``
at once, round robin over the batches (oldest first), so a large batch does not hold a small one up and the
workers keep room for interactive requests. Each line is a task of the leader's nursery (``gateway.batches.line``);
its result is stored as it ends. It wakes when a line ends, else every ``POLL_S``, which is also how long a batch
created or cancelled on another gateway waits to be seen.

Resuming: a restarted gateway (or another one, once the lease expired) finds the lines without a result and runs
them; lines it had started and not stored run again. The worst case is a line whose result was computed but not
stored (killed between the two): it is computed twice, billed once (only stored results are billed). Stopping: on
SIGTERM the leader starts nothing new, its lines in flight finish within the drain (their results stored), and it
gives the lease up so another gateway takes over at once.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import trio

from gateway.base.errors import APIError, store_unavailable
from gateway.base.principal import Principal
from gateway.batches.jsonl import BatchFileError, parse_batch_file
from gateway.batches.line import Line, LineRunner, Outcome, is_transient
from gateway.batches.objects import failure_line, line_request_id, new_file_id, unrun_line
from gateway.batches.stored import STORE_TIMEOUT_S, StoredBatches
from tenancy.batch_store import BatchRecord, PendingLine, Status, StoredFile
from tenancy.files_store import FileRecord

log = logging.getLogger("kvgate.gateway.batches")

LEASE_TTL_S = 10.0  # a dead leader's batches wait at most this long for another gateway
LEASE_RENEW_S = 3.0
POLL_S = 1.0
REWIND_S = 5.0
CANCEL_GRACE_S = 60.0  # a cancelled batch's lines in flight get this long to finish (their results are kept)
PRINCIPAL_TTL_S = 1.0  # as the authenticator's cache: a revoked key or a suspension applies within it
_EXPIRED = "This request could not be executed before the completion window expired."


class _Marks:
    def __init__(self, stored: StoredBatches, batch_id: str, line: int) -> None:
        self._stored, self._batch_id, self._line = stored, batch_id, line

    async def mark(self) -> bool:
        return await self._stored.mark_attempt(self._batch_id, self._line, time.time())

    async def unmark(self) -> None:
        await self._stored.unmark_attempt(self._batch_id, self._line)


class BatchRunner:
    def __init__(self, stored: StoredBatches, lines: LineRunner,
                 principal_of: Callable[[str, str], Awaitable[Principal]], *, model: str, max_file_lines: int,
                 in_flight: int, draining: Callable[[], bool]) -> None:
        self._stored, self._lines, self._principal_of = stored, lines, principal_of
        self._model, self._max_file_lines, self._cap = model, max_file_lines, in_flight
        self._draining = draining
        self._running: dict[str, dict[int, trio.CancelScope]] = {}  # batch id -> its lines in flight here
        self._cursor: dict[str, int] = {}  # batch id -> the last line started in this leadership
        self._rewind_at: dict[str, float] = {}  # batch id -> when its cursor may go back to its first line
        self._principals: dict[tuple[str, str], tuple[float, Principal | APIError]] = {}
        self._wake = trio.Event()
        self.leading = False

    @property
    def in_flight(self) -> int:
        return sum(len(lines) for lines in self._running.values())

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                if not self._draining() and await self._try_lease():
                    await self._lead()
            except Exception:  # a bug here must not take the gateway (this task's nursery) down with it
                log.exception("the batch runner failed; it starts over")
            await trio.sleep(LEASE_RENEW_S)

    async def _try_lease(self) -> bool:
        try:
            return await self._stored.acquire_lease()
        except APIError:
            return False  # logged by the store call

    async def _lead(self) -> None:
        log.info("this gateway runs the batches", extra={"fields": {"event": "batch_runner_leading",
                                                                    "holder": self._stored.lease.holder}})
        self.leading = True
        self._cursor.clear()
        self._rewind_at.clear()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep_lease, nursery.cancel_scope)
                async with trio.open_nursery() as lines:
                    await self._dispatch(lines)
                nursery.cancel_scope.cancel()  # draining, and every line has ended: stop renewing
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                try:
                    await self._stored.release_lease()
                except APIError:
                    pass  # it expires on its own
            self.leading = False  # only now: whoever sees False may take the lease at once

    async def _keep_lease(self, lead: trio.CancelScope) -> None:
        renewed = trio.current_time()
        while True:
            await trio.sleep(LEASE_RENEW_S)
            try:
                held: bool | None = await self._stored.renew_lease()
            except APIError:
                held = None  # unknown: keep going while the lease surely has not expired yet
            if held:
                renewed = trio.current_time()
            elif held is False or trio.current_time() - renewed >= LEASE_TTL_S - LEASE_RENEW_S:
                # Another gateway may run these batches from now on: stop ours (unstored lines run there again).
                log.warning("the batch runner lease was lost; stopping this gateway's batch lines",
                            extra={"fields": {"event": "batch_runner_lease_lost"}})
                lead.cancel()
                return

    async def _dispatch(self, lines: trio.Nursery) -> None:
        while not self._draining():
            try:
                runnable = [b for b in await self._stored.active() if await self._advance(b)]
                await self._fill(runnable, lines)
            except APIError:
                pass  # the store, logged by its call: the next round tries again
            except Exception:  # a bug with one batch: the lines in flight keep running, the next round retries
                log.exception("batch runner round failed")
            with trio.move_on_after(POLL_S):
                await self._wake.wait()
            self._wake = trio.Event()

    async def _advance(self, b: BatchRecord) -> bool:
        """Moves ``b`` on; True when its pending lines may start now."""
        expired = time.time() >= b.expires_at
        running = self._running.get(b.id, {})
        if b.status == "validating":
            await (self._finish(b, "validating", "expired") if expired else self._start(b))
        elif b.status == "finalizing":
            await self._finish(b, "finalizing", "completed")
        elif b.status == "cancelling":
            if running and time.time() - (b.cancelling_at or 0.0) > CANCEL_GRACE_S:
                for scope in running.values():
                    scope.cancel()  # still waiting (no worker, a rate limit) or still running: cut short
            if not running:
                await self._finish(b, "cancelling", "cancelled")  # its lines in flight were let finish first
        elif b.status == "in_progress" and expired:
            for scope in running.values():
                scope.cancel()  # an expired batch's lines get no more time; they end as expired
            if not running:
                await self._finish(b, "in_progress", "expired")
        return b.status == "in_progress" and not expired

    async def _start(self, b: BatchRecord) -> None:
        """``validating``: the input file's lines become the batch's rows, or the batch fails saying why."""
        content = await self._stored.file_content(b.tenant_id, b.input_file_id)
        if content is None:
            await self._stored.fail(b.id, [{"code": "file_not_found", "param": "input_file_id", "line": None,
                                            "message": f"the input file {b.input_file_id} was deleted before the "
                                                       "batch started"}], time.time())
            return
        try:
            model, rows = await trio.to_thread.run_sync(self._rows, content, b.endpoint)
            if not await self._check_model(b, model, rows[0][0]):
                return  # the adapter registry did not answer (its call logged it): validated again next round
        except BatchFileError as e:
            await self._stored.fail(b.id, [e.as_batch_error()], time.time())
            return
        if await self._stored.start(b.id, rows, time.time()):
            log.info("batch started", extra={"fields": {"event": "batch_started", "batch_id": b.id,
                                                        "tenant_id": b.tenant_id, "lines": len(rows)}})

    def _rows(self, content: bytes, endpoint: str) -> tuple[str, list[tuple[int, str, str]]]:
        """The file's model and its lines as rows. Runs in a thread: the model is resolved after (``_check_model``)."""
        parsed = parse_batch_file(content, self._model, self._max_file_lines)
        if parsed.endpoint != endpoint:
            raise BatchFileError(f"'url' is {parsed.endpoint}, not the batch's endpoint {endpoint}",
                                 parsed.lines[0].line, "mismatched_url")
        return parsed.model, [(line.line, line.custom_id, json.dumps(line.body, separators=(",", ":")))
                              for line in parsed.lines]

    async def _check_model(self, b: BatchRecord, model: str, first_line: int) -> bool:
        """Whether ``model`` is the served model or an adapter the batch's tenant may use, False when the registry
        did not answer; else a ``BatchFileError``: a batch naming no model it could run fails now, not line by
        line, and another tenant's adapter fails exactly as a name nobody registered. Asked here, not in
        ``_rows``'s thread (the registry is async); each line asks again when it runs (adapters come and go)."""
        if model == self._model:
            return True
        try:
            await self._lines.adapter_for(model, b.tenant_id)
        except APIError as e:
            if e.code != "model_not_found":
                return False  # a 503: kept apart from the other batches' round, which goes on
            raise BatchFileError(e.message, first_line, "model_not_found") from None
        return True

    async def _fill(self, runnable: list[BatchRecord], lines: trio.Nursery) -> None:
        free = self._cap - self.in_flight
        if free <= 0:
            return
        queues: list[tuple[BatchRecord, deque[PendingLine]]] = []
        for b in runnable:
            found = await self._stored.pending(b.id, self._cursor.get(b.id, 0), free)
            if found:
                queues.append((b, deque(found)))
            elif not self._running.get(b.id):
                await self._complete_or_rewind(b)
        while free > 0 and queues:  # round robin: every batch gets its turn at the free slots
            for b, queue in queues:
                if free > 0 and queue:
                    self._start_line(lines, b, queue.popleft())
                    free -= 1
            queues = [(b, q) for b, q in queues if q]

    async def _complete_or_rewind(self, b: BatchRecord) -> None:
        if b.id in self._cursor and await self._stored.count_pending(b.id) > 0:
            # Lines passed over (their result could not be stored, their key could not be read): from the top
            # again, but not at once, so a store that keeps failing is not asked in a tight loop.
            if trio.current_time() >= self._rewind_at.get(b.id, 0.0):
                del self._cursor[b.id]
                self._rewind_at[b.id] = trio.current_time() + REWIND_S
            return
        await self._finish(b, "in_progress", "completed")

    def _start_line(self, lines: trio.Nursery, b: BatchRecord, pending: PendingLine) -> None:
        scope = trio.CancelScope()
        self._running.setdefault(b.id, {})[pending.line] = scope
        self._cursor[b.id] = max(self._cursor.get(b.id, 0), pending.line)
        lines.start_soon(self._line_task, b, pending, scope)

    async def _line_task(self, b: BatchRecord, pending: PendingLine, scope: trio.CancelScope) -> None:
        try:
            with scope:
                await self._run_line(b, pending)
        except Exception:  # a bug in one line must not end the runner: the line stays pending
            log.exception("batch %s line %d: unexpected error", b.id, pending.line)
        finally:
            running = self._running.get(b.id, {})
            running.pop(pending.line, None)
            if not running:
                self._running.pop(b.id, None)
            self._wake.set()

    async def _run_line(self, b: BatchRecord, pending: PendingLine) -> None:
        request_id = line_request_id(b.id, pending.line)
        try:
            principal = await self._principal(b)
        except APIError as e:
            if not is_transient(e):  # the key was revoked, the tenant suspended: as a request now would be
                await self._store(b, pending.line, Outcome(failure_line(request_id, pending.custom_id, e), False,
                                                           None, e.status))
            return
        line = Line(request_id, pending.custom_id, pending.body, pending.attempts)
        outcome = await self._lines.run(principal, b.endpoint, line, _Marks(self._stored, b.id, pending.line))
        if outcome is not None:
            await self._store(b, pending.line, outcome)

    async def _store(self, b: BatchRecord, line: int, outcome: Outcome) -> None:
        try:
            await self._stored.put_result(b.id, line, outcome.result, outcome.ok, outcome.usage)
        except APIError:
            pass  # logged by the store call: the line stays pending (unbilled) and runs again

    async def _principal(self, b: BatchRecord) -> Principal:
        key, now = (b.tenant_id, b.key_id), trio.current_time()
        hit = self._principals.get(key)
        if hit is None or hit[0] <= now:
            try:
                with trio.fail_after(STORE_TIMEOUT_S):
                    value: Principal | APIError = await self._principal_of(*key)
            except APIError as e:
                value = e
            except Exception as e:  # noqa: BLE001 - the store: a 503 like every store failure, never cached
                log.error("batch runner: key lookup failed (%s)", type(e).__name__)
                raise store_unavailable("the response store is unavailable; retry the request") from None
            if len(self._principals) > 1024:
                self._principals.clear()
            hit = self._principals[key] = (now + PRINCIPAL_TTL_S, value)
        if isinstance(hit[1], APIError):
            raise hit[1]
        return hit[1]

    async def _finish(self, b: BatchRecord, expected: Status, final: Status) -> None:
        now = time.time()
        if expected == "in_progress":
            if not await self._stored.set_finalizing(b.id, now):
                return
            expected = "finalizing"
        out: list[str] = []
        err: list[str] = []
        unrun = 0  # an expired batch's lines that never ran: failed, in its error file (a cancelled one omits them)
        for r in await self._stored.results(b.id):
            if r.result is not None:
                (out if r.ok else err).append(r.result)
            elif final == "expired":
                err.append(unrun_line(line_request_id(b.id, r.line), r.custom_id, "batch_expired", _EXPIRED))
                unrun += 1
        self._cursor.pop(b.id, None)
        self._rewind_at.pop(b.id, None)
        output, error = await trio.to_thread.run_sync(lambda: (_file(b, "output", out, now),
                                                                _file(b, "error", err, now)))
        if await self._stored.finish(b.id, expected, final, now, output, error, unrun):
            log.info("batch finished", extra={"fields": {
                "event": "batch_finished", "batch_id": b.id, "tenant_id": b.tenant_id, "status": final,
                "completed": len(out), "failed": len(err)}})


def _file(b: BatchRecord, kind: str, lines: list[str], now: float) -> StoredFile | None:
    if not lines:
        return None
    content = ("\n".join(lines) + "\n").encode()
    return FileRecord(new_file_id(), b.tenant_id, now, f"{b.id}_{kind}.jsonl", "batch_output", len(content),
                      len(lines), None), content
