"""The benchmark scripts import, parse their arguments and format their results (no servers started)."""

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import api  # noqa: E402
import configs  # noqa: E402
import int8_serve  # noqa: E402
import overload  # noqa: E402
import peers  # noqa: E402
import quantization  # noqa: E402
import rerank  # noqa: E402
import variants  # noqa: E402

pytestmark = pytest.mark.unit


def test_api_arguments_default_to_the_committed_result_paths():
    args = api.parse_args([])
    assert not args.quick
    assert args.out.name == "api.json"
    assert args.plot.name == "bench-api-processing.png"
    assert args.baseline is None and api.parse_args(["--baseline", "HEAD~2"]).baseline == "HEAD~2"


def test_peers_quick_run_is_short_and_the_full_run_longer():
    assert peers.parse_args(["--quick"]).seconds == 3.0
    assert peers.parse_args([]).seconds == 20.0
    assert peers.parse_args(["--quick", "--seconds", "5"]).seconds == 5.0


def test_peers_refuses_cells_shorter_than_wrk_can_run():
    with pytest.raises(SystemExit):
        peers.parse_args(["--seconds", "0.5"])


def test_wrk_script_posts_the_body_and_headers_verbatim():
    body = {"model": "minilm", "input": ['say "hi"', "a\\b"], "encoding_format": "base64"}
    script = peers.wrk_script(body, {"Authorization": "Bearer es_x"})
    body_line = next(line for line in script.splitlines() if line.startswith("wrk.body = "))
    # The Lua literal is a JSON string literal: decoding it twice gives the body back.
    assert json.loads(json.loads(body_line.removeprefix("wrk.body = "))) == body
    assert 'wrk.headers["Authorization"] = "Bearer es_x"' in script
    assert 'wrk.headers["Content-Type"] = "application/json"' in script
    assert "latency:percentile(99)" in script


def test_parse_wrk_counts_embeddings_not_requests():
    output = "Running 3s test\nRESULT 300 2 1 3000000 12.5 80.25\nRequests/sec: 100\n"
    cell = peers.parse_wrk(output, texts_per_request=8)
    assert cell == {
        "requests": 300,
        "errors": 3,
        "seconds": 3.0,
        "emb_per_s": 800.0,
        "p50_ms": 12.5,
        "p99_ms": 80.25,
    }


def test_parse_wrk_without_a_result_line_says_what_wrk_printed():
    with pytest.raises(RuntimeError, match="unable to connect"):
        peers.parse_wrk("unable to connect to 127.0.0.1:1\n", texts_per_request=1)


def test_cosines_of_scaled_and_orthogonal_vectors():
    ours = np.array([[1.0, 0.0], [0.0, 2.0]], dtype=np.float32)
    theirs = np.array([[3.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    assert peers.cosines(ours, theirs) == pytest.approx([1.0, 0.0])


def test_table_has_a_row_per_shape_and_marks_unmeasured_columns():
    cell = {"emb_per_s": 272.4, "p50_ms": 110.0, "p99_ms": 410.0}
    results = {
        "raw ORT": {shape.name: cell for shape in peers.SHAPES},
        "embedsite": {"32 x 1": {"emb_per_s": 150.0, "p50_ms": 200.0, "p99_ms": 900.0}},
        "raw ORT, batch 32 ceiling": {"emb_per_s": 560.0},
    }
    lines = peers.format_table(results).splitlines()
    rows = {line.split("|")[0].strip(): line for line in lines[2:] if "|" in line}
    assert set(rows) == {shape.name for shape in peers.SHAPES}
    single = [cell.strip() for cell in rows["32 x 1"].split("|")[1:]]
    assert single == ["272 (   110 /    410)", "-", "150 (   200 /    900)", "-"]
    assert rows["16 x 8 long"].split("|")[3].strip() == "-"
    assert lines[-1].endswith("560 emb/s")


def test_a_baseline_gets_a_last_column_of_its_own():
    cell = {"emb_per_s": 300.0, "p50_ms": 80.0, "p99_ms": 150.0}
    results = {"embedsite": {"32 x 1": cell}, peers.BASELINE_COLUMN: {"32 x 1": {**cell, "emb_per_s": 200.0}}}
    header, *_ = peers.format_table(results).splitlines()
    assert header.split("|")[-1].strip() == peers.BASELINE_COLUMN
    row = next(line for line in peers.format_table(results).splitlines() if line.startswith("32 x 1 "))
    assert row.split("|")[-1].strip().startswith("200")
    assert peers.BASELINE_COLUMN not in peers.format_table({"embedsite": {"32 x 1": cell}})
    assert peers.parse_args(["--baseline", "HEAD~1"]).baseline == "HEAD~1"
    assert peers.parse_args([]).baseline is None


def test_configs_serve_a_tree_that_a_config_names(monkeypatch):
    started = []
    monkeypatch.setattr(configs, "baseline_checkout", lambda ref: f"tree of {ref}")
    monkeypatch.setattr(configs, "RootServer", lambda env, port, root: started.append(("tree", root)))
    monkeypatch.setattr(configs, "Server", lambda env, port: started.append(("this", None)))
    configs.start_server({"BENCH_TREE": "abc123"}, 1)
    configs.start_server({}, 2)
    assert started == [("tree", "tree of abc123"), ("this", None)]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    cell = {"emb_per_s": 100.0, "p50_ms": 1.0, "p99_ms": 2.0}
    path = tmp_path / "peers.png"
    peers.plot({"raw ORT": {shape.name: cell for shape in peers.SHAPES}}, path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_table_flags_cells_whose_server_answered_errors():
    results = {"Infinity": {"16 x 8": {"emb_per_s": 500.0, "p50_ms": 1.0, "p99_ms": 2.0, "errors": 4}}}
    row = next(line for line in peers.format_table(results).splitlines() if line.startswith("16 x 8 "))
    assert row.split("|")[2].strip().startswith("500!")


def test_long_texts_get_longer_cells_than_short_ones():
    short, long = peers.SHAPES[1], peers.SHAPES[3]
    assert long.words > short.words
    assert peers.cell_seconds(long, 3.0) > peers.cell_seconds(short, 3.0) == 3.0


@pytest.mark.parametrize(
    "script", ["api.py", "peers.py", "quota.py", "jobs.py", "overload.py", "rerank.py", "quantization.py"]
)
def test_scripts_run_as_readme_says(script):
    """`.venv/bin/python bench/<script>` from the repository root: its imports resolve on their own."""
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"], cwd=BENCH.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout


@pytest.mark.parametrize(
    ("script", "options"),
    [
        ("replicas.py", ("--shape", "--rounds")),
        ("int8_serve.py", ("--seconds", "--rounds")),
        ("variants.py", ("--dtype", "--rounds", "--threads")),
        ("admin_overview.py", ("--tenants", "--jobs", "--days", "--rounds", "--without-hour-index")),
    ],
)
def test_benches_without_quick_run_as_readme_says(script, options):
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"], cwd=BENCH.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert all(option in done.stdout for option in options)


def test_the_variants_bench_times_int8_unless_told_and_writes_each_dtype_apart():
    assert (variants.parse_args([]).dtype, variants.parse_args([]).out.name) == ("int8", "int8.json")
    float16 = variants.parse_args(["--dtype", "float16", "--threads", "1"])
    assert (float16.out.name, float16.threads) == ("float16.json", [1])
    assert variants.parse_args(["--dtype", "float16", "--out", "x.json"]).out == Path("x.json")


def test_the_int8_serve_summary_compares_medians_per_shape_and_path():
    def cell(path: str, dtype: str, rate: float, load: float) -> dict:
        shape = int8_serve.LONG_256.name
        return {"shape": shape, "path": path, "dtype": dtype, "emb_per_s": rate, "p50_ms": 1000 / rate,
                "other_load_cores": load}  # fmt: skip

    cells = [
        cell("http", "float32", 10, 0.2), cell("http", "int8", 18, 0.2),
        cell("http", "float32", 12, 0.4), cell("http", "int8", 12, 0.4),
        cell("http", "float32", 11, 0.0), cell("http", "int8", 15, 0.0),
        cell("triton", "float32", 20, 0.0), cell("triton", "int8", 30, 0.0),
    ]  # fmt: skip
    [triton, http] = int8_serve.summary(cells)
    assert (http["path"], http["emb_per_s"], http["speedup"]) == (
        "http",
        {"float32": 11, "int8": 15},
        15 / 11,
    )
    assert http["other_load_cores"] == pytest.approx(0.2)
    assert triton["speedup"] == 1.5
    assert "| 2 x 32, 256 tokens | triton | 20 (50) | 30 (33) | 1.50x | 0.00 |" in int8_serve.table([triton])


def test_base64_rows_decode_little_endian_float32():
    vectors = np.array([[0.5, -1.0, 2.0], [3.0, 0.25, -0.125]], dtype="<f4")
    payload = {"data": [{"embedding": base64.b64encode(row.tobytes()).decode()} for row in vectors]}
    np.testing.assert_array_equal(peers.base64_rows(payload), vectors)


def test_a_server_whose_vectors_differ_is_not_timed():
    ours = np.eye(3, dtype=np.float32)
    assert peers.check_agreement("same", ours, ours * 2) == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="disagree"):
        peers.check_agreement("shifted", ours, ours + 0.05)


def test_configs_parse_names_and_environment_overrides():
    args = configs.parse_args(
        [
            "--config",
            "base=",
            "--config",
            "merge=COALESCE_REQUESTS=true,COALESCE_MAX_CALLS=1",
            "--shape",
            "32 x 1",
        ]
    )
    assert args.config == [("base", {}), ("merge", {"COALESCE_REQUESTS": "true", "COALESCE_MAX_CALLS": "1"})]
    assert [shape.name for shape in args.shape] == ["32 x 1"]
    assert [shape.name for shape in configs.parse_args(["--config", "a="]).shape] == [
        s.name for s in peers.SHAPES
    ]


@pytest.mark.parametrize("bad", ["noequals", "=X=1", "merge=NOVALUE"])
def test_configs_refuse_malformed_configs(bad):
    with pytest.raises(SystemExit):
        configs.parse_args(["--config", bad])


def test_configs_triton_delta_is_per_execution_and_per_request():
    before = {"requests": 10, "executions": 5, "rows": 10, "queue_ns": 0, "compute_infer_ns": 0}
    after = {"requests": 30, "executions": 7, "rows": 50, "queue_ns": 40e6, "compute_infer_ns": 200e6}
    delta = configs.triton_delta(before, after)
    assert delta["rows_per_execution"] == 20
    assert delta["queue_ms_per_request"] == 2
    assert delta["compute_infer_ms_per_execution"] == 10
    row = configs.format_table([{**delta, "config": "merge", "shape": "32 x 1", "round": 1, "emb_per_s": 300,
                                 "p50_ms": 90, "p99_ms": 150, "web_cpu_ms_per_request": 1.6}])  # fmt: skip
    assert row.splitlines()[-1].startswith("| merge | 32 x 1 | 1 | 300 | 90 | 150 | 1.60 | 20 | 20.0 |")


def test_configs_runs_as_its_docstring_says():
    command = [sys.executable, str(BENCH / "configs.py"), "--help"]
    done = subprocess.run(command, cwd=BENCH.parent, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--config" in done.stdout and "--py-spy" in done.stdout


def test_overload_cells_default_to_the_issue_s_connection_counts():
    args = overload.parse_args([])
    assert args.connections == [32, 256, 1000] and args.seconds == 20.0 and args.baseline is None
    assert overload.parse_args(["--quick", "--connections", "8,64"]).connections == [8, 64]
    assert overload.parse_args(["--quick"]).seconds == 5.0


def test_overload_counts_the_flood_s_200s_apart_from_its_refusals():
    output = "Running 20s test\nRESULT 1500 500 0 3 0 2 20000000 120.5 900.25 1500.0\n"
    cell = overload.parse_wrk(output)
    assert (cell["responses"], cell["ok"], cell["refused"]) == (1500, 1000, 500)
    assert cell["ok_per_s"] == 50.0 and cell["socket_errors"]["read"] == 3
    assert (cell["p50_ms"], cell["p99_ms"], cell["max_ms"]) == (120.5, 900.25, 1500.0)


def test_overload_s_wrk_script_sends_the_flood_tenant_s_key():
    script = overload.wrk_script({"model": "m", "input": "x"}, "emb_flood_key")
    assert 'wrk.headers["Authorization"] = "Bearer emb_flood_key"' in script
    assert "RESULT" in script


def test_rerank_table_compares_the_best_connection_count_with_raw_ort():
    cell = {"emb_per_s": 900.0, "p50_ms": 280.0}
    results = {
        "cross-encoder": {
            256: {
                "raw ORT": {"pairs_per_s": 1000.0, "p50_ms": 250.0},
                "embedsite, 1 connection": {**cell, "emb_per_s": 700.0},
                "embedsite, 4 connections": cell,
            }
        }
    }
    row = rerank.table(results).splitlines()[-1]
    assert row == "| cross-encoder | 256 | 1000 (250) | 700 (280) | 900 (280) | 0.90 |"


def test_spearman_of_monotone_reversed_and_tied_scores():
    assert quantization.spearman(np.array([1.0, 2.0, 3.0]), np.array([10, 20, 30])) == pytest.approx(1.0)
    assert quantization.spearman(np.array([1.0, 2.0, 3.0]), np.array([3, 1, -5])) == pytest.approx(-1.0)
    # Ties share their mean rank (1, 2.5, 2.5, 4): 4.5 / sqrt(4.5 x 5), scipy's spearmanr's value.
    tied = quantization.spearman(np.array([1.0, 2.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0, 4.0]))
    assert tied == pytest.approx(0.9486832980505138)
    assert quantization.average_ranks(np.array([5, 1, 5, 5, 0])).tolist() == [4.0, 2.0, 4.0, 4.0, 1.0]


def test_recall_at_k_counts_the_shared_best_and_breaks_ties_by_order():
    reference = np.array([0.9, 0.1, 0.8, 0.7, 0.0])
    assert quantization.recall_at_k(reference, np.array([5, 0, 1, 4, 3]), 2) == 0.5
    assert quantization.recall_at_k(reference, np.array([0, 1, 1, 1, 0]), 2) == 0.5  # ties: 1 and 2
    assert quantization.recall_at_k(reference, reference, 3) == 1.0


def test_hamming_scores_count_the_differing_bits():
    codes = np.array([[0b1111_0000], [0b1111_0001], [0b0000_1111]], dtype=np.uint8)
    scores = quantization.similarities(codes, "ubinary")
    assert scores.tolist() == [[0, -1, -8], [-1, 0, -7], [-8, -7, 0]]
    np.testing.assert_array_equal(
        quantization.similarities((codes.astype(np.int16) - 128).astype(np.int8), "binary"), scores
    )
    assert quantization.similarities(np.array([[1, -2]], dtype=np.int8), "int8").tolist() == [[5]]


def test_quantization_bench_defaults_to_the_full_and_a_truncated_width():
    args = quantization.parse_args([])
    assert (args.quick, args.k, args.dimensions, args.out.name) == (
        False,
        10,
        [384, 128],
        "quantization.json",
    )
    assert quantization.parse_args(["--quick", "--dimensions", "384"]).dimensions == [384]


def test_the_per_dimension_comparison_codes_are_sentence_transformers():
    from embeddings.services.inference.quantization import calibration_from_vectors

    vectors = np.random.default_rng(1).normal(size=(20, 16)).astype(np.float32)
    calibration = calibration_from_vectors(vectors)
    codes = quantization.per_dimension_codes(vectors, calibration)
    step = (calibration.maximum - calibration.minimum) / 255
    restored = (codes.astype(np.float64) + 128) * step + calibration.minimum
    assert (np.abs(restored - vectors) <= step / 2 + 1e-6).all()
    assert codes.min() == -128 and codes.max() == 127  # each dimension's range spans every code
