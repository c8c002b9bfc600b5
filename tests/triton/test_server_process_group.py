"""The Triton launcher ends Triton's whole process group (tritonserver and its Python backend stubs,
hundreds of MB each) and their shared memory: on a normal stop, and on its own after `kill -9` of
tritonserver, in the middle of a request, and with stubs that hang. Real Triton, each test its own."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from django.conf import settings

from embeddings.tooling.triton_server import TritonServer, shared_memory_regions
from embeddings.triton import TritonClient, TritonUnavailable
from tests.conftest import TEST_MODEL_REPOSITORY, require_exported_model, start_triton
from tests.processes import proc_stats

# A deadline against hanging (zombies wait for init to reap them), never a timing.
REAP_DEADLINE_S = 30


def group_processes(pgid: int) -> dict[int, str]:
    """pid -> state of every process in group `pgid`, zombies included (read here from /proc, not
    with the launcher's own helper)."""
    return {process.pid: process.state for process in proc_stats() if process.pgrp == pgid}


def stubs_of(pgid: int) -> list[int]:
    return [
        pid
        for pid, state in group_processes(pgid).items()
        if state != "Z" and Path(f"/proc/{pid}/comm").read_text().startswith("triton_python_b")
    ]


def assert_nothing_left(pgid: int, regions: set[str]) -> None:
    """No live process of the group; the group itself gone once init reaps the stubs; no region."""
    live = {pid: state for pid, state in group_processes(pgid).items() if state != "Z"}
    assert live == {}, f"processes of Triton's group left: {live}"
    deadline = time.monotonic() + REAP_DEADLINE_S
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"group {pgid} still has zombies: {group_processes(pgid)}"
        time.sleep(0.1)
    assert [name for name in regions if Path("/dev/shm", name).exists()] == []


def mapped_shared_memory(pids: list[int]) -> set[str]:
    """Every file of /dev/shm these processes have mapped (read here from /proc, not with the
    launcher's own helper, whose pattern once missed our backends' regions)."""
    names = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            names.update(line.split("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line)
    return names


def running(server: TritonServer) -> tuple[int, list[int], set[str]]:
    """The group id, the stubs and their shared-memory regions of a started server (which has some),
    every one of which the launcher knows to remove."""
    pgid = server.process_group
    assert pgid is not None and os.getpgid(pgid) == pgid
    stubs = stubs_of(pgid)
    regions = mapped_shared_memory([pgid, *stubs])
    assert stubs and regions, group_processes(pgid)
    assert shared_memory_regions([pgid, *stubs]) == regions
    return pgid, stubs, regions


@pytest.fixture
def shipped_repository() -> Path:
    repository = Path(settings.TRITON_MODEL_REPOSITORY)
    require_exported_model(repository)
    return repository


@pytest.mark.parametrize("timeout_s", [None, 0], ids=["graceful", "at-once"])
def test_a_normal_stop_leaves_no_process_and_no_shared_memory(tmp_path, shipped_repository, timeout_s):
    """Graceful (Triton unloads its models, its stubs remove their regions) or at once (SIGKILL, as
    the tests' teardowns stop theirs: the regions are removed for the stubs)."""
    server = start_triton(tmp_path, [shipped_repository])
    try:
        pgid, _, regions = running(server)
        # MiniLM's stub, of our ONNX backend, has a region named after it.
        assert any(name.startswith("triton_embedsite_onnx_backend_shm_region_") for name in regions), regions
    finally:
        server.stop(timeout_s=timeout_s)
    assert server.process is None
    assert_nothing_left(pgid, regions)


def wait_until_no_live_member(pgid: int) -> None:
    deadline = time.monotonic() + REAP_DEADLINE_S
    while live := {pid: state for pid, state in group_processes(pgid).items() if state != "Z"}:
        assert time.monotonic() < deadline, f"processes of Triton's group left: {live}"
        time.sleep(0.1)


def test_kill_9_of_tritonserver_leaves_no_stub(tmp_path, shipped_repository):
    """The crash the issue saw (stubs outlived a killed tritonserver): the launcher notices on its own,
    with no call to stop(), and ends the rest of the group."""
    server = start_triton(tmp_path, [shipped_repository, TEST_MODEL_REPOSITORY])
    try:
        pgid, _, regions = running(server)
        os.kill(pgid, signal.SIGKILL)
        wait_until_no_live_member(pgid)
        assert server.process.poll() == -signal.SIGKILL
    finally:
        server.stop()
    assert_nothing_left(pgid, regions)


def test_a_kill_in_the_middle_of_a_request_leaves_nothing(tmp_path):
    # The stub busy in slow_echo's execute() outlives SIGTERM once tritonserver is gone (most runs):
    # it is SIGKILLed after the grace period, which the test need not wait out for 15 s.
    server = start_triton(tmp_path, [TEST_MODEL_REPOSITORY], stop_timeout_s=2)
    outcome: list[BaseException] = []

    started = tmp_path / "slow_echo-started"

    def slow_call() -> None:
        try:
            with TritonClient(server.grpc_target, timeout_s=120, retries=0) as client:
                inputs = {
                    "sleep_ms": np.array([60_000], np.int64),
                    "value": np.ones((1, 2), np.float32),
                    "started_path": np.array([str(started).encode()], dtype=object),
                }
                client.infer("slow_echo", inputs)
        except BaseException as error:  # handed over to the test's thread
            outcome.append(error)

    caller = threading.Thread(target=slow_call)
    try:
        pgid, _, regions = running(server)
        caller.start()
        # The call sits in slow_echo's execute(), in a stub, once the model has made this file.
        deadline = time.monotonic() + 60  # against hanging, not a timing
        while not started.exists():
            assert caller.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.05)
        server.kill()  # SIGKILL tritonserver, then the launcher ends the rest
    finally:
        server.stop()
        caller.join(30)
    assert_nothing_left(pgid, regions)
    assert not caller.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], TritonUnavailable), outcome


def test_a_hung_stub_is_killed_and_its_shared_memory_removed(tmp_path):
    """Stubs that cannot act on SIGTERM (stopped here with SIGSTOP) when tritonserver crashes get
    SIGKILL after the grace period; a SIGKILLed stub cannot remove its /dev/shm region, so the
    launcher does."""
    server = start_triton(tmp_path, [TEST_MODEL_REPOSITORY], stop_timeout_s=2)
    try:
        pgid, stubs, regions = running(server)
        for stub in stubs:
            os.kill(stub, signal.SIGSTOP)
        os.kill(pgid, signal.SIGKILL)
        wait_until_no_live_member(pgid)
    finally:
        server.stop()
    assert_nothing_left(pgid, regions)
