"""Admission: which API requests of this process run now, which wait and which are refused, decided
from the request head alone and shared fairly across tenants.

The HTTP edge (embedsite/edge.py) asks `arrive` before a request's task starts. At most
ADMISSION_MAX_IN_FLIGHT API requests run at once in a process; beyond that a request waits, costing
no task, no body read past 64 KiB, no quota script and no tokenisation. Each time one ends, the next
to start is the longest-waiting request of the tenant with the fewest requests running, so a tenant
with a thousand connections gets the room the others leave and nothing more, and a tenant that
sends one request now and then starts at the next free slot.

A request that has waited ADMISSION_QUEUE_TIMEOUT_S is refused (429, Retry-After); with
ADMISSION_MAX_QUEUED waiting, a newcomer takes the place of the newest waiter of the tenant with the
most waiting (that waiter is refused), or is refused itself if that tenant is its own. With a queue
timeout of 0 nothing waits: a request that finds no room is refused at once.

The tenant is read from the head: the `Authorization` key, hashed as the authenticator hashes it,
looked up among the keys this process has already verified (embeddings/api/authentication.py's
cache, expired entries included: this only orders requests, authentication still decides). A key
this process has not verified, a wrong one or none count as one more tenant, UNVERIFIED, so made-up
keys share one queue. Health, readiness and metrics are never held: probes must answer under load.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import secrets
import time
from collections import deque
from collections.abc import Hashable

from django.conf import settings

from embeddings.api.authentication import caller_cache
from embeddings.metrics import ADMISSION_WAIT_SECONDS, ADMISSION_WAITING
from embeddings.observability.context import SANE_REQUEST_ID
from embedsite.edge import Refusal, RefusalLog

UNVERIFIED = "unverified"
# API paths whose requests are admitted here; the probes among them are never held.
PROBE_PREFIXES = ("/health", "/ready", "/metrics")
RETRY_AFTER_S = 1
REFUSAL_ID_PREFIX = secrets.token_hex(10).encode()


def tenant_of(headers: list[tuple[bytes, bytes]]) -> Hashable:
    """The tenant a request's key belongs to, as far as this process knows it without a query."""
    for name, value in headers:
        if name == b"authorization":
            _, _, key = value.partition(b" ")
            tenant_id = caller_cache.tenant_id_for(hashlib.sha256(key.strip()).hexdigest())
            return UNVERIFIED if tenant_id is None else tenant_id
    return UNVERIFIED


class Ticket:
    """One request's place: waiting, admitted (running) or refused."""

    __slots__ = ("admitted", "headers", "owner", "queued_at", "refusal", "request_id", "tenant", "timer")

    def __init__(self, tenant: Hashable, owner, headers) -> None:
        self.tenant = tenant
        self.owner = owner
        self.headers = headers
        self.admitted = False
        self.refusal: Refusal | None = None
        # The refusal's X-Request-Id: the client's if sane, else a fresh one (as every answer has).
        self.request_id: bytes | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.queued_at = 0.0

    @property
    def waiting(self) -> bool:
        return not self.admitted and self.refusal is None


class AdmissionController:
    """Per process, used from its event loop only (no lock). See the module docstring."""

    def __init__(self, *, max_in_flight: int, queue_timeout_s: float, max_queued: int) -> None:
        self.max_in_flight = max_in_flight
        self.queue_timeout_s = queue_timeout_s
        self.max_queued = max_queued
        self.in_flight = 0
        self.running: dict[Hashable, int] = {}
        # Per tenant, oldest first; a ticket that left (refused, withdrawn) stays until it is reached.
        self.queues: dict[Hashable, deque[Ticket]] = {}
        self.waiting: dict[Hashable, int] = {}
        self.queued = 0
        self.refusals = RefusalLog("Requests refused for load")
        self.refusals.prepare(("no_room", "queue_full", "waited_too_long"))
        self.refusal_ids = itertools.count()
        retry = f"retry after {RETRY_AFTER_S} s."
        self.no_room = self._refusal(
            "no_room", f"This server is running its maximum of {max_in_flight} requests; {retry}"
        )
        self.queue_full = self._refusal(
            "queue_full",
            f"This server is running its maximum of {max_in_flight} requests and holds as many waiting "
            f"as it may ({max_queued}); {retry}",
        )
        self.waited_too_long = self._refusal(
            "waited_too_long",
            f"This request waited {queue_timeout_s:g} s for one of this server's {max_in_flight} request "
            f"slots; {retry}",
        )

    def arrive(self, scope: dict, owner) -> Ticket | None:
        path = scope["path"]
        if not path.startswith(settings.API_PATH_PREFIXES) or path.startswith(PROBE_PREFIXES):
            return None
        ticket = Ticket(tenant_of(scope["headers"]), owner, scope["headers"])
        if self.in_flight < self.max_in_flight and not self.queued:
            self._start(ticket)
            return ticket
        if self.queue_timeout_s <= 0:
            self._refuse(ticket, self.no_room)
            return ticket
        if self.queued >= self.max_queued:
            longest = max(self.waiting, key=self.waiting.__getitem__, default=None)
            if longest is None or self.waiting[longest] <= self.waiting.get(ticket.tenant, 0) + 1:
                self._refuse(ticket, self.queue_full)
                return ticket
            displaced = self._pop_newest(longest)
            self._refuse(displaced, self.queue_full)
            displaced.owner.refused(displaced)
        self._enqueue(ticket)
        return ticket

    def release(self, ticket: Ticket) -> None:
        self.in_flight -= 1
        remaining = self.running[ticket.tenant] - 1
        if remaining:
            self.running[ticket.tenant] = remaining
        else:
            del self.running[ticket.tenant]
        while self.queued and self.in_flight < self.max_in_flight:
            chosen = self._pop_next()
            ADMISSION_WAIT_SECONDS.observe(time.monotonic() - chosen.queued_at)
            self._start(chosen)
            chosen.owner.admitted(chosen)

    def withdraw(self, ticket: Ticket) -> None:
        if ticket.waiting:
            ticket.refusal = GONE
            self._left_queue(ticket)

    # --- The queue ---------------------------------------------------------------------------------

    def _start(self, ticket: Ticket) -> None:
        ticket.admitted = True
        self.in_flight += 1
        self.running[ticket.tenant] = self.running.get(ticket.tenant, 0) + 1

    def _enqueue(self, ticket: Ticket) -> None:
        ticket.queued_at = time.monotonic()
        ticket.timer = asyncio.get_running_loop().call_later(self.queue_timeout_s, self._expire, ticket)
        self.queues.setdefault(ticket.tenant, deque()).append(ticket)
        self.waiting[ticket.tenant] = self.waiting.get(ticket.tenant, 0) + 1
        self.queued += 1
        ADMISSION_WAITING.inc()

    def _left_queue(self, ticket: Ticket) -> None:
        """Count out a ticket that is no longer waiting (it stays in its deque until reached)."""
        if ticket.timer is not None:
            ticket.timer.cancel()
            ticket.timer = None
        self.queued -= 1
        ADMISSION_WAITING.dec()
        left = self.waiting[ticket.tenant] - 1
        if left:
            self.waiting[ticket.tenant] = left
        else:
            del self.waiting[ticket.tenant]
            del self.queues[ticket.tenant]

    def _pop_next(self) -> Ticket:
        """The oldest waiter of the tenant with the fewest requests running (then the longest wait)."""
        tenant = min(self.waiting, key=lambda t: (self.running.get(t, 0), self._oldest(t).queued_at))
        queue = self.queues[tenant]
        while not queue[0].waiting:
            queue.popleft()
        ticket = queue.popleft()
        self._left_queue(ticket)
        return ticket

    def _oldest(self, tenant: Hashable) -> Ticket:
        queue = self.queues[tenant]
        while not queue[0].waiting:
            queue.popleft()
        return queue[0]

    def _pop_newest(self, tenant: Hashable) -> Ticket:
        queue = self.queues[tenant]
        while not queue[-1].waiting:
            queue.pop()
        ticket = queue.pop()
        self._left_queue(ticket)
        return ticket

    def _expire(self, ticket: Ticket) -> None:
        ticket.timer = None
        if not ticket.waiting:
            return
        self._left_queue(ticket)
        self._refuse(ticket, self.waited_too_long)
        ticket.owner.refused(ticket)

    # --- Refusals ----------------------------------------------------------------------------------

    @staticmethod
    def _refusal(reason: str, message: str) -> Refusal:
        return Refusal(
            429,
            "rate_limit_exceeded",
            message,
            reason,
            headers=((b"retry-after", str(RETRY_AFTER_S).encode()),),
            error_type="rate_limit_error",
        )

    def _refuse(self, ticket: Ticket, refusal: Refusal) -> None:
        ticket.refusal = refusal
        sent = _header(ticket.headers, b"x-request-id")
        if sent is not None and SANE_REQUEST_ID.fullmatch(sent):
            ticket.request_id = sent.encode()
        else:
            # Unique without a uuid4's system call (a quarter of a refusal's cost): this process's
            # random prefix and a count.
            ticket.request_id = b"%s%012x" % (REFUSAL_ID_PREFIX, next(self.refusal_ids))
        self.refusals.add(refusal.reason)


# A withdrawn ticket's marker: it is no longer waiting. Never sent: its client has gone.
GONE = Refusal(400, "client_closed_request", "The client closed the connection while waiting.", "gone")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def admission_controller() -> AdmissionController:
    """This process's controller, from settings (the edge makes one per worker process)."""
    return AdmissionController(
        max_in_flight=settings.ADMISSION_MAX_IN_FLIGHT,
        queue_timeout_s=settings.ADMISSION_QUEUE_TIMEOUT_S,
        max_queued=settings.ADMISSION_MAX_QUEUED,
    )
