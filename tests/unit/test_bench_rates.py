"""`make bench`'s `guidellm` and `gpurate` sections, the parts that run no process: the parsing of a guidellm
JSON report, the gpurate arithmetic, and their rows, tables and plot in docs/benchmarks.md (bench/report.py).

tests/unit/data/guidellm-report.json is a real guidellm 0.8.1 report (`guidellm run` with a 3-step sweep of
3 s steps against `guidellm mock-server`, 16 prompt and 16 output tokens, the demo model's tokenizer), trimmed to
the fields the bench reads: each benchmark's strategy and duration, and its metrics' successful distributions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpurate, guidellm_sweep, report, report_rates
from bench.report import Span

REPORT = Path(__file__).parent / "data" / "guidellm-report.json"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    return guidellm_sweep.parse(json.loads(REPORT.read_text()))


def test_a_guidellm_report_gives_one_row_per_sweep_step(steps):
    assert [s["step"] for s in steps] == ["synchronous", "throughput@512", "constant@81.00/s"]
    sync, thr, const = steps
    assert sync["strategy"] == "synchronous" and sync["rate"] is None and const["rate"] == pytest.approx(81.0)
    assert sync["requests_per_s"] == pytest.approx(8.0)
    assert sync["output_tok_per_s"] == pytest.approx(129.67, abs=0.01)
    assert sync["concurrency_p50"] == pytest.approx(1.0)
    assert sync["ttft_p50_ms"] == pytest.approx(27.40, abs=0.01)
    assert sync["ttft_p99_ms"] == pytest.approx(66.67, abs=0.01)
    assert sync["itl_p50_ms"] <= sync["itl_p99_ms"] == pytest.approx(6.45, abs=0.01)
    assert (sync["successful"], sync["errored"], sync["incomplete"]) == (25, 0, 0)
    assert (thr["successful"], thr["incomplete"]) == (243, 511)  # cut off by the step's max duration
    assert thr["output_tok_per_s"] == pytest.approx(1296.0)  # successful requests' tokens, not the total's
    assert all(s["duration_s"] == pytest.approx(3.0) for s in steps)


def test_a_report_without_benchmarks_or_metrics_parses_to_what_it_has():
    assert guidellm_sweep.parse({}) == []
    (step,) = guidellm_sweep.parse({"benchmarks": [{"config": {"strategy": {"type_": "concurrent", "streams": 8}}}]})
    assert step["step"] == "concurrent@8"
    assert step["output_tok_per_s"] is None and step["ttft_p99_ms"] is None and step["successful"] == 0


def test_the_guidellm_command_names_the_server_sweep_data_and_output(tmp_path):
    server = guidellm_sweep.Server("http://127.0.0.1:1", "m", {"x": 1})
    cmd = guidellm_sweep.command(Path("guidellm"), server, "/models/demo", tmp_path / "r.json",
                                 guidellm_sweep.SIZES["quick"])
    opts = {cmd[i]: json.loads(cmd[i + 1]) for i in range(2, len(cmd) - 1, 2)}
    assert cmd[:2] == ["guidellm", "run"] and cmd[-1] == "--disable-progress"
    assert opts["--backend"] == {"kind": "openai_http", "target": "http://127.0.0.1:1", "model": "m",
                                 "request_format": "/v1/chat/completions", "max_tokens": 64, "timeout": 120,
                                 "extras": {"body": {"x": 1}}}
    assert opts["--profile"]["kind"] == "sweep" and opts["--profile"]["sweep_size"] == 4
    # no output tokens in the data: guidellm would add ignore_eos, which transformers serve refuses (422)
    assert opts["--data"] == {"kind": "synthetic_text", "prompt_tokens": 64}
    assert opts["--constraint"] == {"kind": "max_duration", "seconds": 6}
    assert opts["--tokenizer"] == {"kind": "huggingface_auto", "model": "/models/demo"}
    assert opts["--output"] == {"kind": "json", "path": str(tmp_path / "r.json")}


def test_without_guidellm_the_section_says_it_is_skipped(monkeypatch):
    monkeypatch.setattr(guidellm_sweep, "executable", lambda: None)
    said: list[str] = []
    out = guidellm_sweep.section(None, "quick", said.append, (lambda: None, None))
    assert "not installed" in out["skipped"] and "guidellm skipped" in said[0]
    (row,) = report_rates.guidellm_rows(out)
    assert row.measured.startswith("skipped: guidellm is not installed")
    assert report_rates.guidellm_section(out) == []


def test_run_all_imports_without_guidellm():
    # a guidellm module that fails to import: run_all must not import it (it runs the command)
    code = ("import sys; sys.modules['guidellm'] = None; sys.path.insert(0, sys.argv[1]); import bench.run_all as r; "
            "assert 'guidellm' in r.SECTIONS and 'gpurate' in r.SECTIONS")
    subprocess.run([sys.executable, "-c", code, str(ROOT)], check=True, cwd=ROOT, timeout=120)


def gpurate_results() -> dict:
    per = {"api": 15.0, "tokenizer": 1.0, "scheduler": 8.0, "detokenizer": 14.0, "redis": 3.0, "client": 9.0}
    load = {"requests": 512, "ok": 512, "tokens": 512 * 256, "tok_per_s": 20_000.0, "ttft_p50_ms": 40.0,
            "ttft_p99_ms": 90.0, "itl_p50_ms": 5.0, "itl_p99_ms": 12.0, "chunks_per_request": 200.0,
            "error_counts": {}}
    m = {"us_per_token": per, "load": load, "redis_cmds_per_token": 0.8, "redis_cmds": {"xadd": 1000}}
    # 256 streams open together for 5 s, each streaming 1,000 tokens: 51,200 tok/s steady
    spans = [Span(0.0, 1.0, 5.0, 1000) for _ in range(256)]
    return gpurate.figures(m, spans)


def test_gpurate_figures_add_the_plumbing_and_leave_the_client_out():
    g = gpurate_results()
    assert g["plumbing_us_per_token"] == pytest.approx(41.0)  # api + tokenizer + scheduler + detokenizer + redis
    assert g["plumbing_cores_per_10k_tok_s"] == pytest.approx(0.41)  # 41 µs x 10,000 tok/s = 0.41 CPU s per s
    assert g["ideal"] == pytest.approx(256 * 1000 / 5)
    assert g["steady_tok_per_s"] == pytest.approx(51_200.0)
    assert g["fraction_of_ideal"] == pytest.approx(1.0)
    assert g["redis_cmds_per_token"] == 0.8 and g["tokens"] == 512 * 256


def test_a_one_token_run_is_spread_over_the_main_runs_tokens_and_rendered():
    g = gpurate_results()  # 41 µs of plumbing per token
    ones = {"us_per_token": {"api": 1200.0, "tokenizer": 700.0, "scheduler": 450.0, "detokenizer": 350.0,
                             "redis": 372.0, "client": 900.0},
            "load": {"ok": 1024}, "redis_cmds_per_token": 24.5}
    r = gpurate.per_request(ones, g["plumbing_us_per_token"])
    assert r["us_in_all"] == pytest.approx(3072.0)  # the client is not plumbing
    assert r["us_per_token_spread"] == pytest.approx(3072.0 / gpurate.TOKENS)  # 12.0 µs over 256 tokens
    assert r["share_of_plumbing"] == pytest.approx(12.0 / 41.0, abs=1e-3)
    page = "\n".join(report_rates.gpurate_section({**g, "per_request": r}))
    assert "| 1,200 µs | 700 µs | 450 µs | 350 µs | 372 µs | 3,072 µs | 12.0 µs | 29% | 24.5 |" in page
    table = page[page.index("| api | tokenizer | scheduler | detokenizer | redis | in all |"):].split("\n\n")[0]
    assert len({line.count("|") for line in table.splitlines()}) == 1
    assert "per_request" not in gpurate_results() and "A request apart" not in "\n".join(
        report_rates.gpurate_section(gpurate_results()))  # results of earlier runs render as before


def test_the_page_renders_both_sections_with_their_goals(tmp_path, steps):
    tf_steps = [{**s, "output_tok_per_s": s["output_tok_per_s"] / 2} for s in steps]
    r = {"meta": {"mode": "quick"}, "gpurate": gpurate_results(),
         "guidellm": {"config": {**guidellm_sweep.SIZES["quick"], "prompt_tokens": 64, "output_tokens": 64,
                                 "endpoint": "/v1/chat/completions", "max_concurrency": 64},
                      "rsinfer": {"steps": steps}, "transformers": {"steps": tf_steps}}}
    rows = {x.figure: x for x in report.rows(r)}
    plumbing = rows["5 ms step x 256 streams: plumbing CPU per generated token, all processes"]
    assert plumbing.measured == "41.0 µs = 0.41 cores per 10k tok/s" and plumbing.verdict == "not met"
    cmds = rows["5 ms step x 256 streams: Redis commands per generated token"]
    assert (cmds.measured, cmds.goal, cmds.verdict) == ("0.80", "<= 0.3", "not met")
    peak = rows["guidellm sweep, rsinfer: the step of most output tok/s"]
    assert peak.measured.startswith("1,296 tok/s, 81.0 req/s (throughput@512)")
    assert rows["guidellm sweep, transformers: the step of most output tok/s"].measured.startswith("648 tok/s")
    page = report.markdown(r, [])
    assert "## At a GPU's step rate (synthetic engine, issue 34)" in page
    assert "| 15.0 µs | 1.0 µs | 8.0 µs | 14.0 µs | 3.0 µs | 41.0 µs | 0.41 | 0.80 | 9.0 µs |" in page
    for table in ("| api | tokenizer |", "| server | step |"):  # a header, its separator and rows, alike
        rows_of = page[page.index(table):].split("\n\n")[0].splitlines()
        assert len({line.count("|") for line in rows_of}) == 1 and len(rows_of) >= 3
    assert "## guidellm sweeps: rsinfer vs transformers serve (issue 34)" in page
    assert "| rsinfer | constant@81.00/s | 78.33 | 1,258 | 9 | " in page
    assert page.count("| transformers | ") == 3


def test_the_flush_sweep_table_puts_the_default_run_among_its_points():
    g = {**gpurate_results(), "flush_ms": 10.0, "entry_rate": 5000.0, "flush_default": True}
    assert g["xadds_per_token"] == pytest.approx(1000 / (512 * 256), abs=1e-3)
    g["flush_sweep"] = [{**g, "flush_ms": f, "entry_rate": 0.0, "flush_default": False, "chunks_per_request": 256 / k,
                         "redis_cmds_per_token": 0.8 / k} for f, k in ((0.0, 1), (20.0, 4), (40.0, 8))]
    page = "\n".join(report_rates.gpurate_section(g))
    table = page[page.index("| T (ms) |"):].split("\n\n")[0].splitlines()
    assert len({line.count("|") for line in table}) == 1
    assert [line.split(" | ")[0] for line in table[2:]] == ["| 0", "| 10 (default)", "| 20", "| 40"]
    assert [row.split(" | ")[1] for row in table[2:]] == ["0", "5,000", "0", "0"]  # the defaults pace
    assert table[2].split(" | ")[2:5] == ["1.0", "0.01", "0.80"]  # tokens per chunk, XADD and commands per token
    assert table[4].split(" | ")[2:5] == ["4.0", "0.01", "0.20"]
    assert "flush" not in "\n".join(report_rates.gpurate_section(gpurate_results()))  # no sweep, no table


class Recorder:
    """Stands in for matplotlib.pyplot (not in the test extra): records what guidellm_plot draws."""

    def __init__(self):
        self.lines: list[tuple[str, list, list]] = []
        self.saved: list[Path] = []

    def subplots(self, *_, **__):
        return self, (self, self)

    def plot(self, xs, ys, *_, label: str, **__):
        self.lines.append((label, list(xs), list(ys)))

    def set(self, **_): ...

    def legend(self): ...

    def tight_layout(self): ...

    def savefig(self, path, **_):
        self.saved.append(path)

    def close(self, _): ...


def test_the_guidellm_plot_draws_each_percentile_of_each_server_against_throughput(tmp_path, steps):
    plt = Recorder()
    gl = {"rsinfer": {"steps": steps}, "transformers": {"skipped": "no command"}}
    assert report_rates.guidellm_plot(gl, tmp_path, plt) == tmp_path / "guidellm.png" == plt.saved[0]
    labels = [label for label, _, _ in plt.lines]
    assert labels == ["rsinfer p50", "rsinfer p99"] * 2  # TTFT, then ITL; nothing for the skipped server
    _, xs, ys = plt.lines[0]
    assert xs == sorted(xs) == [s["output_tok_per_s"] for s in sorted(steps, key=lambda s: s["output_tok_per_s"])]
    assert ys[0] == steps[0]["ttft_p50_ms"]  # the synchronous step delivers the fewest tokens
    assert report_rates.guidellm_plot({"rsinfer": {"error": "x"}}, tmp_path, plt) is None


def test_a_failed_or_skipped_server_shows_why():
    gl = {"config": {}, "rsinfer": {"error": "guidellm exited 1: boom"}, "transformers": {"skipped": "no command"}}
    rows = report_rates.guidellm_rows(gl)
    assert [x.measured for x in rows] == ["skipped: guidellm exited 1: boom", "skipped: no command"]
    lines = "\n".join(report_rates.guidellm_section(gl))
    assert "| rsinfer | skipped: guidellm exited 1: boom |" in lines
    assert "| transformers | skipped: no command |" in lines


def test_transformers_serve_is_asked_for_answers_that_no_eos_ends():
    # transformers serve ignores ignore_eos and merges generation_config into the model's key by key: without an
    # EOS no token has, the demo model's greedy answers ended after ~6 of 64 tokens (measured: 99 tokens for 16
    # requests, 1,024 with it)
    from bench import harness, run_all

    config = json.loads(harness.TRANSFORMERS_BODY["generation_config"])
    assert config["do_sample"] is False and all(t < 0 for t in config["eos_token_id"])
    assert run_all.TRANSFORMERS_BODY is harness.TRANSFORMERS_BODY is guidellm_sweep.TRANSFORMERS_BODY


def test_the_slo_section_counts_probes_by_outcome_and_renders_a_row_per_scenario():
    from bench import slo_goodput

    got = [{"status": 200, "code": None, "ttft_s": 0.4, "took_s": 0.6},
           {"status": 200, "code": None, "ttft_s": 2.5, "took_s": 2.7},
           {"status": 503, "code": "slo_unattainable", "ttft_s": None, "took_s": 0.02},
           {"status": 200, "code": "slo_missed", "ttft_s": None, "took_s": 1.8}]
    metrics = 'rsinfer_slo_requests_total{model="m",outcome="met"} 1.0\n' \
              'rsinfer_slo_requests_total{model="m",outcome="refused"} 1.0\n'
    f = slo_goodput.figures(got, 2.0, metrics)
    assert (f["met"], f["late"], f["refused"], f["ended_missed"]) == (1, 1, 1, 1)
    assert f["goodput_per_s"] == 0.5 and f["refusal_p50_ms"] == 20 and f["ttft_max_ms"] == 2500
    assert f["counters"] == {"met": 1.0, "missed": 0.0, "refused": 1.0}
    lines = report_rates.slo_section({"step_ms": 50, "max_running": 8, "flood": 40, "flood_tokens": 30, "probes": 4,
                                      "probe_every_s": 0.3, "ttft_ms": 1500, "scenarios": {"fifo": f}})
    assert lines[-1].startswith("| fifo | 1/4 | 1 | 1 (20 ms) | 1 |")
    assert report_rates.slo_section({}) == []
