"""Chart smoke test: run exactly what the Helm chart's Deployments run, as local processes.

`helm template` renders the chart with its defaults; each Deployment's container command, args and
environment (ConfigMap and Secret references resolved from the rendered manifests, the pod name from
the downward API) are started as they are, against a local redis-server that requires the password
the chart generated. Only these differ from the pods:
  - RSINFER_REDIS_URL points at the local redis-server, RSINFER_MODEL/RSINFER_SERVED_MODEL_NAME at
    the test's demo checkpoint, RSINFER_PORT and each worker's RSINFER_METRICS_PORT at free ports (pods
    have a network each, local processes share one; the rendered containerPorts are checked), and
    RSINFER_OTLP_ENDPOINT (rendered from tracing.otlpEndpoint) at a collector in the test;
  - the pods' emptyDir mounts (/tmp, the cache) become local temporary folders.
Then the API must turn ready on its own (no worker yet) and list the pool's model, the workers must come
up, the API must answer a chat completion through the official openai client, every
process must export the request's spans, every worker must serve its /metrics, and every worker's
rendered startup, liveness and readiness probes must pass; the preStop hook must turn the API unready. A flag or setting
renamed in the code but not in the chart breaks this test.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import redis

from rsinfer.redis_server import wait_until_up
from shared.settings import ApiSettings, DetokenizerSettings, SchedulerSettings, TokenizerSettings
from tests.deploy import helmbin, kube
from tests.e2e.test_observability import SERVICES, Collector
from tests.support.helpers import wait_for

pytestmark = pytest.mark.timeout(240)

API_KEY = "sk-chart-smoke-" + "0" * 24
READY_TIMEOUT_S = 150
SETTINGS = {"api": ApiSettings, "tokenizer": TokenizerSettings, "scheduler": SchedulerSettings,
            "detokenizer": DetokenizerSettings}
# What the code reads from the environment besides its settings; and what the demo pool leaves unset.
NON_SETTINGS_ENV = {"RSINFER_CACHE"}
MAY_BE_UNSET = {"RSINFER_MODEL"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def manifests():
    try:
        helmbin.find_helm()
    except helmbin.HelmUnavailable as exc:
        pytest.skip(f"chart smoke test skipped: no helm binary and none could be fetched ({exc})")
    # Defaults (worker metrics on), plus an API key (so the Secret's wiring is exercised), a short preStop
    # drain and tracing on.
    return helmbin.render(sets=[f"auth.apiKey={API_KEY}", "api.drainSeconds=1",
                                "tracing.otlpEndpoint=http://otel-collector.observability:4318"])


@pytest.fixture
def collector():
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def local_redis(manifests, tmp_path):
    """redis-server on a free port, with the password the chart generated for its in-chart Redis."""
    binary = shutil.which("redis-server")
    if not binary:
        pytest.skip("redis-server is not on PATH")
    (sts,) = kube.by_kind(manifests, "StatefulSet").values()
    password = kube.resolve_env(kube.pod_spec(sts)["containers"][0], manifests, "redis-0")["REDIS_PASSWORD"]
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", password],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=password, socket_connect_timeout=0.5)
    try:
        wait_until_up(client, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def _rsinfer_argv(argv: list[str]) -> list[str]:
    """The container's argv with `rsinfer` resolved to this environment's console script."""
    assert argv[0] == "rsinfer", argv
    script = Path(sys.executable).with_name("rsinfer")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "rsinfer.cli"]
    return head + argv[1:]


class Pod:
    """One Deployment's single container, run as a local process."""

    def __init__(self, deployment: dict, manifests: list[dict], root: Path, overrides: dict[str, str]):
        self.name = f"{deployment['metadata']['name']}-smoke"
        spec = kube.pod_spec(deployment)
        (self.container,) = spec["containers"]
        env = kube.resolve_env(self.container, manifests, pod_name=self.name)
        # pydantic ignores unknown RSINFER_* variables: a renamed setting must fail here, not be dropped
        self.role = role = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        fields = {f"RSINFER_{f.upper()}" for f in SETTINGS[role].model_fields} | NON_SETTINGS_ENV
        unknown = sorted(k for k in env if k.startswith("RSINFER_") and k not in fields)
        assert not unknown, f"{self.name}: no {role} setting reads {unknown}"
        # overrides replace what the chart sets; they never add what it forgot
        forgotten = sorted(set(overrides) - set(env) - MAY_BE_UNSET)
        assert not forgotten, f"{self.name}: the chart does not set {forgotten}"
        # emptyDir volumes become local folders; env values under their mount paths follow them
        empty = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        mounts = {}
        for m in self.container.get("volumeMounts", []):
            if m["name"] in empty and m["mountPath"] != "/dev/shm":
                local = root / self.name / m["name"]
                local.mkdir(parents=True, exist_ok=True)
                mounts[m["mountPath"]] = str(local)
        for key, value in env.items():
            for mount_path, local in mounts.items():
                if value == mount_path or value.startswith(mount_path + "/"):
                    env[key] = local + value[len(mount_path):]
        env.update(overrides)
        self.env = env
        self.log_path = root / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

    def process_env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
        return {**base, **self.env}

    def start(self) -> None:
        argv = _rsinfer_argv(self.container["command"] + self.container.get("args", []))
        log = open(self.log_path, "ab")  # noqa: SIM115  (owned by the child)
        self.proc = subprocess.Popen(argv, env=self.process_env(), stdout=log, stderr=subprocess.STDOUT)

    def exec_probe(self, probe: str) -> subprocess.CompletedProcess:
        return self.exec(self.container[probe]["exec"]["command"], self.container[probe].get("timeoutSeconds", 10))

    def exec_hook(self, hook: str) -> subprocess.CompletedProcess:
        return self.exec(self.container["lifecycle"][hook]["exec"]["command"], 10)

    def exec(self, command: list[str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(_rsinfer_argv(command), env=self.process_env(), capture_output=True, text=True,
                              timeout=timeout + 20)

    def log_tail(self, lines: int = 25) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _get(url: str, timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


class Pods:
    """The chart's Deployments as local processes: the API and the demo pool's workers."""

    def __init__(self, manifests: list[dict], tmp_path: Path, common: dict[str, str], model: dict[str, str]):
        deployments = kube.by_kind(manifests, "Deployment")
        api_dep = deployments.pop("rs-rsinfer-api")
        assert sorted(deployments) == ["rs-rsinfer-demo-detokenizer", "rs-rsinfer-demo-scheduler",
                                       "rs-rsinfer-demo-tokenizer"]
        self.port = _free_port()
        self.api = Pod(api_dep, manifests, tmp_path, {**common, "RSINFER_PORT": str(self.port)})
        assert str(self.api.container["ports"][0]["containerPort"]) == kube.resolve_env(
            self.api.container, manifests, "p")["RSINFER_PORT"], "the chart's containerPort is the port the API uses"
        self.workers = [Pod(dep, manifests, tmp_path, {**model, "RSINFER_METRICS_PORT": str(_free_port())})
                        for dep in deployments.values()]
        for w in self.workers:
            assert w.env["RSINFER_SERVED_MODEL_NAME"] == "rsinfer-demo"  # as rendered: only the path moves
            (metrics_port,) = [p["containerPort"] for p in w.container["ports"] if p["name"] == "metrics"]
            assert str(metrics_port) == kube.resolve_env(w.container, manifests, "p")["RSINFER_METRICS_PORT"], \
                f"{w.name}: the `metrics` containerPort is the port the worker serves on"
        self.all = [*self.workers, self.api]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (exit {p.proc.poll() if p.proc else None}):\n{p.log_tail()}"
                         for p in self.all)

    def wait(self, what: str, check) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not check():
            dead = [p.name for p in self.all if p.proc and p.proc.poll() is not None]
            assert not dead, f"processes exited: {dead}\n{self.logs()}"
            assert time.monotonic() < deadline, f"{what} not within {READY_TIMEOUT_S}s\n{self.logs()}"
            time.sleep(0.5)

    def stop(self) -> None:
        for pod in self.all:
            if pod.proc and pod.proc.poll() is None:
                pod.proc.terminate()
        for pod in self.all:
            if pod.proc:
                try:
                    pod.proc.wait(30)
                except subprocess.TimeoutExpired:
                    pod.proc.kill()
                    pod.proc.wait()


def test_rendered_deployments_serve_a_chat_completion(manifests, local_redis, demo_model_dir, tmp_path, collector,
                                                      monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's export delay: spans within the test
    common = {"RSINFER_REDIS_URL": local_redis, "RSINFER_OTLP_ENDPOINT": collector.url}
    model = {**common, "RSINFER_MODEL": str(demo_model_dir), "RSINFER_SERVED_MODEL_NAME": "rsinfer-demo"}
    pods = Pods(manifests, tmp_path, common, model)
    base = f"http://127.0.0.1:{pods.port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    try:
        # the API alone is ready (its readinessProbe needs no worker) and knows the pool's model (RSINFER_MODELS)
        pods.api.start()
        pods.wait("/ready 200", lambda: _get_ready(base) == 200)
        assert client.models.retrieve("rsinfer-demo").state == "scaled_to_zero"
        for w in pods.workers:
            w.start()
        pods.wait("every stage of rsinfer-demo live", lambda: client.models.retrieve("rsinfer-demo").state == "ready")
        assert _get(f"{base}{pods.api.container['livenessProbe']['httpGet']['path']}") == 200

        reply = client.chat.completions.create(
            model="rsinfer-demo", messages=[{"role": "user", "content": "Hello from Kubernetes"}],
            max_tokens=8, temperature=0)
        assert reply.choices[0].message.content, f"empty answer: {reply}\n{pods.logs()}"
        assert reply.usage.completion_tokens > 0
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()

        # tracing.otlpEndpoint: every process exported its span of this request, all in one trace
        uid = reply.id.removeprefix("chatcmpl-")
        wait_for(lambda: {s["service"] for s in collector.of_request(uid)} >= SERVICES, timeout=20, every=0.1)
        assert len({s["trace"] for s in collector.of_request(uid)}) == 1

        _check_worker_metrics(pods.workers)
        _check_worker_probes(pods.workers)

        # the preStop hook: the API stops being ready before SIGTERM
        hook = pods.api.exec_hook("preStop")
        assert hook.returncode == 0, f"preStop: {hook.stdout}{hook.stderr}"
        assert _get_ready(base) == 503
    finally:
        pods.stop()


def _check_worker_metrics(workers: list[Pod]) -> None:
    """metrics.workers: each worker serves its own /metrics, counting the entry it took and passed on."""
    expected = {"tokenizer": 'faststream_received_messages_total{app_name="rsinfer-tokenizer"',
                "scheduler": 'rsinfer_stage_consumed_entries_total{role="scheduler",stream="schedule"} 1.0',
                "detokenizer": 'rsinfer_stage_published_entries_total{role="detokenizer",stream="reply"}'}
    for w in workers:
        text = _scrape(w.env["RSINFER_METRICS_PORT"])
        assert expected[w.role] in text, f"{w.name} /metrics:\n{text[-2000:]}"


def _check_worker_probes(workers: list[Pod]) -> None:
    """The workers' rendered probes (rsinfer healthcheck; --ready for readiness) pass against the live workers."""
    for w in workers:
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = w.exec_probe(kind)
            assert probe.returncode == 0, f"{w.name} {kind}: {probe.stdout}{probe.stderr}"


def _scrape(port: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _get_ready(base: str) -> int:
    try:
        return _get(f"{base}/ready", timeout=2)
    except OSError:
        return 0
