"""bench/gpu.py's pure parts (wrk output, /proc CPU sums, the cell bookkeeping) and bench/plot_gpu.py's
findings, tables and plot from a small result; no server is started."""

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import gpu  # noqa: E402
import plot_gpu  # noqa: E402

pytestmark = pytest.mark.unit
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --- wrk ---------------------------------------------------------------------------------------------


def test_parse_wrk_counts_only_answered_requests_as_embeddings():
    output = "Running 5s test\nRESULT 1000 100 3 5000000 12.5 80.25\nRequests/sec: 200\n"
    cell = gpu.parse_wrk(output, texts_per_request=32)
    assert cell["requests"] == 1000
    assert (cell["status_errors"], cell["socket_errors"], cell["errors"]) == (100, 3, 103)
    assert cell["seconds"] == 5.0
    # A 429 is counted by wrk as a request but carries no embeddings.
    assert cell["embeddings"] == 900 * 32
    assert cell["emb_per_s"] == 900 * 32 / 5.0
    assert (cell["p50_ms"], cell["p99_ms"]) == (12.5, 80.25)


def test_parse_wrk_without_a_result_line_shows_what_wrk_printed():
    with pytest.raises(RuntimeError, match="unable to connect"):
        gpu.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n", texts_per_request=1)


def test_wrk_script_posts_the_body_verbatim_and_reports_p99():
    body = {"model": "all-MiniLM-L6-v2", "input": ['say "hi"', "a\\b"], "encoding_format": "base64"}
    script = gpu.wrk_script(body, {"Authorization": "Bearer es_x"})
    body_line = next(line for line in script.splitlines() if line.startswith("wrk.body = "))
    assert json.loads(json.loads(body_line.removeprefix("wrk.body = "))) == body
    assert 'wrk.headers["Authorization"] = "Bearer es_x"' in script
    assert "latency:percentile(99)" in script


def test_server_log_summary_counts_refusals_by_reason_and_keeps_the_first_other_lines():
    log = (
        "2026-11-24 09:19:27,772 WARNING django.request [74b7dcf5]: Too Many Requests: /v1/embeddings\n"
        "2026-11-24 09:19:28,193 ERROR django.request [62717951]: Service Unavailable: /v1/embeddings\n"
        "2026-11-24 09:19:28,194 ERROR django.request [b65eec2f]: Service Unavailable: /v1/embeddings\n"
        "\n"
        "2026-11-24 09:19:29,000 ERROR embeddings.services: Redis timed out\n"
        "Traceback (most recent call last):\n"
    )
    summary = gpu.summarize_server_log(log, keep=1)
    assert summary["refused"] == {"Too Many Requests": 1, "Service Unavailable": 2}
    assert summary["other_lines"] == ["2026-11-24 09:19:29,000 ERROR embeddings.services: Redis timed out"]
    assert gpu.summarize_server_log("") == {"refused": {}, "other_lines": []}


# --- /proc and nvidia-smi ----------------------------------------------------------------------------


def fake_process(proc: Path, pid: int, parent: int, command: str, utime: int, stime: int, cutime=0, cstime=0):
    # Fields after the command: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime ...
    fields = ["S", parent, pid, pid, 0, -1, 0, 0, 0, 0, 0, utime, stime, cutime, cstime, 20, 0, 1]
    (proc / str(pid)).mkdir()
    (proc / str(pid) / "stat").write_text(f"{pid} ({command}) " + " ".join(map(str, fields)) + "\n")


def test_process_tree_cpu_sums_the_root_and_all_its_descendants_only(tmp_path):
    fake_process(tmp_path, 100, 1, "python manage.py serve", utime=10, stime=5)
    fake_process(tmp_path, 101, 100, "python (worker) ) x", utime=200, stime=50)  # parens in the name
    fake_process(tmp_path, 102, 101, "child", utime=7, stime=3, cutime=40, cstime=0)  # reaped children
    fake_process(tmp_path, 200, 1, "wrk", utime=999, stime=999)  # not in the tree
    fake_process(tmp_path, 201, 200, "other", utime=999, stime=999)
    (tmp_path / "self").mkdir()  # not a pid: skipped
    total = gpu.process_tree_cpu_seconds(100, proc=tmp_path)
    assert total == pytest.approx((15 + 250 + 10 + 40) / CLOCK_TICKS)
    assert gpu.process_tree_cpu_seconds(101, proc=tmp_path) == pytest.approx((250 + 50) / CLOCK_TICKS)


def test_process_tree_cpu_of_a_pid_that_is_gone_is_zero(tmp_path):
    fake_process(tmp_path, 100, 1, "python", utime=10, stime=5)
    assert gpu.process_tree_cpu_seconds(4242, proc=tmp_path) == 0


def test_process_tree_cpu_of_this_process_includes_its_own_time():
    """The real /proc: the tree of this process counts at least the CPU this process has used, and a
    busy child's time with it."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        own = os.times()
        total = gpu.process_tree_cpu_seconds(os.getpid())
        assert total >= own.user + own.system - 2 / CLOCK_TICKS
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_parse_proc_stat_counts_busy_ticks_not_idle_or_iowait():
    line = "cpu  100 2 30 5000 70 4 5 6 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n"
    assert gpu.parse_proc_stat(line) == 100 + 2 + 30 + 4 + 5 + 6


def test_parse_gpu_samples_averages_numbers_and_skips_the_rest():
    assert gpu.parse_gpu_samples("90\n100\n[N/A]\n80\n10") == 70
    assert gpu.parse_gpu_samples("") is None


FAKE_SAMPLER = """
import os, signal, time
# As C's stdio buffers: by line on a terminal, by block on a pipe (whatever PYTHONUNBUFFERED says).
out = os.fdopen(1, "w", buffering=1 if os.isatty(1) else 8192)
# Ctrl-C ends it without flushing: only a line-buffered stdout has got its lines out.
signal.signal(signal.SIGINT, lambda *_: os._exit(0))
for value in ("10", "20", "30", "40", "[N/A]"):
    print(value, file=out)
time.sleep(60)
"""


def test_gpu_sampler_gets_the_lines_a_buffering_sampler_printed_before_its_ctrl_c(tmp_path):
    fake = tmp_path / "fake-nvidia-smi"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SAMPLER}")
    fake.chmod(0o755)
    sampler = gpu.GpuSampler([str(fake)])
    for _ in range(600):  # until it has printed (at most a minute on a loaded machine)
        if b"[N/A]" in sampler.output:
            break
        time.sleep(0.1)
    assert sampler.stop() == 25.0
    assert sampler.process.returncode == 0  # it stopped on SIGINT, not killed


def test_gpu_sampler_without_nvidia_smi_gives_none():
    assert gpu.GpuSampler(["no-such-nvidia-smi-here"]).stop() is None


# --- cells and bookkeeping ---------------------------------------------------------------------------


@pytest.mark.parametrize("clients,processes", [(512, 8), (32, 8), (5, 8), (130, 8), (1, 1), (7, 3)])
def test_split_clients_keeps_every_client_and_no_empty_process(clients, processes):
    split = gpu.split_clients(clients, processes)
    assert sum(split) == clients
    assert len(split) == min(clients, processes)
    assert min(split) >= 1 and max(split) - min(split) <= 1


def test_merge_client_results_sums_processes_over_the_common_wall_clock():
    parts = [
        {
            "latencies": [0.010] * 90 + [0.100] * 10,
            "errors": [],
            "failed": 0,
            "started": 100.0,
            "ended": 105.0,
        },
        {
            "latencies": [0.010] * 100,
            "errors": ["TritonTimeout: late"],
            "failed": 40,
            "started": 100.5,
            "ended": 110.0,
        },
    ]
    merged = gpu.merge_client_results(parts, batch=32)
    assert merged["requests"] == 200
    assert merged["embeddings"] == 200 * 32
    assert merged["seconds"] == 10.0
    assert merged["emb_per_s"] == 200 * 32 / 10.0
    assert merged["p50_ms"] == pytest.approx(10.0)
    assert merged["p99_ms"] == pytest.approx(100.0)
    assert merged["errors"] == 40 and merged["first_error"] == "TritonTimeout: late"


def test_defaults_are_the_device_run_and_fit_seven_minutes():
    args = gpu.parse_args([])
    assert (args.config_name, args.device, args.workers) == ("bundled-gpu", "cuda", [1, 4, 8, 12])
    assert [shape.name for shape in args.shapes] == ["32 x 1", "128 x 1", "512 x 1", "32 x 32"]
    assert args.batches == [1, 32, 512]
    assert gpu.planned_cells(args) == {"in_process": 6, "triton_direct": 8, "http": 32}
    assert gpu.planned_seconds(args) <= 7 * 60
    # The budget stops the run before the device's 10-minute limit on a command.
    assert gpu.planned_seconds(args) < args.budget_s < 600
    quick = gpu.parse_args(["--quick", "--workers", "1,2"])
    assert gpu.planned_cells(quick) == {"in_process": 4, "triton_direct": 4, "http": 8}


def test_on_cuda_the_servers_get_gpu_sized_limits_that_server_env_overrides():
    on_gpu = dict(gpu.parse_args([]).server_env)
    assert on_gpu["MAX_BATCH_TOKENS"] == "16384" and on_gpu["MAX_INFLIGHT_TRITON_CALLS"] == "1024"
    overridden = dict(gpu.parse_args(["--server-env", "MAX_BATCH_TOKENS=8192"]).server_env)
    assert overridden["MAX_BATCH_TOKENS"] == "8192" and overridden["MAX_TOKENS_IN_FLIGHT"] == "32768"
    assert dict(gpu.parse_args(["--device", "cpu", "--server-env", "LOG_LEVEL=INFO"]).server_env) == {
        "LOG_LEVEL": "INFO"
    }


def test_shapes_are_parsed_and_malformed_ones_refused():
    args = gpu.parse_args(["--shapes", "32x1, 512 x 1,32x32"])
    assert [(shape.clients, shape.batch) for shape in args.shapes] == [(32, 1), (512, 1), (32, 32)]
    for bad in ("32", "x1", "0x1", "32x", "axb", ","):
        with pytest.raises(SystemExit):
            gpu.parse_args(["--shapes", bad])


@pytest.mark.parametrize("bad", ["0", "1,x", "", "-4"])
def test_worker_lists_are_refused_unless_positive_integers(bad):
    with pytest.raises(SystemExit):
        gpu.parse_args(["--workers", bad])


def test_server_environment_overrides_are_parsed():
    args = gpu.parse_args(
        ["--device", "cpu", "--server-env", "MAX_INFLIGHT_TRITON_CALLS=512", "--server-env", "X="]
    )
    assert args.server_env == [("MAX_INFLIGHT_TRITON_CALLS", "512"), ("X", "")]
    with pytest.raises(SystemExit):
        gpu.parse_args(["--server-env", "NOVALUE"])


def test_engines_compare_the_three_gpu_engines_at_two_loads_within_the_budget():
    args = gpu.parse_args(["--engines"])
    assert [(engine.name, engine.config_name) for engine in args.engines] == [
        ("pytorch", "bundled-gpu"),
        ("onnxruntime-cuda", "bundled-gpu-onnx"),
        ("tensorrt", "bundled-gpu-tensorrt"),
    ]
    assert [shape.name for shape in args.shapes] == ["32 x 32", "512 x 1"]
    assert (args.workers, args.batches) == ([8], [])
    # Short and long texts, two loads, each engine: Triton direct and HTTP, nothing in process.
    assert gpu.planned_cells(args) == {"in_process": 0, "triton_direct": 12, "http": 12}
    assert gpu.planned_seconds(args) < args.budget_s
    some = gpu.parse_args(["--engines", "tensorrt, pytorch", "--workers", "4,8", "--shapes", "32x32"])
    assert [engine.name for engine in some.engines] == ["tensorrt", "pytorch"]
    assert gpu.planned_cells(some) == {"in_process": 0, "triton_direct": 4, "http": 8}
    assert gpu.parse_args([]).engines == []  # the full matrix of one configuration, as before


@pytest.mark.parametrize("bad", [["--engines", "onnx"], ["--engines", ","], ["--engines", "--device", "cpu"]])
def test_engines_that_do_not_exist_or_cannot_run_are_refused(bad):
    with pytest.raises(SystemExit):
        gpu.parse_args(bad)


def test_each_engine_serves_the_export_it_is_measured_on(tmp_path):
    float32 = {"dtype": "float32"}
    carried = {"sha256": "x", "carried_as": "float16 weights (bench/device/pack.sh)"}  # no dtype recorded
    float16 = {"dtype": "float16"}
    int8 = {"dtype": "int8"}
    engines = gpu.ENGINES

    def chosen(exports: dict[str, dict]) -> list[str | None]:
        found = {tmp_path / path: info for path, info in exports.items()}
        return [
            str(version_dir.relative_to(tmp_path)) if version_dir else None
            for version_dir in (gpu.engine_export(engines[name], found) for name in engines)
        ]

    # Here: the float32 export, and an int8 and a float16 one after it.
    here = {"minilm/1": float32, "minilm/2": int8, "minilm/3": float16}
    assert chosen(here) == ["minilm/1", "minilm/3", "minilm/3"]
    # On the lent GPU: pack.sh's float16-weights copy as 1 (PyTorch reads only its weights), the
    # float16 export as 2 in the folder --exports names.
    assert chosen({"minilm/1": carried, "exports/minilm/2": float16}) == [
        "minilm/1",
        "exports/minilm/2",
        "exports/minilm/2",
    ]
    # Without a float16 export: no float16 ONNX to run; TensorRT builds from float32.
    assert chosen({"minilm/1": float32}) == ["minilm/1", None, "minilm/1"]
    assert chosen({"minilm/1": carried})[2] is None


def test_an_engines_repository_serves_its_export_as_version_1_beside_the_tokenizer(tmp_path):
    version_dir = tmp_path / "exports" / "3"
    version_dir.mkdir(parents=True)
    (version_dir / "export.json").write_text(json.dumps({"dtype": "float16"}))
    (tmp_path / "exports" / "scratch").mkdir()
    assert gpu.model_exports([tmp_path / "exports", tmp_path / "missing"]) == {
        version_dir: {"dtype": "float16"}
    }

    repository = gpu.engine_repository(tmp_path / "repository", version_dir)

    assert (repository / "minilm" / "1").resolve() == version_dir.resolve()
    configs = sorted(path.name for path in (repository / "minilm" / "configs").iterdir())
    assert {"bundled-gpu.pbtxt", "bundled-gpu-onnx.pbtxt", "bundled-gpu-tensorrt.pbtxt"} <= set(configs)
    assert (repository / "minilm" / "config.pbtxt").is_file()
    assert (repository / "minilm_tokenizer" / "config.pbtxt").is_file()
    assert sorted(path.name for path in (repository / "minilm").iterdir()) == ["1", "config.pbtxt", "configs"]


def test_a_failing_cell_is_recorded_and_the_json_is_written_after_each_cell(tmp_path):
    out = tmp_path / "gpu.json"
    run = gpu.Run(gpu.parse_args(["--out", str(out)]))

    def fails():
        raise ConnectionError("Triton went away")

    run.cell("http", {"texts": "short", "workers": 4}, fails, expected_s=1)
    written = json.loads(out.read_text())
    assert written["http"] == [{"texts": "short", "workers": 4, "error": "ConnectionError: Triton went away"}]
    run.cell("http", {"texts": "long", "workers": 4}, lambda: {"emb_per_s": 5.0}, expected_s=1)
    assert json.loads(out.read_text())["http"][1] == {"texts": "long", "workers": 4, "emb_per_s": 5.0}


def test_a_cell_that_would_overrun_the_budget_is_skipped_not_run(tmp_path):
    run = gpu.Run(gpu.parse_args(["--out", str(tmp_path / "gpu.json"), "--budget-s", "100"]))
    called = []
    entry = run.cell("triton_direct", {"texts": "short"}, lambda: called.append(1) or {}, expected_s=101)
    assert called == []
    assert entry["skipped"].startswith("budget")
    assert json.loads((tmp_path / "gpu.json").read_text())["triton_direct"] == [entry]


# --- models in process (ONNX Runtime on CPU; no server) ----------------------------------------------


def test_on_cpu_the_in_process_model_falls_back_to_onnx_runtime_only_without_the_encoder(monkeypatch):
    monkeypatch.setitem(sys.modules, "embeddings.in_triton.backends.embedsite_torch.encoder", None)
    model, description = gpu.load_in_process_model("cpu")
    assert description == "onnxruntime-cpu-float32"
    tokens = gpu.tokenizer().encode(["a short text"])
    assert model.embed(tokens.input_ids, tokens.attention_mask).shape == (1, 384)
    with pytest.raises(ImportError):
        gpu.load_in_process_model("cuda")


def test_the_reference_round_trips_and_is_computed_when_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "agreement_texts", lambda: ["a short text", "another text, a little longer"])
    path = tmp_path / "reference.npz"
    gpu.write_reference(path)
    texts, vectors, source = gpu.load_reference(path)
    assert texts == ["a short text", "another text, a little longer"]
    assert vectors.dtype == np.float32 and vectors.shape == (2, 384)
    assert source == str(path)
    _, computed, source = gpu.load_reference(tmp_path / "missing.npz")
    assert "computed" in source
    assert gpu.min_cosine(computed, vectors) > 0.9999
    assert gpu.min_cosine(vectors, vectors[::-1]) < 0.99  # two different texts do differ


def test_the_scripts_run_as_their_docstrings_say():
    for script, option in (("gpu.py", "--write-reference"), ("plot_gpu.py", "--png")):
        done = subprocess.run([sys.executable, str(BENCH / script), "--help"], cwd=BENCH.parent,
                              capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert option in done.stdout


# --- bench/plot_gpu.py -------------------------------------------------------------------------------


def http_cell(workers, shape, emb_per_s, **extra):
    clients, batch = (int(part) for part in shape.split(" x "))
    return {"texts": "short", "workers": workers, "shape": shape, "clients": clients, "batch": batch,
            "emb_per_s": emb_per_s, "p50_ms": 10.0, "p99_ms": 30.0, "requests": 1000, "errors": 0,
            **extra}  # fmt: skip


SMALL_RESULT = {
    "environment": {"cpu_count": 16, "gpus": ["NVIDIA H100 80GB HBM3, 580.00, 81559 MiB"]},
    "options": {"config_name": "bundled-gpu", "seconds": 5.0},
    "texts": {"short": {"tokens_mean": 11.2}},
    "agreement": {"texts": 64, "in_process_min_cosine": 0.99991, "triton_min_cosine": 0.99990},
    "in_process_model": "torch-cuda-float16",
    "in_process": [
        {
            "texts": "short",
            "batch": 512,
            "emb_per_s": 150000.0,
            "model_only_emb_per_s": 200000.0,
            "p50_ms": 3.3,
            "p99_ms": 4.0,
        },
        {"texts": "short", "batch": 1, "error": "RuntimeError: CUDA out of memory"},
    ],
    "triton_direct": [
        {
            "texts": "short",
            "shape": "32 x 1",
            "clients": 32,
            "batch": 1,
            "emb_per_s": 20000.0,
            "p50_ms": 1.5,
            "p99_ms": 3.0,
            "errors": 0,
            "gpu_util_mean": 40.0,
            "rows_per_execution": 12.0,
        },
        {
            "texts": "short",
            "shape": "32 x 32",
            "clients": 32,
            "batch": 32,
            "emb_per_s": 60000.0,
            "p50_ms": 15.0,
            "p99_ms": 25.0,
            "errors": 0,
            "gpu_util_mean": 90.0,
            "rows_per_execution": 256.0,
        },
    ],
    "http": [
        # 1 worker, single texts: its one core is busy -> web CPU; 0.5 s of CPU per 1,000 -> 2,000/s/core.
        http_cell(1, "32 x 1", 2000.0, web_cpu_s_per_1000=0.5, web_cores_busy=0.98, gpu_util_mean=5.0),
        http_cell(4, "32 x 1", 7600.0, web_cpu_s_per_1000=0.5, web_cores_busy=3.9, gpu_util_mean=20.0),
        # Batch 32: HTTP at 0.9 of Triton-direct with the GPU at 95% -> GPU.
        http_cell(1, "32 x 32", 30000.0, web_cpu_s_per_1000=0.03, web_cores_busy=0.9, gpu_util_mean=50.0),
        http_cell(
            4,
            "32 x 32",
            54000.0,
            web_cpu_s_per_1000=0.05,
            web_cores_busy=2.7,
            gpu_util_mean=95.0,
            errors=7,
            server_log={"refused": {"Too Many Requests": 7}, "other_lines": []},
        ),
        http_cell(8, "32 x 1", 9000.0, web_cpu_s_per_1000=5.0, web_cores_busy=7.9, errors=333),
        {"texts": "short", "workers": 12, "shape": "32 x 1", "skipped": "budget: 530 s spent of 540"},
    ],
    "errors": [{"where": "serve --workers 12", "error": "RuntimeError: did not start"}],
    "elapsed_s": 410.0,
}


def test_findings_give_the_batch_32_ratio_the_per_core_figure_and_the_cores_to_feed_triton():
    found = plot_gpu.findings(SMALL_RESULT)
    assert found["batched"] == [
        {"texts": "short", "shape": "32 x 32", "http": 54000.0, "workers": 4, "direct": 60000.0, "ratio": 0.9}
    ]
    rows = {row["kind"]: row for row in found["per_core"]}
    # Single texts: the 1- and 4-worker cells cost 0.5 s per 1,000; the 8-worker one refused a third
    # of its requests, so its CPU (spent refusing) is left out.
    assert rows["single text"]["emb_per_web_core_s"] == pytest.approx(2000.0)
    assert rows["single text"]["web_cores"] == pytest.approx(20000.0 / 2000.0)
    assert rows["single text"]["best_http"] == 7600.0
    assert rows["single text"]["best_http_at"] == "4 workers, 32 x 1"
    assert rows["batch 32"]["emb_per_web_core_s"] == pytest.approx((1000 / 0.03 + 1000 / 0.05) / 2)
    assert rows["batch 32"]["web_cores"] == pytest.approx(60000.0 / ((1000 / 0.03 + 1000 / 0.05) / 2))


@pytest.mark.parametrize(
    "cell,expected",
    [
        (http_cell(4, "32 x 32", 10.0, gpu_util_mean=95.0, web_cores_busy=1.0), "GPU"),
        (http_cell(4, "32 x 1", 10.0, gpu_util_mean=20.0, web_cores_busy=3.6), "web CPU"),
        (http_cell(12, "512 x 1", 10.0, web_cores_busy=8.0, machine_cores_busy=15.5), "machine CPU"),
        (http_cell(4, "32 x 1", 19000.0, web_cores_busy=1.0, machine_cores_busy=4.0), "Triton"),
        (http_cell(4, "32 x 1", 5000.0, web_cores_busy=1.0, machine_cores_busy=4.0), "none saturated"),
    ],
)
def test_bottleneck_names_the_saturated_resource(cell, expected):
    direct = {"emb_per_s": 20000.0}
    assert plot_gpu.bottleneck(cell, direct, cpu_count=16) == expected


def test_markdown_has_the_tables_findings_and_the_cells_without_figures():
    text = plot_gpu.markdown(SMALL_RESULT)
    assert "NVIDIA H100 80GB HBM3" in text
    # Triton direct, then workers 1, 4 and 8.
    assert "| short | 32 x 1 | 20,000 | 2,000 | 7,600 | 9,000 |" in text
    assert "= 0.90 x Triton-direct" in text
    assert "single text: 2,000 embeddings per web-core second" in text
    assert "10.0 web cores feed Triton's best (20,000 emb/s)" in text
    assert "| short | 32 x 32 | 4 | 54,000 | 10.0 | 30.0 | 7 (7 Too Many Requests) |" in text
    assert "| GPU |" in text
    assert "CUDA out of memory" in text and "budget: 530 s spent of 540" in text
    assert "serve --workers 12: RuntimeError: did not start" in text


def test_plot_writes_a_png_even_for_a_partial_result(tmp_path):
    # As tests/test_bench.py: matplotlib is the benchmarks' (make bench-*), not the service's.
    pytest.importorskip("matplotlib")
    path = tmp_path / "gpu.png"
    plot_gpu.plot(SMALL_RESULT, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.png"
    plot_gpu.plot({"http": [], "errors": []}, empty)
    assert empty.exists()


ENGINES_RESULT = {
    "environment": {
        "cpu_count": 16,
        "gpus": ["NVIDIA H200, 580.159.03, 143771 MiB"],
        "onnxruntime": "1.31.1",
    },
    "options": {"engines": ["pytorch", "onnxruntime-cuda", "tensorrt"], "seconds": 3.0, "workers": [8]},
    "engines": [
        {
            "engine": "pytorch",
            "config_name": "bundled-gpu",
            "version": 1,
            "export_dtype": "float32",
            "triton_start_s": 31.5,
            "load_log": [
                "embedsite_torch: /x/minilm/1/model.onnx (embed) on cuda:0 in float16, sequence buckets [16]"
            ],
            "agreement": {"triton_min_cosine": 0.999991},
            "reported_engine": {"name": "pytorch", "precision": "float16"},
        },
        {
            "engine": "onnxruntime-cuda",
            "config_name": "bundled-gpu-onnx",
            "error": "no float16 export of minilm to serve (manage.py export_model --dtype float16)",
        },
        {
            "engine": "tensorrt",
            "config_name": "bundled-gpu-tensorrt",
            "version": 2,
            "export_dtype": "float16",
            "triton_start_s": 140.2,
            "load_log": [
                "embedsite_onnx: /x on TensorrtExecutionProvider, float16 engine built in 101.3 s: /e",
                "embedsite_onnx: /x, float16 engine loaded from the cache in 2.5 s",
                "embedsite_onnx: /x, float16 engine loaded from the cache in 3.0 s",
            ],
            "agreement": {"triton_min_cosine": 0.99951},
            "reported_engine": {"name": "tensorrt", "precision": "float16"},
        },
    ],
    "triton_direct": [
        {"engine": "pytorch", "texts": "short", "shape": "32 x 32", "emb_per_s": 95000.0, "p50_ms": 10.5},
        {"engine": "pytorch", "texts": "short", "shape": "512 x 1", "emb_per_s": 10900.0, "p50_ms": 46.0},
        {"engine": "tensorrt", "texts": "short", "shape": "32 x 32", "emb_per_s": 120000.0, "p50_ms": 8.0},
        {"engine": "tensorrt", "texts": "short", "shape": "512 x 1", "error": "TritonTimeout: late"},
    ],
    "http": [
        http_cell(8, "32 x 32", 48000.0, engine="pytorch"),
        http_cell(8, "512 x 1", 3900.0, engine="pytorch"),
        http_cell(8, "32 x 32", 51000.0, engine="tensorrt"),
        http_cell(8, "512 x 1", 4100.0, engine="tensorrt"),
    ],
    "errors": [],
    "elapsed_s": 512.0,
}


def test_the_engines_tables_put_the_engines_side_by_side():
    text = plot_gpu.markdown(ENGINES_RESULT)
    assert text.startswith("GPU engines measured on NVIDIA H200")
    assert "| texts | load | pytorch: Triton | pytorch: HTTP | onnxruntime-cuda: Triton |" in text
    assert (
        "| short | 32 x 32 | 95,000 (10.5) | 48,000 (10.0) | - | - | 120,000 (8.0) | 51,000 (10.0) |" in text
    )
    assert "| short | 512 x 1 | 10,900 (46.0) | 3,900 (10.0) | - | - | - | 4,100 (10.0) |" in text
    assert (
        "| tensorrt | `bundled-gpu-tensorrt` | version 2 (float16) | 140.2 | engine built x1, up to 101.3 s; "
        "engine loaded from the cache x2, up to 3.0 s | 0.99951 | tensorrt, float16 |" in text
    )
    assert "| pytorch | `bundled-gpu` | version 1 (float32) | 31.5 | PyTorch on cuda:0 in float16 |" in text
    assert "| onnxruntime-cuda | `bundled-gpu-onnx` | - | - | no float16 export of minilm" in text
    assert "- triton_direct (tensorrt, short, 512 x 1): TritonTimeout: late" in text


def test_the_backends_load_lines_are_taken_from_tritons_log_without_its_quotes():
    log = (
        'I1128 19:11:38.576648 15934 model.py:448] "embedsite_onnx: /r/minilm/1/model.onnx on '
        'TensorrtExecutionProvider, float16 engine built in 84.0 s: /r/minilm/engines/1/x"\n'
        "I1128 19:11:38.581018 15934 model_lifecycle.cc:839] \"successfully loaded 'minilm'\"\n"
    )
    (line,) = [match.group(1) for match in gpu.ENGINE_LOG_LINE.finditer(log)]
    assert line.endswith("engines/1/x") and line.startswith("embedsite_onnx: ")
    assert plot_gpu.load_summary([line]) == "engine built x1, up to 84.0 s"


def test_plotting_an_engines_result_prints_its_tables_and_draws_nothing(tmp_path, capsys):
    path = tmp_path / "engines.json"
    path.write_text(json.dumps(ENGINES_RESULT))
    plot_gpu.main(
        [str(path), "--png", str(tmp_path / "engines.png"), "--markdown", str(tmp_path / "engines.md")]
    )
    assert "pytorch: Triton" in capsys.readouterr().out
    assert (tmp_path / "engines.md").read_text().startswith("GPU engines measured")
    assert not (tmp_path / "engines.png").exists()


def test_the_device_path_imports_with_the_service_packages_only():
    """The GPU machine carries requirements.txt without onnxruntime, and no test or bench packages
    (httpx2): bench/gpu.py, the client processes it spawns and the HTTP stack it reuses must import
    without them."""
    script = (
        "import sys; sys.modules['httpx2'] = None; sys.modules['onnxruntime'] = None; "
        f"sys.path.insert(0, {str(BENCH)!r}); "
        "import gpu, api, triton_stats; gpu.client_process_ready(); gpu.parse_args([]); "
        "gpu.http_server_class(); print('imported')"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=BENCH.parent, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"


def test_base64_vectors_decode_little_endian_float32():
    vectors = np.array([[1.0, -2.5], [0.0, 3.25]], dtype="<f4")
    payload = {"data": [{"embedding": base64.b64encode(row.tobytes()).decode()} for row in vectors]}
    assert np.array_equal(gpu.base64_vectors(payload), vectors)
