"""One Triton replica against two: the shipped server's throughput, and how the calls split.

Run: `make bench-replicas` (or `.venv/bin/python bench/replicas.py [--shape "16 x 8"] [--rounds 2]
[--seconds 10]`). Starts the stack bench/configs.py measures (Triton A, both redis-servers,
SQLite) and a second Triton B on the same model repository, then `manage.py serve --workers 1`
with TRITON_SERVER_URL naming A alone, or A and B (a list: gRPC's round_robin with outlier
detection, embeddings/triton/client.py), in turn, round after round. Each cell: embeddings/s and
p50/p99 (wrk), and each replica's model executions and rows from its own statistics. On a machine
without a GPU both Tritons share the same cores, so two replicas cannot be faster than one here:
what the cell shows is the split. Writes bench/results/replicas.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from api import REAL_MODEL, bench_triton, shipped_stack  # noqa: E402
from configs import shape_named, start_server, triton_counts  # noqa: E402
from peers import shape_texts, wrk_shape  # noqa: E402


def main() -> None:
    from embeddings.tooling.triton_server import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=shape_named, default=shape_named("16 x 8"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "replicas.json")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    cells: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="embedsite-replicas-") as tmp:
        workdir = Path(tmp)
        second_dir = workdir / "second"
        second_dir.mkdir()
        second = bench_triton(second_dir)
        second.start()
        try:
            with shipped_stack(workdir) as (env, key, first):
                second.wait_until_ready(300)
                replicas = {"A": first, "B": second}
                configs = {
                    "one replica": first.grpc_target,
                    "two replicas": f"{first.grpc_target},{second.grpc_target}",
                }
                headers = {"Authorization": f"Bearer {key}"}
                body = {"model": REAL_MODEL, "input": shape_texts(args.shape), "encoding_format": "base64"}
                for round_number in range(1, args.rounds + 1):
                    for name, target in configs.items():
                        server = start_server({**env, "TRITON_SERVER_URL": target}, free_port())
                        try:
                            before = {r: triton_counts(t.http_url) for r, t in replicas.items()}
                            cell = wrk_shape(
                                f"{server.url}/v1/embeddings",
                                body,
                                headers,
                                args.shape,
                                args.seconds,
                                workdir,
                            )
                            after = {r: triton_counts(t.http_url) for r, t in replicas.items()}
                        finally:
                            server.stop()
                        for replica in replicas:
                            cell[f"executions_{replica}"] = (
                                after[replica]["executions"] - before[replica]["executions"]
                            )
                            cell[f"rows_{replica}"] = after[replica]["rows"] - before[replica]["rows"]
                        cell.update(config=name, shape=args.shape.name, round=round_number)
                        cells.append(cell)
                        print(row(cell), flush=True)
        finally:
            second.stop()
    print(
        f"\n{'config':<14} {'round':>5} {'emb/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'exec A':>8} {'exec B':>8}"
    )
    for cell in cells:
        print(row(cell))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(cells, indent=2) + "\n")


def row(cell: dict) -> str:
    return (
        f"{cell['config']:<14} {cell['round']:>5} {cell['emb_per_s']:>8.0f} {cell['p50_ms']:>8.1f} "
        f"{cell['p99_ms']:>8.1f} {cell['executions_A']:>8.0f} {cell['executions_B']:>8.0f}"
    )


if __name__ == "__main__":
    main()
