"""Turn bench/gpu.py's JSON into README's GPU tables (Markdown), its findings and the PNG plot.

Run where matplotlib is installed (not on the GPU machine): `.venv/bin/python bench/plot_gpu.py
bench/results/gpu.json [--png docs/bench-gpu.png] [--markdown PATH]`. The Markdown goes to stdout
(and to --markdown): the findings (HTTP against Triton-direct at batch 32, embeddings per web core,
web cores that feed the GPU, each cell's bottleneck), then one table per stage. A run of
`bench/gpu.py --engines` gives the engines' tables instead: how each started and agreed, then their
embeddings/s side by side, Triton direct and HTTP.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A resource counts as the bottleneck when it is this busy.
SATURATED = 0.85
# HTTP that delivers this share of what Triton-direct gives at the same load is limited by Triton.
MATCHES_TRITON = 0.9


def measured(cells: list[dict]) -> list[dict]:
    """The cells that produced figures (not failed, not skipped)."""
    return [cell for cell in cells if "emb_per_s" in cell and "error" not in cell]


def shapes_in_order(cells: list[dict]) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    for cell in cells:
        key = (cell["texts"], cell["shape"])
        if key not in seen:
            seen.append(key)
    return seen


def direct_by_shape(result: dict) -> dict[tuple[str, str], dict]:
    return {(cell["texts"], cell["shape"]): cell for cell in measured(result.get("triton_direct", []))}


def embeddings_per_web_core_s(cell: dict) -> float | None:
    """Embeddings one web core delivers per CPU-second in this cell."""
    per_1000 = cell.get("web_cpu_s_per_1000")
    return 1000 / per_1000 if per_1000 else None


def bottleneck(cell: dict, direct: dict | None, cpu_count: int | None) -> str:
    """Which resource limited an HTTP cell: the GPU, the web processes' cores, the machine's cores
    (web, Triton and wrk share them), or Triton (HTTP as fast as our client straight to Triton)."""
    gpu = cell.get("gpu_util_mean")
    if gpu is not None and gpu >= SATURATED * 100:
        return "GPU"
    web = cell.get("web_cores_busy")
    if web is not None and web >= SATURATED * cell["workers"]:
        return "web CPU"
    machine = cell.get("machine_cores_busy")
    if machine is not None and cpu_count and machine >= SATURATED * cpu_count:
        return "machine CPU"
    if direct is not None and cell["emb_per_s"] >= MATCHES_TRITON * direct["emb_per_s"]:
        return "Triton"
    return "none saturated"


def clean(cell: dict) -> bool:
    """A cell whose answers were (almost) all embeddings: its CPU figures are the cost of serving, not
    of refusing."""
    return cell.get("errors", 0) <= 0.01 * max(cell.get("requests", 0), 1)


def request_kind(cell: dict) -> str:
    return "single text" if cell["batch"] == 1 else f"batch {cell['batch']}"


def findings(result: dict) -> dict:
    """The numbers the issue asks for, from the cells: HTTP against Triton-direct at each batched load
    (best worker count), and per texts and request kind the embeddings one web core delivers per CPU
    second (median over the clean cells) and the web cores that would feed Triton's best rate."""
    direct = direct_by_shape(result)
    http = measured(result.get("http", []))
    found: dict = {"agreement": result.get("agreement", {}), "batched": [], "per_core": []}
    for texts, shape in shapes_in_order(http):
        cells = [cell for cell in http if (cell["texts"], cell["shape"]) == (texts, shape)]
        reference = direct.get((texts, shape))
        if cells[0]["batch"] > 1 and reference and reference["emb_per_s"] > 0:
            best = max(cells, key=lambda cell: cell["emb_per_s"])
            found["batched"].append(
                {"texts": texts, "shape": shape, "http": best["emb_per_s"], "workers": best["workers"],
                 "direct": reference["emb_per_s"], "ratio": best["emb_per_s"] / reference["emb_per_s"]}
            )  # fmt: skip
    groups: dict[tuple[str, str], list[dict]] = {}
    for cell in http:
        groups.setdefault((cell["texts"], request_kind(cell)), []).append(cell)
    for (texts, kind), cells in groups.items():
        per_core = [value for value in map(embeddings_per_web_core_s, filter(clean, cells)) if value]
        if not per_core:
            continue
        core = statistics.median(per_core)
        best_direct = max(
            (
                cell["emb_per_s"]
                for key, cell in direct.items()
                if key[0] == texts and request_kind(cell) == kind
            ),
            default=None,
        )
        best_http = max(filter(clean, cells), key=lambda cell: cell["emb_per_s"])
        found["per_core"].append(
            {"texts": texts, "kind": kind, "emb_per_web_core_s": core, "direct": best_direct,
             "web_cores": best_direct / core if best_direct else None, "best_http": best_http["emb_per_s"],
             "best_http_at": f"{best_http['workers']} workers, {best_http['shape']}"}
        )  # fmt: skip
    return found


def _number(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def findings_markdown(found: dict) -> str:
    lines = []
    agreement = found["agreement"]
    if agreement:
        lines.append(
            f"- Agreement with the float32 ONNX Runtime reference ({agreement.get('texts')} texts): "
            f"min cosine in process {_number(agreement.get('in_process_min_cosine'), 5)}, "
            f"through Triton {_number(agreement.get('triton_min_cosine'), 5)}."
        )
    for row in found["batched"]:
        lines.append(
            f"- {row['texts']} texts, {row['shape']}: HTTP {_number(row['http'])} emb/s "
            f"({row['workers']} workers) = {row['ratio']:.2f} x Triton-direct "
            f"({_number(row['direct'])} emb/s)."
        )
    for row in found["per_core"]:
        feed = (
            f"; {row['web_cores']:.1f} web cores feed Triton's best ({_number(row['direct'])} emb/s)"
            if row["web_cores"]
            else ""
        )
        lines.append(
            f"- {row['texts']} texts, {row['kind']}: {_number(row['emb_per_web_core_s'])} embeddings per "
            f"web-core second (median of the cells without errors){feed}; best HTTP "
            f"{_number(row['best_http'])} emb/s ({row['best_http_at']})."
        )
    return "\n".join(lines)


def in_process_table(result: dict) -> str:
    lines = [
        f"In process ({result.get('in_process_model', '?')}, tokenizer included):",
        "",
        "| texts | batch | emb/s | model only emb/s | p50 ms | p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cell in measured(result.get("in_process", [])):
        lines.append(
            f"| {cell['texts']} | {cell['batch']} | {_number(cell['emb_per_s'])} | "
            f"{_number(cell.get('model_only_emb_per_s'))} | {_number(cell['p50_ms'], 1)} | "
            f"{_number(cell['p99_ms'], 1)} |"
        )
    return "\n".join(lines)


def direct_table(result: dict) -> str:
    lines = [
        "Our gRPC client straight to Triton (clients x texts per request):",
        "",
        "| texts | load | emb/s | p50 ms | p99 ms | errors | GPU % | rows/execution | queue ms | "
        "compute ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cell in measured(result.get("triton_direct", [])):
        lines.append(
            f"| {cell['texts']} | {cell['shape']} | {_number(cell['emb_per_s'])} | "
            f"{_number(cell['p50_ms'], 1)} | {_number(cell['p99_ms'], 1)} | {cell.get('errors', 0)} | "
            f"{_number(cell.get('gpu_util_mean'))} | {_number(cell.get('rows_per_execution'), 1)} | "
            f"{_number(cell.get('queue_ms_per_request'), 1)} | "
            f"{_number(cell.get('compute_infer_ms_per_execution'), 1)} |"
        )
    return "\n".join(lines)


def throughput_table(result: dict) -> str:
    """HTTP emb/s per worker count beside Triton-direct's at the same load."""
    http = measured(result.get("http", []))
    direct = direct_by_shape(result)
    workers = sorted({cell["workers"] for cell in http})
    header = "| texts | load | Triton direct | " + " | ".join(f"HTTP, workers={n}" for n in workers) + " |"
    lines = [
        "Embeddings/s, HTTP service (wrk, base64) against our client straight to Triton:",
        "",
        header,
        "| --- | --- | ---: | " + " | ".join("---:" for _ in workers) + " |",
    ]
    for texts, shape in shapes_in_order(http):
        by_workers = {
            cell["workers"]: cell for cell in http if (cell["texts"], cell["shape"]) == (texts, shape)
        }
        reference = direct.get((texts, shape))
        row = [texts, shape, _number(reference["emb_per_s"]) if reference else "-"]
        row += [_number(by_workers[n]["emb_per_s"]) if n in by_workers else "-" for n in workers]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def http_table(result: dict) -> str:
    cpu_count = result.get("environment", {}).get("cpu_count")
    direct = direct_by_shape(result)
    lines = [
        "Each HTTP cell:",
        "",
        "| texts | load | workers | emb/s | p50 ms | p99 ms | errors | GPU % | web CPU s / 1,000 emb | "
        "web cores busy | machine cores busy | rows/execution | bottleneck |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for cell in measured(result.get("http", [])):
        limit = bottleneck(cell, direct.get((cell["texts"], cell["shape"])), cpu_count)
        lines.append(
            f"| {cell['texts']} | {cell['shape']} | {cell['workers']} | {_number(cell['emb_per_s'])} | "
            f"{_number(cell['p50_ms'], 1)} | {_number(cell['p99_ms'], 1)} | {errors_text(cell)} | "
            f"{_number(cell.get('gpu_util_mean'))} | {_number(cell.get('web_cpu_s_per_1000'), 3)} | "
            f"{_number(cell.get('web_cores_busy'), 1)} | {_number(cell.get('machine_cores_busy'), 1)} | "
            f"{_number(cell.get('rows_per_execution'), 1)} | {limit} |"
        )
    return "\n".join(lines)


def errors_text(cell: dict) -> str:
    """The cell's error count, with the server's refusals by reason when it logged any."""
    refused = cell.get("server_log", {}).get("refused") or {}
    reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(refused.items()))
    return f"{cell.get('errors', 0)} ({reasons})" if reasons else str(cell.get("errors", 0))


def failures(result: dict) -> list[str]:
    lines = [f"- {entry['where']}: {entry['error']}" for entry in result.get("errors", [])]
    for section in ("in_process", "triton_direct", "http"):
        for cell in result.get(section, []):
            if "error" in cell or "skipped" in cell:
                labels = ", ".join(
                    str(cell[key]) for key in ("engine", "texts", "shape", "workers", "batch") if key in cell
                )
                lines.append(f"- {section} ({labels}): {cell.get('error') or cell.get('skipped')}")
    return lines


LOAD_SECONDS = re.compile(
    r"(?P<what>engine built|engine loaded from the cache|loaded and warmed up) in (?P<seconds>[\d.]+) s"
)
TORCH_DEVICE = re.compile(r" on (cuda:\d+|cpu) in (\w+)")


def load_summary(log_lines: list[str]) -> str:
    """What the backend's load lines (one per instance) say: TensorRT engines built and read from the
    cache, CUDA sessions warmed up, each with the instances' longest time; PyTorch's device."""
    longest: dict[str, list[float]] = {}
    devices = set()
    for line in log_lines:
        match = LOAD_SECONDS.search(line)
        if match:
            longest.setdefault(match["what"], []).append(float(match["seconds"]))
        elif TORCH_DEVICE.search(line):
            devices.add("PyTorch on {} in {}".format(*TORCH_DEVICE.search(line).groups()))
    parts = [f"{what} x{len(times)}, up to {max(times):.1f} s" for what, times in longest.items()]
    return "; ".join([*parts, *sorted(devices)])


def engines_summary(result: dict) -> str:
    """Per engine: what served it, how long Triton took to start (a TensorRT build included), how its
    engine loaded, its agreement with the float32 reference and what /v1/models reported."""
    lines = [
        "| engine | configuration | export | Triton start s | loaded | min cosine (Triton) "
        "| /v1/models says |",
        "| --- | --- | --- | ---: | --- | ---: | --- |",
    ]
    for entry in result.get("engines", []):
        export = f"version {entry['version']} ({entry['export_dtype']})" if "version" in entry else "-"
        reported = entry.get("reported_engine")
        said = f"{reported['name']}, {reported['precision']}" if reported else "-"
        loaded = load_summary(entry.get("load_log", [])) or entry.get("error", "-")
        lines.append(
            f"| {entry['engine']} | `{entry['config_name']}` | {export} | "
            f"{_number(entry.get('triton_start_s'), 1)} | {loaded} | "
            f"{_number(entry.get('agreement', {}).get('triton_min_cosine'), 5)} | {said} |"
        )
    return "\n".join(lines)


def engines_table(result: dict) -> str:
    """Embeddings/s (p50 ms) of each engine, through our client straight to Triton and through HTTP
    (its best worker count), per texts and load."""
    engines = [entry["engine"] for entry in result.get("engines", [])]
    direct = {
        (cell["engine"], cell["texts"], cell["shape"]): cell
        for cell in measured(result.get("triton_direct", []))
        if "engine" in cell
    }
    http: dict[tuple[str, str, str], dict] = {}
    for cell in measured(result.get("http", [])):
        key = (cell.get("engine"), cell["texts"], cell["shape"])
        if key[0] is not None and (key not in http or cell["emb_per_s"] > http[key]["emb_per_s"]):
            http[key] = cell
    loads = shapes_in_order(
        [*result.get("triton_direct", []), *result.get("http", [])]  # in the order they ran
    )
    header = "| texts | load | " + " | ".join(f"{name}: Triton | {name}: HTTP" for name in engines) + " |"
    lines = [
        "Embeddings/s (p50 ms) per engine, our client straight to Triton and the HTTP service "
        f"(workers {', '.join(str(n) for n in result.get('options', {}).get('workers', []))}):",
        "",
        header,
        "| --- | --- | " + " | ".join("---: | ---:" for _ in engines) + " |",
    ]

    def figure(cell: dict | None) -> str:
        if cell is None:
            return "-"
        return f"{_number(cell['emb_per_s'])} ({_number(cell.get('p50_ms'), 1)})"

    for texts, shape in loads:
        row = [texts, shape]
        for name in engines:
            row += [figure(direct.get((name, texts, shape))), figure(http.get((name, texts, shape)))]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def engines_markdown(result: dict) -> str:
    environment = result.get("environment", {})
    gpus = ", ".join(environment.get("gpus") or []) or "no GPU"
    parts = [
        f"GPU engines measured on {gpus}, {environment.get('cpu_count')} CPUs, onnxruntime "
        f"{environment.get('onnxruntime')}, torch {environment.get('torch')}, "
        f"{result.get('options', {}).get('seconds')} s per cell, run {result.get('elapsed_s')} s.",
        engines_summary(result),
        engines_table(result),
    ]
    missing = failures(result)
    if missing:
        parts.append("Cells without figures:\n\n" + "\n".join(missing))
    return "\n\n".join(parts) + "\n"


def markdown(result: dict) -> str:
    if result.get("options", {}).get("engines"):
        return engines_markdown(result)
    environment = result.get("environment", {})
    gpus = ", ".join(environment.get("gpus") or []) or "no GPU"
    parts = [
        f"Measured on {gpus}, {environment.get('cpu_count')} CPUs, torch {environment.get('torch')} "
        f"(CUDA {environment.get('torch_cuda')}), Triton configuration "
        f"`{result.get('options', {}).get('config_name') or 'config.pbtxt'}`, "
        f"{result.get('options', {}).get('seconds')} s per cell, run {result.get('elapsed_s')} s.",
        findings_markdown(findings(result)),
        throughput_table(result),
        in_process_table(result),
        direct_table(result),
        http_table(result),
    ]
    missing = failures(result)
    if missing:
        parts.append("Cells without figures:\n\n" + "\n".join(missing))
    return "\n\n".join(part for part in parts if part) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    http = measured(result.get("http", []))
    direct = direct_by_shape(result)
    kinds = [kind for kind in ("short", "long") if any(cell["texts"] == kind for cell in http)] or ["short"]
    figure, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.4), dpi=110, squeeze=False)
    for axis, kind in zip(axes[0], kinds, strict=True):
        kind_shapes = [shape for texts, shape in shapes_in_order(http) if texts == kind]
        for index, shape in enumerate(kind_shapes):
            texts = kind
            cells = sorted(
                (cell for cell in http if (cell["texts"], cell["shape"]) == (texts, shape)),
                key=lambda cell: cell["workers"],
            )
            color = f"C{index % 10}"
            axis.plot([c["workers"] for c in cells], [c["emb_per_s"] for c in cells], marker="o", color=color,
                      label=f"HTTP, {shape}")  # fmt: skip
            if (texts, shape) in direct:
                axis.axhline(direct[(texts, shape)]["emb_per_s"], color=color, linestyle="--", linewidth=1,
                             label=f"Triton direct, {shape}")  # fmt: skip
        anchors = [cell for cell in measured(result.get("in_process", [])) if cell["texts"] == kind]
        if anchors:
            best = max(anchors, key=lambda cell: cell["emb_per_s"])
            axis.axhline(best["emb_per_s"], color="grey", linestyle=":",
                         label=f"in process, batch {best['batch']}")  # fmt: skip
        axis.set_yscale("log")
        axis.set_xticks(sorted({cell["workers"] for cell in http}))
        axis.set_xlabel("uvicorn workers (manage.py serve --workers)")
        axis.set_ylabel("embeddings/s")
        axis.set_title(
            f"{kind} texts ({result.get('texts', {}).get(kind, {}).get('tokens_mean', 0):.0f} tokens)"
        )
        axis.grid(True, alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    gpus = ", ".join(result.get("environment", {}).get("gpus") or []) or "no GPU"
    figure.suptitle(f"embedsite on {gpus}: clients x texts per request", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, nargs="?", default=ROOT / "bench" / "results" / "gpu.json")
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "bench-gpu.png")
    parser.add_argument("--markdown", type=Path, help="also write the Markdown here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = json.loads(args.result.read_text())
    text = markdown(result)
    sys.stdout.write(text)
    if args.markdown:
        args.markdown.write_text(text)
    if result.get("options", {}).get("engines"):
        return  # the engines' figures are the tables; the plot is of worker counts
    plot(result, args.png)
    print(f"\nwritten {args.png}")


if __name__ == "__main__":
    main()
