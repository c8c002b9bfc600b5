"""The supervisor's policy on fake children and a clock the test moves: start order, restart after a
delay that doubles while a child keeps dying fast and starts over once it stayed up, giving up with
the child's name and log, a child that never gets ready, the stop order. runstack's real children
are tests/management/test_runstack.py's."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass

import pytest

from embeddings.tooling.supervision import Child, RestartPolicy, StackFailed, Supervisor
from tests.clocks import ManualClock

POLICY = RestartPolicy(first_delay_s=0.5, max_delay_s=4.0, stable_s=60.0, attempts=5)


class FakeChild(Child):
    """Runs from start() until the test calls die(); ready as soon as `becomes_ready` says."""

    def __init__(self, name: str, events: list[tuple[str, str]], tmp_path) -> None:
        self.name = name
        self.events = events
        self.log_path = tmp_path / f"{name}.log"
        self.log_path.write_text(f"{name} line 1\n{name}: Address already in use\n")
        self.status: int | None = None
        self.becomes_ready = True

    def start(self) -> None:
        self.status = None
        self.events.append(("start", self.name))

    def exit_status(self) -> int | None:
        return self.status

    def ready(self) -> bool:
        return self.becomes_ready

    def end_remains(self) -> None:
        self.events.append(("end_remains", self.name))

    def stop(self) -> None:
        self.events.append(("stop", self.name))

    def die(self, status: int = -signal.SIGKILL) -> None:
        self.status = status


@dataclass
class Stack:
    """Three fake children started by a supervisor; what it did (events) and said since."""

    supervisor: Supervisor
    clock: ManualClock
    events: list[tuple[str, str]]
    said: list[str]
    warned: list[str]
    redis: FakeChild
    triton: FakeChild
    web: FakeChild

    def tick(self, after_s: float = 0.0) -> None:
        self.clock.advance(after_s)
        self.supervisor.tick()

    def restart_delays(self, child: FakeChild, *, deaths: int, up_s: float = 1.0) -> list[float]:
        """Kill `child` `deaths` times, each `up_s` after its (re)start: the delay before each restart."""
        delays = []
        for _ in range(deaths):
            self.clock.advance(up_s)
            child.die()
            self.tick()
            died_at = self.clock.now
            while self.events[-1] != ("start", child.name):
                self.tick(0.25)
            delays.append(self.clock.now - died_at)
        return delays


@pytest.fixture
def stack(tmp_path) -> Stack:
    events: list[tuple[str, str]] = []
    said: list[str] = []
    warned: list[str] = []
    clock = ManualClock()
    redis, triton, web = (FakeChild(name, events, tmp_path) for name in ("redis", "triton", "web"))
    supervisor = Supervisor([redis, triton, web], POLICY, say=said.append, warn=warned.append, clock=clock)
    assert supervisor.start_all(threading.Event(), poll_s=0)
    events.clear()
    return Stack(supervisor, clock, events, said, warned, redis, triton, web)


def test_each_child_starts_once_the_one_before_is_ready(tmp_path):
    events = []
    first, second = FakeChild("first", events, tmp_path), FakeChild("second", events, tmp_path)
    first.becomes_ready = False
    clock = ManualClock()
    supervisor = Supervisor([first, second], POLICY, say=lambda _: None, warn=lambda _: None, clock=clock)
    waits = []

    class Stop(threading.Event):
        def wait(self, timeout=None):
            waits.append(list(events))
            first.becomes_ready = True
            return False

    assert supervisor.start_all(Stop(), poll_s=0.1)
    assert waits == [[("start", "first")]]
    assert events == [("start", "first"), ("start", "second")]


def test_a_dead_child_is_cleaned_up_then_restarted_after_the_delay_and_said_back(stack):
    stack.clock.advance(100)
    stack.triton.die()
    stack.tick()
    assert stack.events == [("end_remains", "triton")]
    assert stack.warned == [
        f"Triton was killed by SIGKILL after 100.0 s up (log: {stack.triton.log_path}); restarting it in "
        "0.5 s (death 1 in a row; the stack gives up at 6)"
    ]
    stack.tick(0.4)
    assert stack.events == [("end_remains", "triton")]
    stack.tick(0.1)
    assert stack.events[-1] == ("start", "triton")
    assert stack.said[-1] == f"Restarting triton (log: {stack.triton.log_path}) ..."
    stack.triton.becomes_ready = False
    stack.tick(3)
    stack.triton.becomes_ready = True
    stack.tick(1)
    assert stack.said[-1] == "Triton is back: ready 4.0 s after its restart, 4.5 s after it died"
    assert {name for _, name in stack.events} == {"triton"}  # the others untouched


def test_the_delay_doubles_while_a_child_dies_fast_up_to_the_most(stack):
    assert stack.restart_delays(stack.redis, deaths=5) == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert "death 5 in a row" in stack.warned[-1]


def test_a_child_that_stayed_up_starts_from_the_first_delay_again(stack):
    assert stack.restart_delays(stack.redis, deaths=3) == [0.5, 1.0, 2.0]
    assert stack.restart_delays(stack.redis, deaths=1, up_s=POLICY.stable_s) == [0.5]


def test_dying_fast_once_too_often_gives_up_naming_the_child_and_its_log(stack):
    stack.restart_delays(stack.redis, deaths=POLICY.attempts)
    stack.clock.advance(1)
    stack.redis.die(1)
    with pytest.raises(StackFailed) as failed:
        stack.tick()
    assert str(failed.value) == (
        f"Redis exited with status 1, 6 times in a row within 60 s of its start: giving up; see "
        f"{stack.redis.log_path}. Its last lines:\nredis line 1\nredis: Address already in use"
    )
    assert stack.events[-1] == ("end_remains", "redis")


def test_a_restart_that_is_not_ready_in_time_is_stopped_and_counts_as_a_death(stack):
    stack.web.startup_timeout_s = 30
    stack.restart_delays(stack.web, deaths=1)
    stack.web.becomes_ready = False
    stack.tick(31)
    assert stack.events[-2:] == [("stop", "web"), ("end_remains", "web")]
    assert stack.warned[-1].startswith("Web was not ready within 30 s after 31.0 s up")
    assert "restarting it in 1 s (death 2 in a row" in stack.warned[-1]


def test_a_child_that_fails_at_the_first_start_stops_the_start(tmp_path):
    events = []
    good, bad = FakeChild("good", events, tmp_path), FakeChild("bad", events, tmp_path)
    bad.becomes_ready = False
    supervisor = Supervisor([good, bad], POLICY, say=lambda _: None, warn=lambda _: None, clock=ManualClock())

    class DiesAtOnce(threading.Event):
        def wait(self, timeout=None):
            bad.die(2)
            return False

    with pytest.raises(StackFailed, match=rf"^Bad exited with status 2 while starting; see {bad.log_path}"):
        supervisor.start_all(DiesAtOnce(), poll_s=0.1)
    stopping = threading.Event()
    stopping.set()
    assert not Supervisor([bad], POLICY, say=print, warn=print, clock=ManualClock()).start_all(
        stopping, poll_s=0.1
    )


def test_everything_stops_in_reverse_order_and_a_pending_restart_never_happens(stack):
    stack.triton.die()
    stack.tick()
    stack.supervisor.stop_all()
    stack.tick(10)
    assert stack.events == [
        ("end_remains", "triton"),
        ("stop", "web"),
        ("stop", "triton"),
        ("stop", "redis"),
    ]


def test_the_policy_doubles_from_the_first_delay_and_stops_at_the_most():
    assert [POLICY.delay_s(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_with_restarts_off_the_first_death_stops_the_stack(tmp_path):
    events = []
    child = FakeChild("beat", events, tmp_path)
    clock = ManualClock()
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=4.0, stable_s=60.0, attempts=0)
    supervisor = Supervisor([child], policy, say=lambda _: None, warn=lambda _: None, clock=clock)
    assert supervisor.start_all(threading.Event(), poll_s=0)
    clock.advance(600)
    child.die(1)
    with pytest.raises(
        StackFailed, match=r"^Beat exited with status 1 after 600.0 s up, and restarts are off; see"
    ):
        supervisor.tick()
    assert events[-1] == ("end_remains", "beat")
