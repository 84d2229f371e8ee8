"""bench/report.py, the pure half of `make bench`: CPU and Redis arithmetic per token, rates from request
spans, and the table of figures against issue 11's goals (the benchmark itself never runs in the suite)."""

from __future__ import annotations

import pytest

from bench import report
from bench.report import Span

# /proc/<pid>/stat of a process whose name has spaces and parentheses: utime 250, stime 50 (fields 14, 15)
STAT = "4242 (rsinfer (api) x) S 1 4242 4242 0 -1 4194560 9000 0 0 0 250 50 0 0 20 0 3 0 12345 1000 200"


def test_cpu_ticks_and_status_from_proc():
    assert report.proc_cpu_ticks(STAT) == 300
    status = "Name:\tpython\nVmHWM:\t  391060 kB\nVmRSS:\t  120004 kB\n"
    assert report.proc_status_kb(status, "VmHWM") == 391060
    assert report.proc_status_kb(status, "VmSwap") == 0
    # 300 ticks at 100 Hz = 3 s of CPU over 60,000 tokens = 50 µs each
    assert report.us_per_token(300, 100, 60_000) == pytest.approx(50.0)
    assert report.us_per_token(300, 100, 0) == 0.0


def test_redis_commands_per_token_from_commandstats_deltas():
    before = report.command_calls({"cmdstat_xadd": {"calls": 100, "usec": 5}, "cmdstat_info": {"calls": 3},
                                   "cmdstat_expire": {"calls": 10}, "errorstat_ERR": {"count": 1}})
    after = report.command_calls({"cmdstat_xadd": {"calls": 1100}, "cmdstat_info": {"calls": 4},
                                  "cmdstat_expire": {"calls": 10}, "cmdstat_xreadgroup": {"calls": 250}})
    assert before == {"xadd": 100, "info": 3, "expire": 10}
    delta = report.command_delta(before, after)
    assert delta == {"xadd": 1000, "xreadgroup": 250}  # the bench's own INFO and unchanged commands left out
    assert list(delta) == ["xadd", "xreadgroup"]  # most called first
    assert sum(delta.values()) / 500 == 2.5


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert report.percentile(values, 0.5) == 50.0
    assert report.percentile(values, 0.99) == 99.0
    assert report.percentile(values, 1.0) == 100.0
    assert report.percentile([7.0], 0.99) == 7.0
    assert report.percentile([], 0.5) == 0.0


def test_peak_open_and_steady_rate_leave_the_ramp_out():
    # 4 streams, opened one per second; all 4 open from t=3 to t=10; each delivers 100 tokens evenly
    spans = [Span(start=float(i), first=float(i) + 1, end=10.0 + i, tokens=100) for i in range(4)]
    assert report.peak_open(spans) == 4
    rate, window = report.steady_rate(spans, 4)
    assert window == pytest.approx(7.0)  # [3, 10]
    # stream i streams over [i+1, 10+i] at 100/9 tok/s: streams 0-2 for all 7 s of the window, stream 3
    # (first token at 4) for 6 s: the wait for a first token counts as open, not as streaming
    assert rate == pytest.approx((3 * 7 + 6) * 100 / 9 / 7)
    assert report.steady_rate(spans, 5) == (0.0, 0.0)


def test_errors_are_grouped_by_status_and_code():
    errs = ['HTTP/1.1 503 Service Unavailable {"error":{"message":"x","code":"broker_unavailable"}}'] * 3 + [
        "HTTP/1.1 429 Too Many Requests {}", "TimeoutError()"]
    assert report.error_counts(errs) == {"503 broker_unavailable": 3, "429": 1, "TimeoutError()": 1}


RESULTS = {
    "meta": {"started_at": "2026-01-01 00:00 UTC", "mode": "quick", "cpus": 2, "commit": "abc1234",
             "loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [2.0, 1.0, 1.0], "duration_s": 200},
    "engine": {"tok_per_s": 6000.0},
    "pipeline": {"tok_per_s": 3000.0},
    "cpu": {"us_per_token": {"api": 25.0, "detokenizer": 79.0, "scheduler": 242.0, "redis": 21.0},
            "engine_alone_us_per_token": 200.0, "scheduler_plumbing": 0.21, "redis_cmds_per_token": 1.05,
            "tokens": 1000, "redis_cmds": {"xadd": 700, "expire": 350}},
    "vs_transformers": {"skipped": "accelerate is not installed"},
    "streams_10k": {"requests": 10000, "ok": 10000, "peak_open": 10000, "api_rss_peak_kb": 900 * 1024,
                    "itl_p99_ms": 31.0, "step_ms": 20.0},
}


def test_table_puts_each_goal_next_to_its_figure():
    rows = {r.figure: r for r in report.rows(RESULTS)}
    ratio = rows["full pipeline / engine in-process (median of interleaved pairs)"]
    assert ratio.measured == "0.50x" and ratio.goal.startswith(">= 0.85x") and ratio.verdict == "not met"
    assert rows["CPU per generated token: api"].verdict == "met"
    assert rows["CPU per generated token: detokenizer"].verdict == "not met"
    assert rows["CPU per generated token: redis"].goal == "" and rows["CPU per generated token: redis"].verdict == ""
    assert rows["scheduler plumbing over the engine alone"].measured == "+21%"
    assert rows["scheduler plumbing over the engine alone"].verdict == "not met"
    assert rows["Redis commands per generated token (paged engine, 1 token per step)"].verdict == "met"
    assert rows["API process RSS, peak"].verdict == "met"
    assert rows["ITL p99 added by the plumbing (ITL p99 - step)"].measured == "11.0 ms"
    assert rows["ITL p99 added by the plumbing (ITL p99 - step)"].verdict == "not met"
    assert rows["vs transformers serve --continuous-batching"].measured.startswith("skipped: accelerate")


def test_markdown_has_the_table_the_breakdown_and_the_plots():
    text = report.markdown(RESULTS, ["../bench/results/plots/sweep.png"])
    assert "| pipeline | full pipeline / engine in-process (median of interleaved pairs) | 0.50x | >= 0.85x" in text
    paired = {**RESULTS, "pipeline": {"tok_per_s": 3000.0, "ratio_vs_engine": 0.61}}
    assert report.pipeline_ratio(paired) == 0.61 and report.headline(paired)["pipeline_ratio"] == 0.61
    assert "| xadd | 700 | 0.700 |" in text
    assert "![sweep](../bench/results/plots/sweep.png)" in text
    assert "Load average before/after: [1.0, 1.0, 1.0] / [2.0, 1.0, 1.0]" in text
    assert report.markdown({}, []).startswith("# Benchmarks")  # nothing measured yet: still a page


def test_history_keeps_the_headline_of_each_run():
    h = report.headline(RESULTS)
    assert h["pipeline_ratio"] == 0.5 and h["api_us"] == 25.0 and h["vs_transformers"] is None
    assert h["streams_10k_ok"] == 10000 and h["loadavg_before"] == [1.0, 1.0, 1.0]
    older = {**h, "started_at": "2025-12-31 00:00 UTC", "pipeline_ratio": 0.4}
    table = report.history_table([older, h])
    assert table[2].startswith("| 2026-01-01 00:00 UTC | [1.0, 1.0, 1.0] | 0.50x | 25 |")  # newest first
    assert "| 0.40x |" in table[3] and table[2].endswith("| 10,000 | — |")
    assert "## Run to run" in report.markdown(RESULTS, [], [h]) and "## Run to run" not in report.markdown(RESULTS, [])


PREFIX = {"meta": {"started_at": "2026-01-02 00:00 UTC", "commit": "abc1234"},
          "config": {"system_prompts": 8, "system_tokens": 512, "conversations": 48, "turns": 4, "user_tokens": 64,
                     "max_tokens": 32, "concurrency": 8, "scheduler_env": {"RSINFER_MAX_KV_TOKENS": "8192"}},
          "runs": [{"schedulers": 2, "routing": routing, "hit_rate": hit, "routed": routed, "admitted": 192,
                    "ttft_p50_ms": p50, "ttft_p99_ms": 300.0, "output_tok_per_s": tps, "prompt_tok_per_s": 9000.0,
                    "wall_s": 9.5, "ok": 192, "requests": 192, "loadavg_before": [1.0, 1.0, 1.0]}
                   for routing, hit, routed, p50, tps in ((False, 0.72, 0, 60.0, 900.0),
                                                          (True, 0.84, 170, 45.0, 1000.0))],
          "summary": {"2": {"hit_rate": [0.72, 0.84], "ttft_p50_ms": [60.0, 45.0], "ttft_p99_ms": [300.0, 300.0],
                            "output_tok_per_s": [900.0, 1000.0], "throughput_ratio": 1.111}}}


def test_prefix_routing_figures_have_rows_and_a_section():
    rows = {r.figure: r for r in report.rows({**RESULTS, "prefix_routing": PREFIX})}
    assert rows["prefix hit rate, 2 schedulers: shared stream -> prefix routing"].measured == "72% -> 84%"
    assert rows["output tokens/s, 2 schedulers: shared stream -> prefix routing"].measured == "900 -> 1,000 (1.11x)"
    assert rows["TTFT p50 / p99, 2 schedulers: shared stream -> prefix routing"].measured == "60 / 300 -> 45 / 300 ms"
    text = report.markdown({**RESULTS, "prefix_routing": PREFIX}, [])
    assert "## Prefix-aware routing (issue 14)" in text and "commit `abc1234`" in text
    assert "| 2 | prefix routing | 84% | 170/192 | 45 ms | 300 ms | 1,000 | 9,000 | 9.5 s | 192/192 |" in text
    assert "## Prefix-aware routing" not in report.markdown(RESULTS, [])


def test_host_bench_section_compares_before_and_after():
    run = {"when": "2026-12-01T12:00:00", "machine": {"cpus": 2}, "config": {"steps": 60, "repeat": 5}}
    host = {"before/greedy": {**run, "results": [{"batch": 1, "gpu_ms": 0.25, "host_cpu_ms_per_step": 0.5,
                                                  "gpu_busy_share": 0.3, "plans_per_step": 1.0}]},
            "after/greedy": {**run, "results": [{"batch": 1, "gpu_ms": 0.25, "host_cpu_ms_per_step": 0.2,
                                                 "gpu_busy_share": 0.9, "plans_per_step": 0.07}]}}
    text = "\n".join(report.host_section(host))
    assert "## Engine host time per decode step (issue 20)" in text
    # synchronous before: 0.25 / (0.25 + 0.5); overlapped after: 0.25 / max(0.25, 0.2)
    assert "| greedy | 1 | 0.25 ms | 0.500 ms -> 0.200 ms | 30% -> 90% | 33% -> 100% | 1.00 -> 0.07 | met |" in text
    assert report.host_section({}) == []


def test_lora_section_shows_each_configuration_against_no_adapters():
    configs = {k: {"cpu_ms": ms, "wall_ms": ms, "cpu_vs_no_lora": ms / 10.0, "runs": [{"cpu_ms": ms}]}
               for k, ms in (("no-lora", 10.0), ("base", 10.0), ("1-adapter", 11.0), ("4-adapters", 12.5))}
    lora = {"when": "2026-12-01 12:00:00", "machine": {"cpus": 2, "loadavg": [1.0, 1.0, 1.0]},
            "config": {"batch": 16, "rank": 16, "runs": 3, "threads": 1, "dtype": "float32"},
            "shapes": {"tiny": {"configs": configs, "params": 1_200_000}}}
    text = "\n".join(report.lora_section(lora))
    assert "## LoRA adapters: engine step time at batch 16 (issue 23)" in text
    row = ("| tiny (1M parameters) | 10.00 ms (1.00x); best 10.00 | 10.00 ms (1.00x); best 10.00 | "
           "11.00 ms (1.10x); best 11.00 | 12.50 ms (1.25x); best 12.50 |")
    assert row in text
    assert report.lora_section({}) == []
    assert "## LoRA adapters" in report.markdown(RESULTS, [], lora=lora)
    assert "## LoRA adapters" not in report.markdown(RESULTS, [])


def test_lora_routing_section_shows_routing_against_the_shared_stream():
    run = {"requests": 64, "ok": 64, "routed": 0, "admitted": 64, "ttft_p50_ms": 180.0, "ttft_p99_ms": 660.0,
           "wall_s": 14.1, "output_tok_per_s": 72.0, "loadavg_before": [1.0, 1.0, 1.0]}
    routing = {"config": {"schedulers": 2, "max_loras": 2, "adapters": 4, "requests": 64, "concurrency": 4,
                          "max_tokens": 16}, "meta": {"started_at": "2026-12-01 14:42 UTC", "commit": "abc"},
               "runs": [{**run, "routing": False, "lora_loads": 42, "lora_evictions": 38},
                        {**run, "routing": True, "lora_loads": 4, "lora_evictions": 0, "routed": 64}]}
    text = "\n".join(report.lora_routing_section(routing))
    assert "## LoRA adapters: adapter-aware routing (issue 23)" in text and "2 schedulers of 2 LoRA slots" in text
    assert "| shared | 42 | 38 | 0/64 | 180 ms | 660 ms | 72 | 14.1 s | 64/64 |" in text
    assert "| adapter-aware routing | 4 | 0 | 64/64 |" in text
    assert report.lora_routing_section({}) == []
    assert "adapter-aware routing (issue 23)" in report.markdown(RESULTS, [], lora_routing=routing)
