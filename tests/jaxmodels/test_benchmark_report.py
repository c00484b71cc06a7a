"""The benchmark's figures and markdown tables (jaxmodels.benchmark_report) from its JSON: the tiny run on CPU shared
with test_benchmark.py (tests/jaxmodels/conftest.py; its numbers mean nothing here, only that every one of them
reaches the tables), saved JSONs of older formats, and the
latency percentiles of the serving run."""

import json
import os
import subprocess

import jax
import numpy as np
import pytest
from PIL import Image

from jaxmodels.__main__ import main
from jaxmodels.benchmark import COMMIT_ENV, latency_percentiles
from jaxmodels.benchmark_report import BEGIN, END, FIGURES, markdown


def table_rows(text: str, first_header: str) -> list[dict]:
    """The rows, as {header: cell}, of the markdown table in `text` whose first column is `first_header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    header = [h.strip() for h in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


@pytest.mark.slow
def test_prefill_measures_each_length_and_keeps_the_longest_under_its_old_key(bench_run):
    _, _, data, _ = bench_run
    assert [row["tokens"] for row in data["prefill_sweep"]] == [16, 40]
    assert all(row["ttft_ms"] > 0 and row["tok_s"] > 0 for row in data["prefill_sweep"])
    assert data["prefill"] == data["prefill_sweep"][1]


@pytest.mark.slow
def test_serving_runs_report_ttft_and_itl_percentiles(bench_run):
    _, _, data, _ = bench_run
    for run in data["serve"]:
        for metric in ("ttft", "itl"):
            p50, p90, p99 = (run[f"{metric}_p{q}_ms"] for q in (50, 90, 99))
            assert 0 < p50 <= p90 <= p99


@pytest.mark.slow
def test_results_record_command_commit_and_device(bench_run):
    _, _, data, _ = bench_run
    assert data["command"].startswith("python -m jaxmodels bench --config ")
    assert "--prefill-len 16,40" in data["command"]
    here = os.path.dirname(__file__)
    if os.environ.get(COMMIT_ENV):  # named by the caller (a copy on a GPU machine), before any .git it carries
        assert data["commit"] == os.environ[COMMIT_ENV]
    elif subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, cwd=here).returncode == 0:
        # A commit of this checkout (not necessarily HEAD now: a commit made since the run moves HEAD).
        kind = subprocess.run(["git", "cat-file", "-t", data["commit"].removesuffix("-dirty")], capture_output=True,
                              text=True, cwd=here)
        assert kind.stdout.strip() == "commit"
    else:  # a copy of the sources without git
        assert data["commit"] == "unknown"
    assert data["device"] == jax.devices()[0].device_kind
    assert data["jax_version"] == jax.__version__


@pytest.mark.slow
def test_bench_plot_writes_valid_pngs(bench_run):
    _, figures, _, _ = bench_run
    for name in FIGURES.values():
        path = figures / name
        assert path.stat().st_size > 0
        with Image.open(path) as image:
            assert image.format == "PNG" and image.width > 0 and image.height > 0
            image.verify()


@pytest.mark.slow
def test_markdown_holds_the_numbers_of_the_json(bench_run):
    """Every number of the tables read back from the JSON, formatted as the tables say they are (tok/s whole,
    TTFT in ms to 0.1, ITL in ms to 0.01, ms per step to 0.01)."""
    results, _, data, _ = bench_run
    text = markdown([results])
    assert f"`{data['command']}` at {data['commit']}" in text
    decode = {(row["B"], row["sampling"]): row for row in table_rows(text, "B")}
    theirs = {row["batch"]: row for row in data["transformers"]["decode"]}
    for row in data["decode"]:
        cells = decode[str(row["batch"]), row["sampling"]]
        assert cells["tok/s"] == f"{row['tok_s']:,.0f}"
        assert cells["floor tok/s"] == f"{row['floor_tok_s']:,.0f}"
        assert cells["ms / step"] == f"{row['step_ms']:.2f}"
        assert cells["transformers tok/s"] == f"{theirs[row['batch']]['tok_s']:,.0f}"
    prefill = {row["prompt tokens"]: row for row in table_rows(text, "prompt tokens")}
    assert list(prefill) == ["16", "40"]
    theirs = {row["tokens"]: row for row in data["transformers"]["prefill_sweep"]}
    for row in data["prefill_sweep"]:
        cells = prefill[str(row["tokens"])]
        assert cells["TTFT ms"] == f"{row['ttft_ms']:,.1f}"
        assert cells["tok/s"] == f"{row['tok_s']:,.0f}"
        assert cells["transformers TTFT ms"] == f"{theirs[row['tokens']]['ttft_ms']:,.1f}"
    serve = table_rows(text, "requests")
    assert [cells["arrivals"] for cells in serve] == ["all at once", "50 arrivals/s"]
    for cells, run in zip(serve, data["serve"]):
        assert cells["output tok/s"] == f"{run['out_tok_s']:,.0f}"
        assert cells["tokens in / out"] == "10 / 5"
        for q in (50, 90, 99):
            assert cells[f"TTFT p{q} ms"] == f"{run[f'ttft_p{q}_ms']:,.1f}"
            assert cells[f"ITL p{q} ms"] == f"{run[f'itl_p{q}_ms']:,.2f}"


# A JSON as the benchmark wrote it before the prefill sweep, the p90s and the provenance, with transformers beside
# (one decode size out of memory).
OLD_RESULTS = {
    "config": "bench/configs/nemotron_h_nano9b.json", "layers": "all", "dtype": "bfloat16", "weights": "bfloat16",
    "transformers": {"decode": [{"batch": 1, "step_ms": 40.0, "tok_s": 25.0}, {"batch": 256, "error": "OOM"}],
                     "prefill": {"tokens": 4096, "ttft_ms": 900.0, "tok_s": 4551.1}},
    "decode": [{"batch": 1, "sampling": "plain", "step_ms": 4.0, "tok_s": 250.0, "host_ms": 0.5, "host_share": 0.125,
                "floor_ms": 3.5, "of_floor": 0.875},
               {"batch": 256, "sampling": "plain", "step_ms": 20.0, "tok_s": 12800.0, "host_ms": 1.0,
                "host_share": 0.05, "floor_ms": "-", "of_floor": "-"}],
    "prefill": {"tokens": 4096, "ttft_ms": 120.5, "tok_s": 33992.0, "floor_ms": 60.0, "of_floor": 0.5},
    "serve": [{"requests": 256, "rate": 8.0, "seconds": 60.0, "out_tok_s": 4369.0, "ttft_p50_ms": 80.0,
               "ttft_p99_ms": 400.0, "itl_p50_ms": 12.25, "itl_p99_ms": 30.5, "preemptions": 0}],
}


def test_report_reads_older_jsons_with_transformers_beside(tmp_path, capsys):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(OLD_RESULTS))
    out = tmp_path / "report" / "BENCH.md"
    out.parent.mkdir()
    main(["bench-report", str(path), "--plot", str(tmp_path / "report" / "figures"), "--markdown", str(out)])
    text = out.read_text()
    assert "### nemotron_h_nano9b" in text
    for name in FIGURES.values():
        assert (tmp_path / "report" / "figures" / name).stat().st_size > 0
        assert f"(figures/{name})" in text  # linked relative to the markdown
    decode = {row["B"]: row for row in table_rows(text, "B")}
    assert (decode["1"]["transformers tok/s"], decode["256"]["transformers tok/s"]) == ("25", "OOM")
    assert decode["1"]["floor tok/s"] == "286"  # 1 token per 3.5 ms
    assert decode["256"]["floor tok/s"] == "-"
    (prefill,) = table_rows(text, "prompt tokens")
    assert (prefill["TTFT ms"], prefill["transformers TTFT ms"]) == ("120.5", "900.0")
    (serve,) = table_rows(text, "requests")
    assert (serve["ITL p50 ms"], serve["ITL p90 ms"], serve["ITL p99 ms"]) == ("12.25", "-", "30.50")
    assert serve["arrivals"] == "8 arrivals/s"


def test_update_rewrites_only_the_block_between_the_pages_markers(tmp_path, capsys):
    """The prose around the block is kept byte for byte, the old tables go, and a second run changes nothing."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps(OLD_RESULTS))
    page = tmp_path / "BENCH.md"
    head, tail = "# Results\n\nprose before\n\n", "\n\n## After\n\nprose after\n"
    page.write_text(f"{head}{BEGIN}\n\n| stale | table |\n\n{END}{tail}")
    main(["bench-report", str(path), "--update", str(page)])
    text = page.read_text()
    assert text.startswith(head + BEGIN) and text.endswith(END + tail)
    assert "stale" not in text
    block = text.split(BEGIN)[1].split(END)[0]
    assert block.strip() == markdown([str(path)]).strip()
    main(["bench-report", str(path), "--update", str(page)])
    assert page.read_text() == text


@pytest.mark.parametrize("body", ["no markers at all\n", f"{END}\nthen\n{BEGIN}\n"])
def test_update_refuses_a_page_without_its_markers_in_order(tmp_path, capsys, body):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(OLD_RESULTS))
    page = tmp_path / "BENCH.md"
    page.write_text(body)
    with pytest.raises(SystemExit):
        main(["bench-report", str(path), "--update", str(page), "--plot", str(tmp_path / "figures")])
    assert "needs the line" in capsys.readouterr().err
    assert page.read_text() == body
    assert not (tmp_path / "figures").exists()  # refused before drawing anything


def test_latency_percentiles_match_numpy_per_request_gaps():
    """Request 0 gets tokens 0.5 s after arriving, then 0.1 s and 0.3 s apart; request 1 after 0.2 s, then 0.05, 0.2,
    0.05 s apart; request 2 arrived and got none. The 0.8 s between request 0's last token and request 1's first is
    no inter-token latency."""
    arrived = {0: 0.0, 1: 1.5, 2: 1.6}
    token_times = {0: [0.5, 0.6, 0.9], 1: [1.7, 1.75, 1.95, 2.0], 2: []}
    got = latency_percentiles(arrived, token_times)
    ttft, itl = [0.5, 0.2], [0.1, 0.3, 0.05, 0.2, 0.05]
    for q in (50, 90, 99):
        # The gaps are differences of floats (0.6 - 0.5 = 0.09999999999999998): 1e-13 ms off the exact ones.
        assert got[f"ttft_p{q}_ms"] == pytest.approx(np.percentile(ttft, q) * 1e3, abs=1e-9)
        assert got[f"itl_p{q}_ms"] == pytest.approx(np.percentile(itl, q) * 1e3, abs=1e-9)
    assert set(got) == {f"{m}_p{q}_ms" for m in ("ttft", "itl") for q in (50, 90, 99)}


def test_latency_percentiles_of_one_token_per_request_have_no_itl():
    got = latency_percentiles({0: 0.0, 1: 0.0}, {0: [0.25], 1: [0.75]})
    assert got["ttft_p50_ms"] == pytest.approx(500.0)
    assert all(np.isnan(got[f"itl_p{q}_ms"]) for q in (50, 90, 99))


def test_named_commit_wins_over_the_checkout(monkeypatch):
    """A copy of the tree on a GPU machine can carry a stale .git; the commit the caller names is the one recorded."""
    from jaxmodels.benchmark import source_commit

    monkeypatch.setenv(COMMIT_ENV, "abc1234")
    assert source_commit() == "abc1234"
    monkeypatch.delenv(COMMIT_ENV)
    here = os.path.dirname(__file__)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here)
    if head.returncode == 0:
        assert source_commit().removesuffix("-dirty") == head.stdout.strip()
    else:
        assert source_commit() == "unknown"
