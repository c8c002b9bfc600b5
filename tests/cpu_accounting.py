"""Where a test run's CPU goes, test by test: `python -m pytest -p tests.cpu_accounting --cpu-per-test=DIR`.

The suite is CPU-bound (README "Tests"), so what a test costs is the CPU it makes the machine spend,
not its wall time. Each pytest process (each xdist worker) runs one test at a time and owns the
services it started (its Triton, Redis, PostgreSQL, the stacks and commands a test starts), so
the CPU of its whole process tree over a test's setup, call and teardown is that test's. For each
test a line goes to DIR/<worker>.jsonl: its id, the tree's CPU-seconds, the part of them Triton's
Python-backend stubs spent (inference, mostly), and its wall time. `python -m tests.cpu_accounting
DIR` sums them by directory, file and test.

A process that ends is counted by whoever reaps it (its parent's children's times), so nothing a
test started is lost unless it is re-parented outside the tree (a daemon that double-forks).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STUB_COMMAND_PREFIX = "triton_python_b"  # Triton's Python-backend stub, as /proc/<pid>/stat names it


@dataclass(frozen=True)
class TreeCpu:
    seconds: float
    stub_seconds: float


def tree_cpu() -> TreeCpu:
    """CPU-seconds spent so far by this process and every process below it, including the children
    each of them has reaped."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    spent: dict[int, tuple[float, str]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # ended while we looked
            continue
        command = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        # After the command: state, ppid, ... utime, stime, cutime, cstime (stat(5) fields 14-17).
        pid = int(entry.name)
        children[int(fields[1])].append(pid)
        spent[pid] = (sum(int(value) for value in fields[11:15]) / CLOCK_TICKS, command)
    seconds = stub_seconds = 0.0
    below = list(children.get(os.getpid(), []))
    while below:
        pid = below.pop()
        cpu, command = spent.get(pid, (0.0, ""))
        seconds += cpu
        if command.startswith(STUB_COMMAND_PREFIX):
            stub_seconds += cpu
        below.extend(children.get(pid, []))
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        seconds += usage.ru_utime + usage.ru_stime
    return TreeCpu(seconds, stub_seconds)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-per-test",
        metavar="DIR",
        help="write each test's CPU-seconds (its process tree's) to DIR/<worker>.jsonl",
    )


def pytest_configure(config: pytest.Config) -> None:
    directory = config.getoption("--cpu-per-test")
    if directory:
        config.pluginmanager.register(_Recorder(Path(directory)), "cpu-per-test-recorder")


class _Recorder:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.lines = (directory / f"{worker}.jsonl").open("a")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        before, started = tree_cpu(), time.monotonic()
        yield
        after = tree_cpu()
        record = {
            "test": item.nodeid,
            "cpu_s": round(after.seconds - before.seconds, 3),
            # A stub that ended during the test is counted in its Triton's reaped children instead.
            "stub_cpu_s": round(max(0.0, after.stub_seconds - before.stub_seconds), 3),
            "wall_s": round(time.monotonic() - started, 3),
        }
        self.lines.write(json.dumps(record) + "\n")
        self.lines.flush()


def summary(directory: Path, top: int = 30) -> str:
    records = [
        json.loads(line)
        for path in sorted(directory.glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    total = sum(record["cpu_s"] for record in records)
    stubs = sum(record["stub_cpu_s"] for record in records)
    wall = sum(record["wall_s"] for record in records)
    lines = [
        f"{len(records)} tests: {total:.0f} CPU-s, of which Triton's stubs {stubs:.0f}; wall {wall:.0f} s"
    ]
    for title, key in (
        ("directory", lambda test: "/".join(test.split("::")[0].split("/")[:2])),
        ("file", lambda test: test.split("::")[0]),
        ("test", lambda test: test),
    ):
        sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
        for record in records:
            entry = sums[key(record["test"])]
            entry[0] += record["cpu_s"]
            entry[1] += record["stub_cpu_s"]
            entry[2] += 1
        lines.append(f"\nby {title} (CPU-s, of it stubs, tests):")
        for name, (cpu, stubs, count) in sorted(sums.items(), key=lambda item: -item[1][0])[:top]:
            lines.append(f"{cpu:8.1f} {stubs:7.1f} {count:5d}  {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sum a --cpu-per-test run by directory, file and test.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    print(summary(args.directory, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
