"""Compare configurations of the shipped server on the peer benchmark's load shapes, in one run.

Run: `.venv/bin/python bench/configs.py --config base= --config merge=COALESCE_REQUESTS=true
[--shape "32 x 1"] [--rounds 2] [--seconds 10]`. Each `--config NAME=VAR=VALUE,VAR=VALUE` is the
environment given to `manage.py serve --workers 1` on top of the stack bench/peers.py measures
(Triton, both redis-servers, SQLite, quotas on unless a config says QUOTAS_ENABLED=false);
`BENCH_ASGI_SERVER=granian` in a config serves the same application with granian instead
(`pip install granian` first: measured, not shipped); `BENCH_TREE=REF` serves a commit's tree
(a git worktree under .run/bench/, as bench/overload.py's baseline), to measure a change against
what it changed in one run. The
configurations are measured in turn, round after round (A B A B), so a drift of the machine's load
reaches each alike; each cell reports embeddings/s, p50/p99, the web process's CPU per request and
what Triton did for it (requests, executions, rows per execution, queue and compute time), read
from Triton's statistics before and after. This is the tool that found where a request's time goes
(bench/notes/); bench/peers.py is the table in README.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from api import REAL_MODEL, RootServer, Server, baseline_checkout, shipped_stack  # noqa: E402
from peers import SHAPES, Shape, probe, shape_texts, wrk_shape  # noqa: E402
from triton_stats import triton_counts, triton_delta  # noqa: E402

# Where py-spy's collapsed stacks go, one file per cell (--py-spy); None: not profiled.
PROFILE_DIR: Path | None = None
SERVER_CHOICE = "BENCH_ASGI_SERVER"
# A config that sets it serves from that commit (a git worktree under .run/bench/) or directory.
TREE_CHOICE = "BENCH_TREE"
WARM_UP_REQUESTS = 3


class GranianServer(Server):
    """embedsite.asgi:application under granian (one worker), for comparison with uvicorn."""

    own_process_group = True

    def command(self, port: int) -> list[str]:
        return [str(Path(sys.executable).parent / "granian"), "--interface", "asgi", "--host", "127.0.0.1",
                "--port", str(port), "--workers", "1", "--loop", "uvloop", "--no-ws",
                "embedsite.asgi:application"]  # fmt: skip

    def cpu_seconds(self) -> float:
        """CPU of granian's whole process group (it serves from a worker process)."""
        total = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.process.pid:  # the process group
                total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


def start_server(env: dict[str, str], port: int):
    if env.get(SERVER_CHOICE, "uvicorn") == "granian":
        return GranianServer(env, port)
    if TREE_CHOICE in env:
        return RootServer(env, port, baseline_checkout(env[TREE_CHOICE]))
    return Server(env, port)


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """'merge=COALESCE_REQUESTS=true,COALESCE_MAX_CALLS=2' -> ('merge', {...}); 'base=' -> ('base', {})."""
    name, separator, assignments = text.partition("=")
    if not name or not separator:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VAR=VALUE[,VAR=VALUE...] or NAME=")
    env = {}
    for assignment in filter(None, assignments.split(",")):
        variable, equals, value = assignment.partition("=")
        if not variable or not equals:
            raise argparse.ArgumentTypeError(f"{assignment!r}: expected VAR=VALUE")
        env[variable] = value
    return name, env


def shape_named(name: str) -> Shape:
    for shape in SHAPES:
        if shape.name == name:
            return shape
    raise argparse.ArgumentTypeError(f"{name!r}: one of {', '.join(s.name for s in SHAPES)}")


def format_table(cells: list[dict]) -> str:
    header = (
        "| config | shape | round | emb/s | p50 ms | p99 ms | web CPU ms/request | Triton requests | "
        "rows/execution | queue ms/request | compute ms/execution |"
    )
    lines = [header, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for cell in cells:
        lines.append(
            f"| {cell['config']} | {cell['shape']} | {cell['round']} | {cell['emb_per_s']:.0f} | "
            f"{cell['p50_ms']:.0f} | {cell['p99_ms']:.0f} | {cell['web_cpu_ms_per_request']:.2f} | "
            f"{cell['triton_requests']:.0f} | {cell['rows_per_execution']:.1f} | "
            f"{cell['queue_ms_per_request']:.1f} | {cell['compute_infer_ms_per_execution']:.1f} |"
        )
    return "\n".join(lines)


def start_profiler(pid: int, seconds: float, path: Path) -> subprocess.Popen:
    """py-spy sampling the server while wrk runs: collapsed stacks (one line per stack and count)."""
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--duration",
         str(max(1, int(seconds) - 1)), "--rate", "200", "--nonblocking", "--format", "raw",
         "--output", str(path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def measure_cell(server, shape: Shape, headers: dict, triton_http: str, seconds: float, workdir: Path):
    body = {"model": REAL_MODEL, "input": shape_texts(shape), "encoding_format": "base64"}
    # A fresh server's first requests load the tokenizer, the catalog and the key (~0.1 ms of each
    # request's CPU over a 10 s cell): not what a request costs, so not measured.
    for _ in range(WARM_UP_REQUESTS):
        probe(f"{server.url}/v1/embeddings", body, headers)
    cpu_before, stats_before = server.cpu_seconds(), triton_counts(triton_http)
    profiler = None
    if PROFILE_DIR is not None:
        path = PROFILE_DIR / f"{server.name}-{shape.name.replace(' ', '')}.txt"
        profiler = start_profiler(server.process.pid, seconds, path)
    cell = wrk_shape(f"{server.url}/v1/embeddings", body, headers, shape, seconds, workdir)
    if profiler is not None:
        profiler.wait(timeout=60)
    cpu = server.cpu_seconds() - cpu_before
    cell.update(triton_delta(stats_before, triton_counts(triton_http)))
    # The probe request before wrk is in the CPU and Triton figures too.
    cell["web_cpu_ms_per_request"] = cpu * 1000 / (cell["requests"] + 1)
    return cell


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=parse_config, action="append", required=True,
                        help="NAME=VAR=VALUE[,VAR=VALUE...]; NAME= for the defaults")  # fmt: skip
    parser.add_argument("--shape", type=shape_named, action="append",
                        help="a load shape of bench/peers.py (default: all)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per cell")
    parser.add_argument("--py-spy", type=Path, dest="py_spy",
                        help="py-spy stacks of the server, a file per cell, here")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "configs.json")
    args = parser.parse_args(argv)
    args.shape = args.shape or list(SHAPES)
    return args


def main() -> None:
    from embeddings.tooling.triton_server import free_port

    args = parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    global PROFILE_DIR
    if args.py_spy is not None:
        args.py_spy.mkdir(parents=True, exist_ok=True)
        PROFILE_DIR = args.py_spy
    cells: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="embedsite-configs-") as tmp:
        workdir = Path(tmp)
        with shipped_stack(workdir) as (env, key, triton):
            headers = {"Authorization": f"Bearer {key}"}
            triton_http = triton.http_url
            for round_number in range(1, args.rounds + 1):
                for name, overrides in args.config:
                    server = start_server({**env, **overrides}, free_port())
                    server.name = f"{name}-r{round_number}"
                    try:
                        for shape in args.shape:
                            cell = measure_cell(server, shape, headers, triton_http, args.seconds, workdir)
                            cell.update(config=name, shape=shape.name, round=round_number)
                            cells.append(cell)
                            print(format_table([cell]).splitlines()[-1], flush=True)
                    finally:
                        server.stop()
    print(format_table(cells))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(cells, indent=2) + "\n")


if __name__ == "__main__":
    main()
