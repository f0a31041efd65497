"""Which gateway runs batches: one lease row in the store (holder, expiry), renewed by its holder and taken over by
any gateway once it has expired.

Several gateways on one database must not run the same lines at once (each would compute them; the store keeps
only the first result, but the work is wasted), so one of them leads. The lease is a row, not a database lock, so
it works the same on SQLite and PostgreSQL and survives connection pools: a holder that dies stops renewing and the
others take over after ``ttl_s``. Taking it is one conditional UPDATE; PostgreSQL re-checks the condition after a
concurrent writer commits, and SQLite writes one at a time, so two gateways never both win. Expiry compares wall
clocks of different hosts: their skew must stay well under ``ttl_s`` (NTP keeps it to milliseconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tenancy.db_backend import Backend

LEASE_NAME = "batch-runner"


class BatchLease:
    def __init__(self, backend: Backend, holder: str, ttl_s: float, *, clock: Callable[[], float] = time.time) -> None:
        if not ttl_s > 0:
            raise ValueError(f"the lease must last > 0 s, got {ttl_s}")
        self._db = backend
        self.holder = holder
        self.ttl_s = ttl_s
        self._clock = clock

    def current(self) -> tuple[str, float] | None:
        """(holder, expires_at) of the lease, or None before anyone took it."""
        rows = self._db.read("SELECT holder, expires_at FROM batch_lease WHERE name = ?", (LEASE_NAME,))
        return (rows[0][0], float(rows[0][1])) if rows else None

    def acquire(self) -> bool:
        """Take the lease (free, expired, or already ours) until now + ttl_s; True while this holder has it."""
        now = self._clock()
        held = self.current()
        if held is not None and held[0] != self.holder and held[1] >= now:
            return False  # a live holder: the others poll with a read and never queue on the write lock
        with self._db.write() as tx:
            tx.execute("INSERT INTO batch_lease (name, holder, expires_at) VALUES (?, ?, ?) "
                       "ON CONFLICT (name) DO NOTHING", (LEASE_NAME, self.holder, now + self.ttl_s))
            return tx.execute("UPDATE batch_lease SET holder = ?, expires_at = ? WHERE name = ? AND "
                              "(holder = ? OR expires_at < ?)",
                              (self.holder, now + self.ttl_s, LEASE_NAME, self.holder, now)) == 1

    def renew(self) -> bool:
        """Extend the lease this holder leads under; False once it was released or taken over.

        Unlike ``acquire`` it never revives a released lease (``expires_at = 0``): a renewal abandoned past its
        deadline may still commit after its holder's ``release`` (the thread runs on), and must not hold the lease
        for another ttl_s against the gateway that should take over now. An expired but untaken lease is still
        extended: nobody else can have run under it."""
        with self._db.write() as tx:
            return tx.execute("UPDATE batch_lease SET expires_at = ? WHERE name = ? AND holder = ? AND expires_at > 0",
                              (self._clock() + self.ttl_s, LEASE_NAME, self.holder)) == 1

    def release(self) -> None:
        """Let another gateway take over at once (a clean shutdown) instead of after the ttl."""
        with self._db.write() as tx:
            tx.execute("UPDATE batch_lease SET expires_at = 0 WHERE name = ? AND holder = ?",
                       (LEASE_NAME, self.holder))
