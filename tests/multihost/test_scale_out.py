"""Scale-out across hosts: PostgreSQL and Redis, two Tritons, two web servers, two workers and a
client, each on a host of its own (Linux network namespaces on one bridge, tests/netns.py), run by
tests/multihost/scenario.py inside the client host. Failover, rejoin, exactly-once jobs and exact
quotas, with the figures printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.multihost.scenario import ANSWERED_WHILE_CUT_OFF
from tests.netns import Network
from tests.processes import REPO_ROOT

HOSTS = {
    "db": 10, "triton-a": 21, "triton-b": 22, "web-a": 31, "web-b": 32, "worker-a": 41, "worker-b": 42,
    "client": 50,
}  # fmt: skip


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> dict:
    if os.geteuid() != 0:
        pytest.fail("the multi-host test makes network namespaces: it needs root (CI runs as root)")
    workdir = tmp_path_factory.mktemp("multihost")
    started = time.monotonic()
    with Network(f"es{os.getpid() % 100000}") as network:
        for name, number in HOSTS.items():
            network.add(name, number)
        network.describe(workdir / "network.json")
        env = {name: value for name, value in os.environ.items() if name != "PROMETHEUS_MULTIPROC_DIR"}
        made = time.monotonic()
        done = subprocess.run(
            network.hosts["client"].command(
                sys.executable, "tests/multihost/scenario.py", "--network", str(workdir / "network.json"),
                "--workdir", str(workdir), "--out", str(workdir / "result.json"),
            ),
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
        ran = time.monotonic()
    if done.returncode != 0:
        logs = "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-2500:]}"
            for path in sorted(workdir.glob("*.log"))
        )
        pytest.fail(
            f"the scenario failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}\n{logs}"
        )
    result = json.loads((workdir / "result.json").read_text())
    steps = ", ".join(f"{step} {seconds:g}" for step, seconds in result["steps"])
    print(
        f"\nmulti-host scenario: hosts made in {made - started:.1f} s, ran {ran - made:.0f} s ({steps}), "
        f"hosts removed in {time.monotonic() - ran:.1f} s"
    )
    return result


def test_quotas_are_exact_across_two_web_hosts(scenario):
    statuses = scenario["quota"]["statuses"]
    assert statuses.count(200) == scenario["quota"]["burst"] and set(statuses) == {200, 429}, statuses


def test_a_triton_host_that_drops_every_packet_costs_no_request_and_rejoins(scenario):
    failover = scenario["failover"]
    drop_at, restore_at = failover["drop_at"], failover["restore_at"]
    answers = failover["answers"]
    failed = [answer for answer in answers if answer[3] != 200]
    during = [answer for answer in answers if drop_at < answer[0] and answer[1] < restore_at]
    samples = failover["samples"]
    after = [(at, count) for at, count in samples if at > restore_at and count is not None]
    rejoined = next((at for at, count in after if after and count >= after[0][1] + 3), None)
    answered_each_second = [0] * (int(max(answer[1] for answer in answers)) + 1)
    for answer in answers:
        answered_each_second[int(answer[1])] += 1
    print(
        f"\nfailover: {len(answers)} requests, {len(failed)} failed; answered each second (triton-b cut off "
        f"from {drop_at:g} s to {restore_at:g} s): {answered_each_second}; slowest answer sent while cut "
        f"off {max((a[1] - a[0] for a in during), default=0):.2f} s; triton-b readable again "
        f"{after[0][0] - restore_at if after else float('nan'):.2f} s after its link came back, taking calls "
        f"{rejoined - restore_at if rejoined else float('nan'):.2f} s after"
    )
    assert not failed, failed[:10]
    assert len(during) >= ANSWERED_WHILE_CUT_OFF, "requests kept being answered while the replica was cut off"
    # triton-b's executions, read directly: none readable while cut off, growing again after.
    assert all(count is None for at, count in samples if drop_at + 1 < at < restore_at)
    assert after, "triton-b never answered again"
    assert rejoined is not None, f"triton-b took no calls after it came back: {after}"


def test_the_fair_share_between_tenants_holds_across_worker_hosts(scenario):
    """As tests/test_job_tasks.py's one-worker test, with a worker on each of two hosts: while the
    small job waits, only the big job's chunks already queued start (JOB_CHUNKS_IN_FLIGHT, and
    one more per worker that started as the small job was committed); without fair share most of
    its 40 would."""
    fair = scenario["fair_share"]
    meanwhile = fair["big_started_meanwhile"]
    print(f"\nfair share: {len(meanwhile)} of the big job's 40 chunks started while the small job waited")
    assert (fair["big_chunks"], fair["small_chunks"]) == (40, 2)
    assert len(meanwhile) <= fair["chunks_in_flight"] + 2, fair
    assert all(lines > 0 for lines in fair["worker_chunk_lines"].values()), fair["worker_chunk_lines"]


def test_a_worker_killed_mid_job_leaves_every_input_done_exactly_once(scenario):
    worker = scenario["worker"]
    total = worker["total"]
    assert worker["status"] == "completed" and worker["counts"]["completed"] == total, worker["counts"]
    assert worker["indexes"] == list(range(total))
    victim = str(worker["victim_chunk"])
    assert worker["runs"][victim] == (1 if worker["victim_done_before_kill"] else 2), worker["runs"]
    assert all(runs == 1 for chunk, runs in worker["runs"].items() if chunk != victim), worker["runs"]
    usage = worker["usage"]
    assert (usage["inputs"], usage["tokens"]) == (total, worker["prompt_tokens"]), usage


def test_a_web_host_killed_leaves_the_other_serving(scenario):
    web = scenario["web"]
    killed_at, bases = web["killed_at"], web["bases"]
    survivor = [a for a in web["answers"] if a[2] == bases["web-b"]]
    victim_after = [a for a in web["answers"] if a[2] == bases["web-a"] and a[0] > killed_at + 0.5]
    assert survivor and all(a[3] == 200 for a in survivor), [a for a in survivor if a[3] != 200][:5]
    assert len([a for a in survivor if a[0] > killed_at]) > 10
    assert victim_after and all(a[3] == 0 for a in victim_after)
