"""Admission (embeddings/api/admission.py): at most N API requests run per process, the rest wait
fairly across tenants or are refused from their head alone.

Unit tests drive the controller with made-up owners; the rest go through the real server on a
socket (`edge_server`: 4 running, 8 waiting at most 2 s), holding its slots with requests whose
bodies trickle in, so who runs next is decided by the test, not by timing."""

from __future__ import annotations

import asyncio
import hashlib
import selectors
import socket
import threading
import time
from contextlib import ExitStack, closing

import httpx2
import orjson
import pytest

from embeddings.api.admission import PROBE_PREFIXES, UNVERIFIED, AdmissionController, tenant_of
from embeddings.api.authentication import caller_cache
from embeddings.callers import Caller, QuotaLimitValues
from tests.api.conftest import EDGE_LIMITS, LiveServer
from tests.api.raw_http import connect, error_code, head, read_answer
from tests.processes import manage_commands

MAX_IN_FLIGHT = int(EDGE_LIMITS["ADMISSION_MAX_IN_FLIGHT"])
MAX_QUEUED = int(EDGE_LIMITS["ADMISSION_MAX_QUEUED"])
QUEUE_TIMEOUT_S = float(EDGE_LIMITS["ADMISSION_QUEUE_TIMEOUT_S"])
LATE_S = 1.5


# --- The controller ---------------------------------------------------------------------------------


class Owner:
    """What the edge is to the controller: told when its waiting request is admitted or refused."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.events: list[str] = []

    def admitted(self, ticket) -> None:
        self.events.append("admitted")

    def refused(self, ticket) -> None:
        self.events.append(f"refused:{ticket.refusal.reason}")


def scope(tenant: str, path: str = "/v1/embeddings") -> dict:
    return {"path": path, "headers": [(b"authorization", f"Bearer {tenant}".encode())]}


@pytest.fixture
def tenants(monkeypatch):
    """Keys named "a", "b", "c" are known to belong to tenants 1, 2, 3 (as verified keys are)."""
    known = {hashlib.sha256(name.encode()).hexdigest(): number for number, name in enumerate("abc", 1)}
    monkeypatch.setattr(caller_cache, "tenant_id_for", known.get)


def controller(*, max_in_flight=2, queue_timeout_s=10.0, max_queued=4) -> AdmissionController:
    return AdmissionController(
        max_in_flight=max_in_flight, queue_timeout_s=queue_timeout_s, max_queued=max_queued
    )


async def test_requests_beyond_the_limit_wait_and_the_least_served_tenant_goes_next(tenants):
    gate = controller(max_in_flight=2)
    running = [gate.arrive(scope("a"), Owner("a1")), gate.arrive(scope("a"), Owner("a2"))]
    assert all(ticket.admitted for ticket in running)
    waiting_a = [Owner("a3"), Owner("a4")]
    tickets_a = [gate.arrive(scope("a"), owner) for owner in waiting_a]
    late_b = Owner("b1")
    ticket_b = gate.arrive(scope("b"), late_b)
    assert all(ticket.waiting for ticket in [*tickets_a, ticket_b])
    # b arrived last but runs nothing: it goes first, then a's in the order they came.
    gate.release(running[0])
    assert (late_b.events, waiting_a[0].events) == (["admitted"], [])
    gate.release(running[1])
    assert (waiting_a[0].events, waiting_a[1].events) == (["admitted"], [])
    gate.release(ticket_b)
    assert waiting_a[1].events == ["admitted"]
    assert gate.in_flight == 2 and gate.queued == 0


async def test_a_full_queue_takes_the_newest_place_of_the_tenant_with_most_waiting(tenants):
    gate = controller(max_in_flight=1, max_queued=3)
    gate.arrive(scope("a"), Owner("running"))
    owners_a = [Owner(f"a{index}") for index in range(3)]
    for owner in owners_a:
        gate.arrive(scope("a"), owner)
    # a's own newcomer finds a's queue the longest: refused itself.
    own = gate.arrive(scope("a"), Owner("a-late"))
    assert own.refusal.reason == "queue_full" and own.refusal.status == 429
    # b's newcomer takes a's newest place.
    ticket_b = gate.arrive(scope("b"), Owner("b"))
    assert ticket_b.waiting
    assert [owner.events for owner in owners_a] == [[], [], ["refused:queue_full"]]
    # c's newcomer: a has 2 waiting, b 1, c 0; a loses again (2 > 0 + 1).
    ticket_c = gate.arrive(scope("c"), Owner("c"))
    assert ticket_c.waiting and owners_a[1].events == ["refused:queue_full"]
    # Now a 1, b 1, c 1: any newcomer is refused itself.
    assert gate.arrive(scope("b"), Owner("b2")).refusal.reason == "queue_full"
    assert gate.queued == 3


async def test_a_waiter_is_refused_after_the_queue_timeout_and_a_withdrawn_one_is_forgotten(tenants):
    gate = controller(max_in_flight=1, queue_timeout_s=0.05)
    running = gate.arrive(scope("a"), Owner("running"))
    patient, gone = Owner("patient"), Owner("gone")
    gate.arrive(scope("a"), patient)
    ticket_gone = gate.arrive(scope("b"), gone)
    gate.withdraw(ticket_gone)
    assert gate.queued == 1
    await asyncio.sleep(0.2)
    assert patient.events == ["refused:waited_too_long"]
    assert gone.events == [] and gate.queued == 0
    gate.release(running)
    assert gate.in_flight == 0 and gate.running == {} and gate.queues == {}


async def test_with_no_queue_timeout_nothing_waits(tenants):
    gate = controller(max_in_flight=1, queue_timeout_s=0)
    assert gate.arrive(scope("a"), Owner("first")).admitted
    refused = gate.arrive(scope("b"), Owner("second"))
    assert refused.refusal.reason == "no_room"
    answer = refused.refusal.response([], request_id=refused.request_id, close=False, head_only=False)
    assert answer.startswith(b"HTTP/1.1 429 Too Many Requests\r\n")
    assert b"\r\nretry-after: 1\r\n" in answer and refused.request_id
    assert b"\r\nx-request-id: " + refused.request_id + b"\r\n" in answer
    assert orjson.loads(refused.refusal.body())["error"]["code"] == "rate_limit_exceeded"


async def test_probes_and_pages_are_never_held(tenants):
    gate = controller(max_in_flight=1, queue_timeout_s=0)
    gate.arrive(scope("a"), Owner("holding the only slot"))
    for path in ("/health", "/ready", "/metrics", "/admin/login/", "/explorer/", "/static/x.css"):
        assert gate.arrive(scope("a", path), Owner(path)) is None, path


def test_every_api_route_takes_the_api_handler_and_admission(settings):
    """A route outside API_PATH_PREFIXES would run Django's whole middleware stack and never wait
    for admission: every route of embeddings/api/urls.py must start with one (/v2/rerank, TEI's
    /rerank once did not)."""
    from embeddings.api.urls import urlpatterns

    for pattern in urlpatterns:
        route = "/" + str(pattern.pattern)
        assert route.startswith(settings.API_PATH_PREFIXES), route
        assert not route.startswith(PROBE_PREFIXES), route


def test_the_tenant_is_read_from_keys_this_process_verified(monkeypatch):
    caller = Caller(
        tenant_id=7, tenant_slug="seven", key_id=1, key_public_id="x", allow_all_models=True,
        allowed_model_ids=frozenset(), expires_at=None, tenant_limits=QuotaLimitValues(),
        key_limits=QuotaLimitValues(),
    )  # fmt: skip
    key = "emb_abc_secret"
    digest = hashlib.sha256(key.encode()).hexdigest()
    monkeypatch.setattr(caller_cache, "entries", {digest: (0.0, caller)})  # expired: still sorts
    assert tenant_of([(b"authorization", f"Bearer {key}".encode())]) == 7
    assert tenant_of([(b"authorization", b"Bearer emb_abc_other")]) == UNVERIFIED
    assert tenant_of([(b"authorization", b"garbage")]) == UNVERIFIED
    assert tenant_of([]) == UNVERIFIED


# --- Through the real server ---------------------------------------------------------------------

HOLD_BODY = orjson.dumps({"model": "all-MiniLM-L6-v2", "input": "holding a slot"})
SHORT_BODY = orjson.dumps({"model": "all-MiniLM-L6-v2", "input": "a short question"})


def post(key: str, body: bytes = SHORT_BODY) -> bytes:
    return head(
        "POST", "/v1/embeddings", f"Authorization: Bearer {key}", "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ) + body  # fmt: skip


class Holder:
    """A request that holds an admission slot: its head and then its body one byte every 0.3 s
    (within the body idle timeout), until `finish` sends the rest."""

    def __init__(self, server: LiveServer, key: str) -> None:
        self.sock = connect(server)
        self.sock.sendall(post(key, HOLD_BODY)[: -len(HOLD_BODY)] + HOLD_BODY[:1])
        self.sent = 1
        self.finishing = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.trickle, daemon=True)
        self.thread.start()

    def trickle(self) -> None:
        while not self.finishing.wait(0.3):
            with self.lock:
                if self.sent < len(HOLD_BODY) - 1:
                    self.sock.sendall(HOLD_BODY[self.sent : self.sent + 1])
                    self.sent += 1

    def finish(self) -> int:
        self.finishing.set()
        with self.lock:
            self.sock.sendall(HOLD_BODY[self.sent :])
        return read_answer(self.sock)[0]

    def close(self) -> None:
        self.finishing.set()
        self.sock.close()


def hold_every_slot(stack: ExitStack, server: LiveServer, key: str) -> list[Holder]:
    holders = [Holder(server, key) for _ in range(MAX_IN_FLIGHT)]
    for holder in holders:
        stack.callback(holder.close)
    time.sleep(0.3)  # all admitted, reading their bodies
    return holders


@pytest.fixture(scope="module")
def second_key(edge_server) -> str:
    """A key of a second tenant on the edge server, verified once so its process knows whose it is."""
    _, key = manage_commands(
        edge_server.env,
        ("create_tenant", "--name", "Second", "--slug", "second"),
        ("create_api_key", "--tenant", "second"),
    )
    for tenant_key in (key, edge_server.api_key):
        response = httpx2.post(
            f"{edge_server.base_url}/v1/embeddings", content=SHORT_BODY, timeout=60,
            headers={"Authorization": f"Bearer {tenant_key}", "Content-Type": "application/json"},
        )  # fmt: skip
        assert response.status_code == 200, response.text
    return key


def first_answers(sockets: list[socket.socket], *, timeout_s: float) -> list[socket.socket]:
    """`sockets` in the order their answers began to arrive."""
    order: list[socket.socket] = []
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while len(order) < len(sockets) and time.monotonic() < deadline:
            for key, _ in selector.select(deadline - time.monotonic()):
                order.append(key.fileobj)
                selector.unregister(key.fileobj)
    return order


def test_a_flooding_tenant_waits_behind_its_own_requests_and_another_tenant_goes_first(
    edge_server, second_key
):
    with ExitStack() as stack:
        holders = hold_every_slot(stack, edge_server, edge_server.api_key)
        waiters = [stack.enter_context(closing(connect(edge_server))) for _ in range(MAX_QUEUED)]
        for sock in waiters:
            sock.sendall(post(edge_server.api_key))
        time.sleep(0.3)
        # The queue is full of the first tenant's requests: its next one is refused at once, from
        # its head, and its connection stays open (the small body is read and dropped).
        extra = stack.enter_context(closing(connect(edge_server)))
        refused_ids = []
        for _ in range(2):
            started = time.monotonic()
            extra.sendall(post(edge_server.api_key))
            status, headers, body = read_answer(extra)
            assert (status, error_code(body)) == (429, "rate_limit_exceeded"), body
            assert headers["retry-after"] == "1" and headers["x-request-id"]
            assert time.monotonic() - started < 0.5
            refused_ids.append(headers["x-request-id"])
        # Probes are never held.
        assert httpx2.get(f"{edge_server.base_url}/ready", timeout=5).status_code in (200, 503)
        assert httpx2.get(f"{edge_server.base_url}/health", timeout=5).status_code == 200
        # The second tenant's request takes the newest waiter's place (refused) ...
        other = stack.enter_context(closing(connect(edge_server)))
        other.sendall(post(second_key))
        status, _, body = read_answer(waiters[-1])
        assert (status, error_code(body)) == (429, "rate_limit_exceeded")
        # ... and runs as soon as a slot frees, before the seven that waited longer: the freed slot
        # serves it, then them one after the other, oldest first.
        assert holders[0].finish() == 200
        queued = [other, *waiters[:-1]]
        assert first_answers(queued, timeout_s=QUEUE_TIMEOUT_S) == queued
        assert [read_answer(sock)[0] for sock in queued] == [200] * MAX_QUEUED
        for holder in holders[1:]:
            assert holder.finish() == 200
    # No line per refusal (a flood must not become a flood of log lines): counted and summarised.
    log = edge_server.log_path.read_text()
    assert not [request_id for request_id in refused_ids if request_id in log]


def test_a_request_that_waits_too_long_is_refused(edge_server, second_key):
    with ExitStack() as stack:
        holders = hold_every_slot(stack, edge_server, second_key)
        waiter = stack.enter_context(closing(connect(edge_server)))
        started = time.monotonic()
        waiter.sendall(post(edge_server.api_key))
        status, _, body = read_answer(waiter)
        waited = time.monotonic() - started
        assert (status, error_code(body)) == (429, "rate_limit_exceeded")
        assert "waited" in orjson.loads(body)["error"]["message"]
        assert QUEUE_TIMEOUT_S - 0.1 <= waited <= QUEUE_TIMEOUT_S + LATE_S, waited
        assert [holder.finish() for holder in holders] == [200] * MAX_IN_FLIGHT


def test_a_client_that_leaves_while_waiting_loses_its_place(edge_server, second_key):
    with ExitStack() as stack:
        holders = hold_every_slot(stack, edge_server, second_key)
        leaving = connect(edge_server)
        leaving.sendall(post(edge_server.api_key))
        staying = stack.enter_context(closing(connect(edge_server)))
        staying.sendall(post(edge_server.api_key))
        time.sleep(0.2)
        leaving.close()
        time.sleep(0.2)
        assert holders[0].finish() == 200
        assert read_answer(staying)[0] == 200
        for holder in holders[1:]:
            assert holder.finish() == 200
    metrics = httpx2.get(f"{edge_server.base_url}/metrics", timeout=10).text
    assert "embedsite_admission_waiting 0.0" in metrics
    assert 'embedsite_http_edge_refused_total{reason="queue_full"}' in metrics
