"""Keeping a stack of child processes running, as a process manager does (runstack's children).

Each child is started in order, the next once the one before is ready. Then `Supervisor.tick()` looks
at every child: one that died has what it left behind ended (its process group, its files), and is
started again after a delay that doubles while it keeps dying soon after its start; one that stayed
up `stable_s` starts from the first delay again. A child that dies `attempts + 1` times in a row, each
time within `stable_s` of its start, makes the supervisor give up (`StackFailed`, naming the child
and its log): the next try would not go better (a port taken, a broken configuration), and a loop of
restarts would hide it. Each death and restart is said, with the exit status or signal, the child's
log and the delay.

Nothing here waits long: a tick polls and returns, so a child that restarts slowly (Triton loading
its models) keeps no other from being watched. The caller's thread is the only one that starts or
stops children (runstack calls tick() from its main thread).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from embeddings.errors import EmbedsiteError


class StackFailed(EmbedsiteError, RuntimeError):
    """A child could not be started, or kept dying: the stack stops."""


@dataclass(frozen=True)
class RestartPolicy:
    """first_delay_s doubles after each death in a row, up to max_delay_s; a child up stable_s before
    it died starts from first_delay_s again; after `attempts` restarts in a row that did not stay up
    stable_s, the next death gives up."""

    first_delay_s: float
    max_delay_s: float
    stable_s: float
    attempts: int

    def delay_s(self, deaths_in_a_row: int) -> float:
        return min(self.first_delay_s * 2 ** (deaths_in_a_row - 1), self.max_delay_s)


class Child:
    """One process (and what it started) that the supervisor keeps running. Subclasses say how to
    start it, whether it is ready, what to clean up after it died, and how to stop it."""

    name: str  # as a sentence names it: "Triton", "Redis (critical)", "the Celery worker"
    log_path: Path | None = None  # None: its output is the supervisor's own
    startup_timeout_s: float = 60.0

    def start(self) -> None:
        raise NotImplementedError

    def exit_status(self) -> int | None:
        """Its exit status (-N: killed by signal N) once it has exited; None while it runs."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether it serves yet; asked after each start until it does, so it must answer at once."""
        return True

    def end_remains(self) -> None:
        """After it died, before it starts again: end what it left (a process group, stubs, files)."""

    def stop(self) -> None:
        raise NotImplementedError

    def starting_line(self) -> str | None:
        """What to say as the stack starts it, when it may take a while (None: nothing)."""
        return None

    def ready_line(self) -> str | None:
        """What to say once it is ready at the stack's start (None: nothing)."""
        return None

    @property
    def log(self) -> str:
        return str(self.log_path) if self.log_path is not None else "runstack's own output"

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def how_it_ended(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


@dataclass
class Watched:
    """A child and what the supervisor knows of it (times on the supervisor's clock)."""

    child: Child
    started_at: float = 0.0
    ready: bool = False
    died_at: float | None = None
    restart_at: float | None = None
    deaths_in_a_row: int = 0


class Supervisor:
    """Starts `children` in order, keeps them running (tick), stops them in reverse order."""

    def __init__(
        self,
        children: Sequence[Child],
        policy: RestartPolicy,
        *,
        say: Callable[[str], None],
        warn: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.watched = [Watched(child) for child in children]
        self.policy = policy
        self.say = say
        self.warn = warn
        self.clock = clock
        self.stopping = False

    def start_all(self, stop: threading.Event, poll_s: float) -> bool:
        """Each child started once the one before is ready; False when `stop` was set meanwhile.
        A child that exits or is not ready in time stops the start (StackFailed): at the first start
        a failure is a configuration to fix, not a crash to retry."""
        for watched in self.watched:
            child = watched.child
            line = child.starting_line()
            if line:
                self.say(line)
            self._start(watched)
            while not child.ready():
                status = child.exit_status()
                if status is not None:
                    raise StackFailed(self._failure(child, f"{how_it_ended(status)} while starting"))
                if self.clock() - watched.started_at > child.startup_timeout_s:
                    child.stop()
                    raise StackFailed(
                        self._failure(child, f"was not ready within {child.startup_timeout_s:g} s")
                    )
                if stop.wait(poll_s):
                    return False
            watched.ready = True
            line = child.ready_line()
            if line:
                self.say(line)
        return True

    def tick(self) -> None:
        """Look at every child once: restart those whose delay is over, notice those that died or
        came back. Raises StackFailed when one has died too often in a row. Once stopping, nothing."""
        if self.stopping:
            return
        for watched in self.watched:
            child = watched.child
            now = self.clock()
            if watched.restart_at is not None:
                if now >= watched.restart_at:
                    watched.restart_at = None
                    self.say(f"Restarting {child.name} (log: {child.log}) ...")
                    self._start(watched)
                continue
            status = child.exit_status()
            if status is not None:
                self._died(watched, how_it_ended(status))
            elif not watched.ready:
                if child.ready():
                    watched.ready = True
                    self.say(
                        f"{_capitalised(child.name)} is back: ready {now - watched.started_at:.1f} s "
                        f"after its restart, {now - watched.died_at:.1f} s after it died"
                    )
                elif now - watched.started_at > child.startup_timeout_s:
                    child.stop()
                    self._died(watched, f"was not ready within {child.startup_timeout_s:g} s")

    def stop_all(self) -> None:
        """Every child stopped, the last started first (the web server before what it uses); none is
        restarted after."""
        self.stopping = True
        for watched in reversed(self.watched):
            watched.child.stop()

    def _start(self, watched: Watched) -> None:
        watched.ready = False
        watched.started_at = self.clock()
        watched.child.start()

    def _died(self, watched: Watched, how: str) -> None:
        """Say it, end what it left, then schedule its restart, or give up (StackFailed)."""
        child = watched.child
        watched.died_at = now = self.clock()
        up_s = now - watched.started_at
        deaths = watched.deaths_in_a_row = watched.deaths_in_a_row + 1 if up_s < self.policy.stable_s else 1
        giving_up = deaths > self.policy.attempts
        delay_s = self.policy.delay_s(deaths)
        name, attempts, stable_s = _capitalised(child.name), self.policy.attempts, self.policy.stable_s
        if not giving_up:
            self.warn(
                f"{name} {how} after {up_s:.1f} s up (log: {child.log}); restarting it in {delay_s:g} s "
                f"(death {deaths} in a row; the stack gives up at {attempts + 1})"
            )
        child.end_remains()
        if giving_up and attempts == 0:
            raise StackFailed(self._failure(child, f"{how} after {up_s:.1f} s up, and restarts are off"))
        if giving_up:
            raise StackFailed(
                self._failure(
                    child, f"{how}, {deaths} times in a row within {stable_s:g} s of its start: giving up"
                )
            )
        watched.ready = False
        # Counted from when its remains are gone (Triton's hung stubs take up to their stop timeout).
        watched.restart_at = self.clock() + delay_s

    @staticmethod
    def _failure(child: Child, what: str) -> str:
        tail = child.log_tail()
        return f"{_capitalised(child.name)} {what}; see {child.log}" + (
            f". Its last lines:\n{tail}" if tail else ""
        )


def _capitalised(name: str) -> str:
    return name[:1].upper() + name[1:]
