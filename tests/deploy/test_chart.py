"""The Helm chart: lint, render for every example values file, validate, and check what it promises."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import socket
import subprocess
from urllib.parse import urlparse

import pytest
import redis
import yaml

from rsinfer.cli import build_parser
from rsinfer.redis_server import wait_until_up
from shared.settings import ApiSettings, DetokenizerSettings, SchedulerSettings, TokenizerSettings
from tests.deploy import helmbin, kube

pytestmark = pytest.mark.timeout(60)

CI = helmbin.CHART / "ci"
VALUES = {
    "defaults": [],
    "external-redis": [CI / "external-redis-values.yaml"],
    "internal-redis": [CI / "internal-redis-values.yaml"],
    "keda": [CI / "keda-values.yaml"],
    "two-pools": [CI / "two-pools-values.yaml"],
    "cpu": [CI / "cpu-values.yaml"],
    "keda-external-tls": [CI / "keda-values.yaml", CI / "external-redis-values.yaml"],
    "redis-cluster": [CI / "redis-cluster-values.yaml"],
    "scale-to-zero": [CI / "scale-to-zero-values.yaml"],
}
CASES = pytest.mark.parametrize("case", list(VALUES))
STAGES = ("tokenizer", "scheduler", "detokenizer")
SETTINGS = {"api": ApiSettings, "tokenizer": TokenizerSettings, "scheduler": SchedulerSettings,
            "detokenizer": DetokenizerSettings}
STREAMS = {"tokenizer": "tokenize", "scheduler": "schedule", "detokenizer": "detokenize"}
# Environment the code reads outside its settings classes.
NON_SETTINGS_ENV = {"RSINFER_CACHE"}


def pools_of(case: str) -> list[dict]:
    pools = yaml.safe_load((helmbin.CHART / "values.yaml").read_text())["modelPools"]
    for path in VALUES[case]:
        pools = yaml.safe_load(path.read_text()).get("modelPools", pools)
    return pools


def component(doc: dict) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def config(docs: list[dict]) -> dict:
    (cm,) = kube.by_kind(docs, "ConfigMap").values()
    return cm["data"]


# ---------- lint and schema validation ----------

@CASES
def test_helm_lint_strict(helm_bin, case):
    args = helmbin.template_args(VALUES[case])
    proc = helmbin.helm("lint", "--strict", str(helmbin.CHART), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@CASES
def test_every_manifest_validates(render, case):
    docs = render(VALUES[case])
    assert docs
    for doc in docs:
        try:
            kube.validate(doc)
        except Exception as exc:  # name the object in the failure
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc}")


@CASES
def test_names_are_unique_and_short(render, case):
    seen = set()
    for doc in render(VALUES[case]):
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in seen, key
        seen.add(key)
        assert len(doc["metadata"]["name"]) <= 63


# ---------- what every pod gets ----------

@CASES
def test_every_container_requests_resources(render, case):
    for doc in render(VALUES[case]):
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for c in kube.containers(doc):
                requests = c.get("resources", {}).get("requests", {})
                assert {"cpu", "memory"} <= set(requests), (doc["metadata"]["name"], c["name"])


@CASES
def test_secure_defaults(render, case):
    docs = render(VALUES[case])
    for sa in kube.by_kind(docs, "ServiceAccount").values():
        assert sa["automountServiceAccountToken"] is False
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = kube.pod_spec(doc)
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in kube.containers(doc):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, "a read-only root filesystem needs a writable /tmp"


@CASES
def test_config_and_secret_references_resolve(render, case):
    docs = render(VALUES[case])
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for c in kube.containers(doc):
                kube.resolve_env(c, docs, pod_name="pod-0")  # raises on a dangling required reference


# ---------- the processes: what the chart runs is what the CLI accepts ----------

@CASES
def test_one_deployment_per_stage_per_pool(render, case):
    deployments = kube.by_kind(render(VALUES[case]), "Deployment")
    expected = {"rs-rsinfer-api"} | {f"rs-rsinfer-{p['name']}-{s}" for p in pools_of(case) for s in STAGES}
    assert set(deployments) == expected
    image = {c["image"] for d in deployments.values() for c in kube.containers(d)}
    assert image == {"rsinfer:0.1.0"}, "every stage runs the same image"


@CASES
def test_commands_probes_and_env_match_the_cli(render, case):
    docs = render(VALUES[case])
    parser = build_parser()
    for name, dep in kube.by_kind(docs, "Deployment").items():
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        role = component(dep)
        assert c["command"] == ["rsinfer", role], name
        parser.parse_args(c["command"][1:] + c.get("args", []))
        env = kube.resolve_env(c, docs, pod_name=f"{name}-abc")
        assert env["RSINFER_WORKER_ID"] == f"{name}-abc"
        fields = {f"RSINFER_{f.upper()}" for f in SETTINGS[role].model_fields}
        unknown = {k for k in env if k.startswith("RSINFER_")} - fields - NON_SETTINGS_ENV
        assert not unknown, f"{name}: no {role} setting reads {sorted(unknown)}"
        # the settings class accepts every value the chart gives it
        SETTINGS[role](**{k.removeprefix("RSINFER_").lower(): v for k, v in env.items()
                          if k in fields and k != "RSINFER_REDIS_URL"})
        if role != "api":
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                cmd = c[probe]["exec"]["command"]
                assert cmd[:2] == ["rsinfer", "healthcheck"], cmd
                args = parser.parse_args(cmd[1:])
                assert args.role == role, shlex.join(cmd)
                # liveness never asks Redis (an outage must restart no worker); readiness does
                assert args.ready == (probe == "readinessProbe"), shlex.join(cmd)


# ---------- api ----------

def test_api_service_probes_and_graceful_shutdown(render):
    docs = render([], sets=["objectStorage.url=s3://files/rsinfer"])
    api = kube.by_kind(docs, "Deployment")["rs-rsinfer-api"]
    spec = kube.pod_spec(api)
    (c,) = spec["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]  # inside the pod: the API's control socket in /tmp
    assert pre_stop[:3] == ["rsinfer", "drain", "--wait"]
    build_parser().parse_args(pre_stop[1:])
    drain = float(pre_stop[3])
    grace = float(config(docs)["api.RSINFER_GRACE_PERIOD_S"])
    assert spec["terminationGracePeriodSeconds"] > drain + grace
    # a drain SIGTERM does not follow within the pod's grace period is undone (back in service)
    assert float(config(docs)["api.RSINFER_DRAIN_TIMEOUT_S"]) == spec["terminationGracePeriodSeconds"]
    assert all(p.get("httpGet", {}).get("path") != "/drain" for p in (c["readinessProbe"], c["livenessProbe"]))
    assert c["ports"][0]["containerPort"] == int(config(docs)["api.RSINFER_PORT"]) == 8000
    # the HPA owns the replica count; the PDB keeps some pods through node drains
    assert "replicas" not in api["spec"]
    (hpa,) = kube.by_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"]["name"] == "rs-rsinfer-api"
    (pdb,) = kube.by_kind(docs, "PodDisruptionBudget").values()
    assert pdb["spec"]["selector"]["matchLabels"] == api["spec"]["selector"]["matchLabels"]
    (svc,) = [s for s in kube.by_kind(docs, "Service").values() if component(s) == "api"]
    assert svc["spec"]["selector"] == api["spec"]["selector"]["matchLabels"]


def test_api_fixed_replicas_without_hpa(render):
    docs = render(VALUES["cpu"])
    assert kube.by_kind(docs, "Deployment")["rs-rsinfer-api"]["spec"]["replicas"] == 1
    assert not kube.by_kind(docs, "HorizontalPodAutoscaler")


def test_without_object_storage_the_api_is_one_pod_with_a_bounded_cache(render):
    """The Files and Batch APIs keep files in the API pod's cache directory when objectStorage.url is empty: by
    default one API pod then (with a url: two, and the HPA), and the cache emptyDir has a sizeLimit."""
    docs = render([])
    api = kube.by_kind(docs, "Deployment")["rs-rsinfer-api"]
    assert api["spec"]["replicas"] == 1 and not kube.by_kind(docs, "HorizontalPodAutoscaler")
    for dep in kube.by_kind(docs, "Deployment").values():
        (cache,) = [v for v in kube.pod_spec(dep)["volumes"] if v["name"] == "cache"]
        assert cache["emptyDir"]["sizeLimit"] == "20Gi", dep["metadata"]["name"]
    docs = render([], sets=["objectStorage.url=s3://files/rsinfer", "api.autoscaling.enabled=false"])
    assert kube.by_kind(docs, "Deployment")["rs-rsinfer-api"]["spec"]["replicas"] == 2
    docs = render([], sets=["podCache.sizeLimit=5Gi"])
    (cache,) = [v for v in kube.pod_spec(kube.by_kind(docs, "Deployment")["rs-rsinfer-api"])["volumes"]
                if v["name"] == "cache"]
    assert cache["emptyDir"]["sizeLimit"] == "5Gi"


@pytest.mark.parametrize("sets", [["api.replicas=2"], ["api.autoscaling.enabled=true"]])
def test_several_api_pods_without_object_storage_do_not_render(helm_bin, sets):
    args = [a for s in sets for a in ("--set", s)]
    proc = helmbin.helm("template", "rs", str(helmbin.CHART), *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "objectStorage.url is empty" in out and "objectStorage.allowPerPod" in out
    ok = helmbin.helm("template", "rs", str(helmbin.CHART), *args, "--set", "objectStorage.allowPerPod=true")
    assert ok.returncode == 0, ok.stderr


def test_ingress_and_service_monitor(render):
    docs = render(VALUES["external-redis"])
    (ing,) = kube.by_kind(docs, "Ingress").values()
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "rs-rsinfer-api", "port": {"name": "http"}}
    sm = kube.by_kind(docs, "ServiceMonitor")["rs-rsinfer-api"]
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    api_services = [s for s in kube.by_kind(docs, "Service").values() if selects(sm["spec"]["selector"], s)]
    assert [s["metadata"]["name"] for s in api_services] == ["rs-rsinfer-api"]


def test_the_ingress_routes_the_api_not_its_metrics(render):
    """/metrics (tenants' names and usage for an admin key) stays inside the cluster: the default paths are the
    API's routes, and a path that would route /metrics is refused at render."""
    docs = render(sets=["api.ingress.enabled=true"])
    (ing,) = kube.by_kind(docs, "Ingress").values()
    paths = {p["path"]: p["pathType"] for p in ing["spec"]["rules"][0]["http"]["paths"]}
    assert paths == {"/v1": "Prefix", "/generate": "Exact", "/tokenize": "Exact", "/detokenize": "Exact"}
    assert not [p for p in paths if p == "/" or p.startswith("/metrics")]
    for path, kind in (("/", "Prefix"), ("/", "ImplementationSpecific"), ("/metrics", "Exact")):
        hosts = [{"host": "x.example.com", "paths": [{"path": path, "pathType": kind}]}]
        with pytest.raises(helmbin.RenderError, match="would route the API's /metrics"):
            render(sets=["api.ingress.enabled=true"], set_json=[f"api.ingress.hosts={json.dumps(hosts)}"])
    sm = kube.by_kind(render(set_json=['metrics.serviceMonitor={"enabled": true, "authorization": {"type": '
                                       '"Bearer", "credentials": {"name": "ops-key", "key": "key"}}}']),
                      "ServiceMonitor")["rs-rsinfer-api"]
    assert sm["spec"]["endpoints"][0]["authorization"]["credentials"] == {"name": "ops-key", "key": "key"}


def test_a_short_api_key_is_refused_at_render(render):
    with pytest.raises(helmbin.RenderError, match=r"auth\.apiKey: at least 32 characters"):
        render(sets=["auth.apiKey=sk-short"])


@pytest.mark.parametrize(("sets", "workers"), [
    ([], "1"),  # the default request, 500m: one process
    (["api.resources.requests.cpu=2500m"], "2"),
    (["api.resources.requests.cpu=4"], "4"),
    (["api.resources.requests.cpu=1.5"], "1"),
    (["api.resources.requests.cpu=4", "api.workers=3"], "3"),
])
def test_api_workers_default_to_the_whole_cores_of_the_cpu_request(render, sets, workers):
    env = config(render(sets=sets))
    assert env["api.RSINFER_API_WORKERS"] == workers
    assert ApiSettings(api_workers=env["api.RSINFER_API_WORKERS"]).api_workers == int(workers)


def test_termination_grace_must_cover_drain_and_grace(render):
    with pytest.raises(helmbin.RenderError, match="terminationGracePeriodSeconds"):
        render(sets=["api.terminationGracePeriodSeconds=15"])
    docs = render(sets=["api.terminationGracePeriodSeconds=120"])
    assert kube.pod_spec(kube.by_kind(docs, "Deployment")["rs-rsinfer-api"])[
        "terminationGracePeriodSeconds"] == 120
    assert config(docs)["api.RSINFER_DRAIN_TIMEOUT_S"] == "120"
    assert config(render(sets=["api.settings.drain_timeout_s=300"]))["api.RSINFER_DRAIN_TIMEOUT_S"] == "300"
    with pytest.raises(helmbin.RenderError, match="drain_timeout_s"):
        render(sets=["api.settings.drain_timeout_s=5"])  # undone before the hook's 10 s are over


# ---------- metrics and tracing ----------

def selects(selector: dict, obj: dict) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) selects `obj`."""
    labels = obj["metadata"].get("labels", {})
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def workers_of(docs: list[dict]) -> dict[str, dict]:
    return {n: d for n, d in kube.by_kind(docs, "Deployment").items() if component(d) in STAGES}


def metrics_port(container: dict) -> int | None:
    ports = [p["containerPort"] for p in container.get("ports", []) if p["name"] == "metrics"]
    return ports[0] if ports else None


@CASES
def test_every_worker_serves_metrics_on_its_named_port(render, case):
    """metrics.workers is on by default: each worker gets RSINFER_METRICS_PORT and a `metrics` containerPort
    on that port; the API (whose /metrics is on its http port) gets neither."""
    docs = render(VALUES[case])
    for name, dep in kube.by_kind(docs, "Deployment").items():
        (c,) = kube.pod_spec(dep)["containers"]
        env = kube.resolve_env(c, docs, "p")
        if component(dep) == "api":
            assert "RSINFER_METRICS_PORT" not in env and metrics_port(c) is None
            continue
        assert env["RSINFER_METRICS_PORT"] == "9100", name
        assert metrics_port(c) == 9100, name


def test_worker_metrics_port_is_configurable_and_can_be_turned_off(render):
    docs = render(sets=["metrics.workers.port=9464", "metrics.serviceMonitor.enabled=true"])
    for dep in workers_of(docs).values():
        (c,) = kube.pod_spec(dep)["containers"]
        assert kube.resolve_env(c, docs, "p")["RSINFER_METRICS_PORT"] == "9464"
        assert metrics_port(c) == 9464
    assert {s["spec"]["ports"][0]["port"] for s in kube.by_kind(docs, "Service").values()
            if component(s) in STAGES} == {9464}

    docs = render(sets=["metrics.workers.enabled=false", "metrics.serviceMonitor.enabled=true"])
    for name, dep in workers_of(docs).items():
        (c,) = kube.pod_spec(dep)["containers"]
        assert "RSINFER_METRICS_PORT" not in kube.resolve_env(c, docs, "p"), name
        assert "ports" not in c, name
    assert set(kube.by_kind(docs, "ServiceMonitor")) == {"rs-rsinfer-api"}, "no worker targets to scrape"
    assert all(component(s) not in STAGES for s in kube.by_kind(docs, "Service").values())


def test_no_worker_services_without_the_service_monitor(render):
    docs = render([])
    assert not kube.by_kind(docs, "ServiceMonitor")
    assert all(component(s) not in STAGES for s in kube.by_kind(docs, "Service").values())


def test_service_monitor_scrapes_every_worker(render):
    """With the ServiceMonitor on: a headless Service per stage Deployment selecting exactly its pods, with
    a `metrics` port on the pods' `metrics` containerPort; a second ServiceMonitor selecting exactly these
    Services, scraping /metrics on that port and labelling each series with the pod's pool."""
    docs = render(VALUES["two-pools"], sets=["metrics.serviceMonitor.enabled=true",
                                             "metrics.serviceMonitor.labels.release=prom"])
    for doc in docs:
        kube.validate(doc)
    services = kube.by_kind(docs, "Service")
    workers = workers_of(docs)
    assert len(workers) == 6
    for name, dep in workers.items():
        svc = services[name]
        assert svc["spec"]["clusterIP"] == "None", "headless: only for discovery"
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        assert selects({"matchLabels": svc["spec"]["selector"]}, dep["spec"]["template"])
        (port,) = svc["spec"]["ports"]
        assert (port["name"], port["targetPort"]) == ("metrics", "metrics")
        assert port["port"] == metrics_port(kube.pod_spec(dep)["containers"][0])
        # no other Deployment's pods behind this Service (pools and stages apart)
        others = [n for n, d in kube.by_kind(docs, "Deployment").items()
                  if n != name and selects({"matchLabels": svc["spec"]["selector"]}, d["spec"]["template"])]
        assert not others, (name, others)

    sm = kube.by_kind(docs, "ServiceMonitor")["rs-rsinfer-workers"]
    assert sm["metadata"]["labels"]["release"] == "prom"
    scraped = {n for n, s in services.items() if selects(sm["spec"]["selector"], s)}
    assert scraped == set(workers), "the worker Services, not the API's or Redis's"
    (endpoint,) = sm["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("15s", "10s")
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_rsinfer_io_pool"], "targetLabel": "pool"} in \
        endpoint["relabelings"]
    assert all("rsinfer.io/pool" in d["spec"]["template"]["metadata"]["labels"] for d in workers.values())
    api_sm = kube.by_kind(docs, "ServiceMonitor")["rs-rsinfer-api"]
    assert {n for n, s in services.items() if selects(api_sm["spec"]["selector"], s)} == {"rs-rsinfer-api"}


def test_tracing_endpoint_reaches_every_process(render):
    endpoint = "http://otel-collector.observability:4318"
    docs = render(sets=[f"tracing.otlpEndpoint={endpoint}"])
    deployments = kube.by_kind(docs, "Deployment")
    assert {component(d) for d in deployments.values()} == {"api", *STAGES}
    for name, dep in deployments.items():
        env = kube.resolve_env(kube.pod_spec(dep)["containers"][0], docs, "p")
        assert env["RSINFER_OTLP_ENDPOINT"] == endpoint, name
        SETTINGS[component(dep)](otlp_endpoint=env["RSINFER_OTLP_ENDPOINT"])
    docs = render([])
    for name, dep in kube.by_kind(docs, "Deployment").items():
        assert "RSINFER_OTLP_ENDPOINT" not in kube.resolve_env(kube.pod_spec(dep)["containers"][0], docs, "p"), \
            f"{name}: tracing is off by default"


def test_object_storage_reaches_every_process(render):
    """Batch files and adapters: every API and scheduler pod shares the bucket, with its credentials."""
    docs = render(sets=["objectStorage.url=s3://files/rsinfer", "objectStorage.endpointUrl=http://minio:9000",
                        "objectStorage.addressingStyle=path", "objectStorage.credentialsSecret=s3-creds"])
    for name, dep in kube.by_kind(docs, "Deployment").items():
        container = kube.pod_spec(dep)["containers"][0]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in
                e.get("valueFrom", {})}
        # the credentials' Secret is the user's, not the chart's: the rest resolves from the chart
        ours = {**container, "env": [e for e in container["env"] if not e["name"].startswith("AWS_")]}
        env = kube.resolve_env(ours, docs, "p")
        assert env["RSINFER_STORAGE_URL"] == "s3://files/rsinfer", name
        assert env["RSINFER_STORAGE_ENDPOINT_URL"] == "http://minio:9000"
        assert env["RSINFER_STORAGE_ADDRESSING_STYLE"] == "path"
        assert refs["AWS_ACCESS_KEY_ID"] == {"name": "s3-creds", "key": "access-key-id"}
        assert refs["AWS_SECRET_ACCESS_KEY"]["name"] == "s3-creds"
        SETTINGS[component(dep)](storage_url=env["RSINFER_STORAGE_URL"])
    docs = render([])
    for dep in kube.by_kind(docs, "Deployment").values():
        env = kube.resolve_env(kube.pod_spec(dep)["containers"][0], docs, "p")
        assert "RSINFER_STORAGE_URL" not in env and "AWS_ACCESS_KEY_ID" not in env


# ---------- scheduler: GPUs, model, shared memory ----------

def scheduler(docs, pool="demo"):
    return kube.by_kind(docs, "Deployment")[f"rs-rsinfer-{pool}-scheduler"]


def test_scheduler_gets_a_gpu_by_default_and_none_on_cpu(render):
    dep = scheduler(render([]))
    (c,) = kube.pod_spec(dep)["containers"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        kube.pod_spec(dep)["tolerations"]
    shm = next(v for v in kube.pod_spec(dep)["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]

    docs = render(VALUES["cpu"])
    (c,) = kube.pod_spec(scheduler(docs))["containers"]
    assert "nvidia.com/gpu" not in str(c["resources"])
    assert "tolerations" not in kube.pod_spec(scheduler(docs))
    assert config(docs)["demo.scheduler.RSINFER_DEVICE"] == "cpu"
    # tokenizers never ask for GPUs
    for dep in kube.by_kind(docs, "Deployment").values():
        if component(dep) != "scheduler":
            assert "nvidia.com/gpu" not in str(dep)


def test_a_tensor_parallel_scheduler_gets_a_gpu_per_rank_and_its_shared_memory(render):
    docs = render(sets=["stages.scheduler.settings.tensor_parallel_size=4", "stages.scheduler.shmSize=8Gi"])
    spec = kube.pod_spec(scheduler(docs))
    (c,) = spec["containers"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 4 and c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert next(v for v in spec["volumes"] if v["name"] == "shm")["emptyDir"] == {"medium": "Memory",
                                                                                  "sizeLimit": "8Gi"}
    assert config(docs)["demo.scheduler.RSINFER_TENSOR_PARALLEL_SIZE"] == "4"


def test_model_sources(render):
    docs = render(VALUES["internal-redis"])
    for stage in STAGES:
        dep = kube.by_kind(docs, "Deployment")[f"rs-rsinfer-qwen3-{stage}"]
        env = kube.resolve_env(kube.pod_spec(dep)["containers"][0], docs, "p")
        assert env["RSINFER_MODEL"] == "/models/Qwen3-8B"
        assert env["RSINFER_SERVED_MODEL_NAME"] == "Qwen/Qwen3-8B"
        assert env["HF_HUB_OFFLINE"] == "1"
        vol = next(v for v in kube.pod_spec(dep)["volumes"] if v["name"] == "model")
        assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}

    docs = render(VALUES["two-pools"])
    big = scheduler(docs, "big")
    (c,) = kube.pod_spec(big)["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert kube.pod_spec(big)["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    vol = next(v for v in kube.pod_spec(big)["volumes"] if v["name"] == "model")
    assert vol["nfs"]["server"] == "nfs.example.internal"
    env = kube.resolve_env(c, docs, "p")
    assert env["RSINFER_MODEL"] == "/models/Llama-3.3-70B-Instruct"
    assert env["RSINFER_DTYPE"] == "bfloat16" and env["RSINFER_MAX_RUNNING"] == "128"

    small = scheduler(docs, "small")
    env = kube.resolve_env(kube.pod_spec(small)["containers"][0], docs, "p")
    assert env["RSINFER_MODEL"] == "Qwen/Qwen3-0.6B"
    assert env["HF_HOME"].startswith("/var/cache/rsinfer")
    assert env["RSINFER_KV_MEMORY_FRACTION"] == "0.5" and env["RSINFER_CUDA_GRAPHS"] == "true"
    # pool overrides stay in their pool
    assert kube.by_kind(docs, "Deployment")["rs-rsinfer-small-tokenizer"]["spec"]["replicas"] == 2
    assert kube.by_kind(docs, "Deployment")["rs-rsinfer-big-tokenizer"]["spec"]["replicas"] == 1
    tokenizers = {pool: kube.resolve_env(kube.pod_spec(kube.by_kind(docs, "Deployment")[
        f"rs-rsinfer-{pool}-tokenizer"])["containers"][0], docs, "p") for pool in ("big", "small")}
    assert tokenizers["big"]["RSINFER_PREFIX_ROUTING"] == "true"  # the value that turns prefix routing on
    assert "RSINFER_PREFIX_ROUTING" not in tokenizers["small"]

    docs = render([])
    env = kube.resolve_env(kube.pod_spec(scheduler(docs))["containers"][0], docs, "p")
    assert "RSINFER_MODEL" not in env, "the demo pool runs the built-in demo model"
    assert env["RSINFER_SERVED_MODEL_NAME"] == "rsinfer-demo"


# ---------- scheduler: warm-up and the kernel cache ----------

KERNELS = "/var/cache/rsinfer/kernels"
KERNEL_ENV = ("FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH",
              "XDG_CACHE_HOME")


def test_scheduler_startup_probe_allows_loading_and_warm_up(render):
    """The worker writes its heartbeat only after the engine's warm-up (kernels compile then), and the
    liveness probe starts only once the startup probe saw it: the startup budget covers both."""
    (c,) = kube.pod_spec(scheduler(render([])))["containers"]
    probe = c["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 30 * 60
    assert "initialDelaySeconds" not in c["livenessProbe"], "liveness waits for the startup probe, not a guess"


def test_kernel_caches_sit_in_one_directory_of_the_pod_cache_by_default(render):
    docs = render([])
    for dep in kube.by_kind(docs, "Deployment").values():
        (c,) = kube.pod_spec(dep)["containers"]
        env = kube.resolve_env(c, docs, "p")
        if component(dep) != "scheduler":
            assert not set(KERNEL_ENV) & set(env), "only the scheduler compiles kernels"
            continue
        for name in KERNEL_ENV:
            assert env[name].startswith(KERNELS), name
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/var/cache/rsinfer"] == "cache" and KERNELS not in mounts, "on the pod's emptyDir"
    assert not kube.by_kind(docs, "PersistentVolumeClaim")


def test_persistent_kernel_cache_made_by_the_chart_or_an_existing_claim(render):
    docs = render(VALUES["two-pools"])
    (pvc,) = kube.by_kind(docs, "PersistentVolumeClaim").values()
    kube.validate(pvc)
    assert pvc["metadata"]["name"] == "rs-rsinfer-big-kernel-cache"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert pvc["spec"]["storageClassName"] == "fast-ssd" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for pool, claim in (("big", "rs-rsinfer-big-kernel-cache"), ("small", "compiled-kernels")):
        spec = kube.pod_spec(scheduler(docs, pool))
        assert {"name": "kernel-cache", "persistentVolumeClaim": {"claimName": claim}} in spec["volumes"]
        (c,) = spec["containers"]
        assert {"name": "kernel-cache", "mountPath": KERNELS} in c["volumeMounts"]
        assert kube.resolve_env(c, docs, "p")["FLASHINFER_WORKSPACE_BASE"] == KERNELS
        tokenizer = kube.by_kind(docs, "Deployment")[f"rs-rsinfer-{pool}-tokenizer"]
        assert "kernel-cache" not in str(kube.pod_spec(tokenizer))


# ---------- KEDA ----------

@CASES
def test_keda_scaled_objects(render, case):
    docs = render(VALUES[case])
    deployments = kube.by_kind(docs, "Deployment")
    hpas = kube.by_kind(docs, "HorizontalPodAutoscaler").values()
    hpa_targets = {h["spec"]["scaleTargetRef"]["name"] for h in hpas}
    scaled = kube.by_kind(docs, "ScaledObject")
    auths = kube.by_kind(docs, "TriggerAuthentication")
    cfg = config(docs)
    url = urlparse(cfg["RSINFER_REDIS_URL"])
    for so in scaled.values():
        target = so["spec"]["scaleTargetRef"]["name"]
        dep = deployments[target]
        stage = component(dep)
        assert stage in STAGES
        assert "replicas" not in dep["spec"], f"{target} is scaled by KEDA: no fixed replicas"
        assert target not in hpa_targets, f"{target} is scaled by KEDA: no HPA"
        trigger = so["spec"]["triggers"][0]
        cluster = cfg["RSINFER_REDIS_CLUSTER"] == "yes"
        assert trigger["name"] == "backlog"
        meta = trigger["metadata"]
        served = kube.resolve_env(kube.pod_spec(dep)["containers"][0], docs, "p")["RSINFER_SERVED_MODEL_NAME"]
        assert meta["stream"] == f"{cfg['RSINFER_NAMESPACE']}:{STREAMS[stage]}:{served}"
        assert meta["consumerGroup"] == stage
        assert int(meta["lagCount"]) >= 1, "lagCount mode (scale to zero capable, Redis 7+)"
        for trigger in so["spec"]["triggers"]:
            meta = trigger["metadata"]
            assert trigger["type"] == ("redis-cluster-streams" if cluster else "redis-streams")
            assert all(isinstance(v, str) for v in meta.values()), meta
            host = url.netloc.rsplit("@", 1)[-1]
            if cluster:  # the scaler finds each stream's node from these; a cluster has database 0 only
                assert meta["addresses"] and "databaseIndex" not in meta
            else:
                assert meta["address"] == (host if url.port else f"{host}:6379")
                assert meta["databaseIndex"] == (url.path.strip("/") or "0")
            assert (meta.get("enableTLS") == "true") == (url.scheme == "rediss")
            if "authenticationRef" in trigger:
                assert trigger["authenticationRef"]["name"] in auths
    for name, dep in deployments.items():
        if name not in {so["spec"]["scaleTargetRef"]["name"] for so in scaled.values()}:
            assert "replicas" in dep["spec"] or name in hpa_targets, name
    expect_keda = "keda" in case or case in ("scale-to-zero", "redis-cluster")
    assert bool(scaled) == (expect_keda or case == "two-pools")
    if expect_keda:
        assert len(scaled) == 3 * len(pools_of(case))


def test_scale_to_zero_scaled_objects(render):
    """minReplicaCount 0 on every stage: each ScaledObject validates against KEDA's CRD; its backlog trigger
    activates it above activationLagCount; a request waiting for a tokenizer wakes the scheduler and the
    detokenizer too (arrivals); requests a scheduler holds keep every stage active (in-flight, XPENDING of
    the schedule stream), so KEDA never takes the last pod from under a running request; and the HPA
    scales down one pod per termination grace after a window as long as the cooldown, the grace outlasting
    the worker's drain (settings.grace_period_s) so that it hands back what it holds before it is killed."""
    docs = render(VALUES["scale-to-zero"])
    deployments = kube.by_kind(docs, "Deployment")
    scaled = kube.by_kind(docs, "ScaledObject")
    assert len(scaled) == 3
    prefix = config(docs)["RSINFER_NAMESPACE"]
    for so in scaled.values():
        kube.validate(so)
        spec = so["spec"]
        dep = deployments[spec["scaleTargetRef"]["name"]]
        stage = component(dep)
        assert spec["minReplicaCount"] == 0
        triggers = {t["name"]: t["metadata"] for t in spec["triggers"]}
        assert set(triggers) == {"backlog", "in-flight"} | ({"arrivals"} if stage != "tokenizer" else set())
        assert triggers["backlog"]["activationLagCount"] == "0"
        if stage != "tokenizer":
            assert (triggers["arrivals"]["stream"], triggers["arrivals"]["consumerGroup"]) == (
                f"{prefix}:tokenize:rsinfer-demo", "tokenizer")
            assert triggers["arrivals"]["activationLagCount"] == "0"
        held = triggers["in-flight"]
        assert (held["stream"], held["consumerGroup"]) == (f"{prefix}:schedule:rsinfer-demo", "scheduler")
        assert "lagCount" not in held, "pending entries (XPENDING), not lag: requests already in an engine"
        assert int(held["pendingEntriesCount"]) == SchedulerSettings.model_fields["max_running"].default
        scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert scale_down["stabilizationWindowSeconds"] >= spec["cooldownPeriod"]
        grace = kube.pod_spec(dep)["terminationGracePeriodSeconds"]
        assert scale_down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": grace}]
        env = kube.resolve_env(kube.pod_spec(dep)["containers"][0], docs, "p")
        assert grace > float(env.get("RSINFER_GRACE_PERIOD_S", SETTINGS[stage].model_fields["grace_period_s"].default))
    assert kube.pod_spec(scheduler(docs))["terminationGracePeriodSeconds"] == 90
    assert config(docs)["demo.scheduler.RSINFER_GRACE_PERIOD_S"] == "60"


def test_fair_queueing_scales_the_scheduler_on_the_jobs_tokenizers_hold(render):
    """With the tokenizers holding the backlog (fair queueing) the schedule stream's lag stays below their
    watermark: the scheduler scales on the tokenize stream's pending entries too, at its lagCount per replica;
    off (the default), its triggers are as before."""
    docs = render(VALUES["scale-to-zero"], sets=["stages.tokenizer.settings.fair_queueing=true"])
    prefix = config(docs)["RSINFER_NAMESPACE"]
    assert config(docs)["demo.tokenizer.RSINFER_FAIR_QUEUEING"] == "true"
    for so in kube.by_kind(docs, "ScaledObject").values():
        kube.validate(so)
        stage = component(kube.by_kind(docs, "Deployment")[so["spec"]["scaleTargetRef"]["name"]])
        triggers = {t["name"]: t["metadata"] for t in so["spec"]["triggers"]}
        assert ("held" in triggers) == (stage == "scheduler")
        if stage == "scheduler":
            held = triggers["held"]
            assert (held["stream"], held["consumerGroup"]) == (f"{prefix}:tokenize:rsinfer-demo", "tokenizer")
            assert held["pendingEntriesCount"] == triggers["backlog"]["lagCount"] and "lagCount" not in held
    off = render(VALUES["scale-to-zero"])
    assert all("held" not in {t["name"] for t in so["spec"]["triggers"]}
               for so in kube.by_kind(off, "ScaledObject").values())


def test_scale_down_behavior_merges_with_the_users(render):
    """ci/keda-values.yaml gives the scheduler's scale-down window only: the chart's one-pod policy stays;
    a stage kept at one pod or more has only its backlog trigger (nothing to wake)."""
    docs = render(VALUES["keda"])
    so = kube.by_kind(docs, "ScaledObject")["rs-rsinfer-demo-scheduler"]
    scale_down = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert scale_down == {"stabilizationWindowSeconds": 600,
                          "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}
    for so in kube.by_kind(docs, "ScaledObject").values():
        assert so["spec"]["minReplicaCount"] == 1
        assert [t["name"] for t in so["spec"]["triggers"]] == ["backlog"]


@CASES
def test_the_api_knows_every_pools_model(render, case):
    """RSINFER_MODELS: the API takes requests for every pool's model, even one whose stages are at zero."""
    docs = render(VALUES[case])
    api = kube.by_kind(docs, "Deployment")["rs-rsinfer-api"]
    env = kube.resolve_env(kube.pod_spec(api)["containers"][0], docs, "p")
    assert ApiSettings(models=env["RSINFER_MODELS"]).model_names() == tuple(p["servedModelName"]
                                                                          for p in pools_of(case))


def test_keda_auth_uses_the_release_secrets(render):
    docs = render(VALUES["keda-external-tls"])
    (auth,) = kube.by_kind(docs, "TriggerAuthentication").values()
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    assert refs["password"]["name"] == "rsinfer-credentials"
    assert refs["ca"] == {"parameter": "ca", "name": "redis-ca", "key": "ca.crt"}


def test_keda_address_gets_the_default_port(render):
    docs = render(VALUES["keda"], sets=["redis.mode=external", "redis.external.url=redis://red.example/3"])
    for so in kube.by_kind(docs, "ScaledObject").values():
        meta = so["spec"]["triggers"][0]["metadata"]
        assert (meta["address"], meta["databaseIndex"]) == ("red.example:6379", "3")
    assert not kube.by_kind(docs, "TriggerAuthentication"), "no password, no CA: nothing to authenticate"


def test_pool_override_can_turn_keda_off(render):
    docs = render(VALUES["keda"], set_json=[
        'modelPools=[{"name":"a","servedModelName":"a","model":{"source":"demo"},'
        '"scheduler":{"keda":{"enabled":false},"replicas":3}}]'])
    assert {so["spec"]["scaleTargetRef"]["name"] for so in kube.by_kind(docs, "ScaledObject").values()} == {
        "rs-rsinfer-a-tokenizer", "rs-rsinfer-a-detokenizer"}
    assert scheduler(docs, "a")["spec"]["replicas"] == 3


# ---------- Redis ----------

def test_in_chart_redis(render):
    docs = render(VALUES["internal-redis"])
    (sts,) = kube.by_kind(docs, "StatefulSet").values()
    (c,) = kube.pod_spec(sts)["containers"]
    args = c["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert "$(REDIS_PASSWORD)" in args and "--maxmemory" in args
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "fast-ssd"
    env = kube.resolve_env(c, docs, "redis-0")
    assert env["REDIS_PASSWORD"] == env["REDISCLI_AUTH"] == "also-change-me"
    cfg = config(docs)
    # namespace-qualified: KEDA's operator resolves it from its own namespace
    assert cfg["RSINFER_REDIS_URL"] == "redis://rs-rsinfer-redis.llm.svc:6379/0"
    api = kube.by_kind(docs, "Deployment")["rs-rsinfer-api"]
    api_env = kube.resolve_env(kube.pod_spec(api)["containers"][0], docs, "p")
    assert api_env["RSINFER_REDIS_PASSWORD"] == "also-change-me"
    assert api_env["RSINFER_API_KEY"] == "change-me-to-32-or-more-random-characters"

    # no password given: one made for this release, the same for Redis and every client
    docs = render([])
    (sts,) = kube.by_kind(docs, "StatefulSet").values()
    redis_pw = kube.resolve_env(kube.pod_spec(sts)["containers"][0], docs, "redis-0")["REDIS_PASSWORD"]
    assert len(redis_pw) == 32
    api = kube.by_kind(docs, "Deployment")["rs-rsinfer-api"]
    api_env = kube.resolve_env(kube.pod_spec(api)["containers"][0], docs, "p")
    assert api_env["RSINFER_REDIS_PASSWORD"] == redis_pw
    assert "RSINFER_API_KEY" not in api_env


def redis_password(docs: list[dict]) -> str:
    (sts,) = kube.by_kind(docs, "StatefulSet").values()
    return kube.resolve_env(kube.pod_spec(sts)["containers"][0], docs, "redis-0")["REDIS_PASSWORD"]


def pod_annotations(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"].get("annotations", {}) for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")}


def test_gitops_renders_keep_the_redis_password(helm_bin):
    """Rendered without a cluster (helm template, as Argo CD does; lookup sees nothing) and no password given:
    every render gives the same password (a random one per render would change the Secret under running pods on
    every sync, and pods started after it could not log in), one of its own per release; the Secret says where
    it came from. Not cached renders: each one is a new `helm template`."""
    first, second = helmbin.render([]), helmbin.render([])
    assert redis_password(first) == redis_password(second)
    assert redis_password(helmbin.render([], release="other")) != redis_password(first)
    (secret,) = kube.by_kind(first, "Secret").values()
    assert secret["metadata"]["annotations"]["rsinfer.io/redis-password"] == "derived"
    assert pod_annotations(first) == pod_annotations(second), "a re-render must not roll any pod"
    docs = helmbin.render([CI / "internal-redis-values.yaml"])
    (secret,) = kube.by_kind(docs, "Secret").values()
    assert secret["metadata"]["annotations"]["rsinfer.io/redis-password"] == "values"


def test_pod_annotations_carry_no_hash_of_a_secret(render):
    """checksum/secret covers what is known of the secrets without them; auth.secretRevision (or Reloader) rolls
    the pods when a secret changes. Neither a secret nor a sha256 of any combination of them appears outside
    the Secret."""
    api_key, password = "change-me-to-32-or-more-random-characters", "also-change-me"
    docs = render(VALUES["internal-redis"])
    digests = {hashlib.sha256(x.encode()).hexdigest() for x in (
        api_key, password, f"{api_key}|{password}", f"{password}|{api_key}", f"{api_key}{password}")}
    for doc in docs:
        if doc["kind"] == "Secret":
            continue
        text = yaml.safe_dump(doc)
        assert api_key not in text and password not in text, doc["metadata"]["name"]
        assert not [d for d in digests if d in text], doc["metadata"]["name"]
    before = pod_annotations(docs)
    assert all("checksum/secret" in a for a in before.values())
    assert pod_annotations(render(VALUES["internal-redis"], sets=["auth.secretRevision=2024-06-01"])) != before
    assert pod_annotations(render(VALUES["internal-redis"], sets=["auth.apiKey="])) != before, "key on/off rolls"

    docs = render(sets=["auth.reloader=true"])
    for kind in ("Deployment", "StatefulSet"):
        for dep in kube.by_kind(docs, kind).values():
            assert dep["metadata"]["annotations"]["secret.reloader.stakater.com/reload"] == "rs-rsinfer"
    assert all("annotations" not in d["metadata"] for d in kube.by_kind(render([]), "Deployment").values())


def test_redis_only_reachable_from_the_pipeline(render):
    """The NetworkPolicy selects the in-chart Redis's pod only, and lets in exactly this release's rsinfer pods
    (every Deployment's, on the redis port), plus KEDA's namespace when a stage uses KEDA."""
    docs = render([])
    (policy,) = kube.by_kind(docs, "NetworkPolicy").values()
    (sts,) = kube.by_kind(docs, "StatefulSet").values()
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert selects(spec["podSelector"], sts["spec"]["template"])
    deployments = kube.by_kind(docs, "Deployment").values()
    assert not [d for d in deployments if selects(spec["podSelector"], d["spec"]["template"])]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]
    assert "redis" in {p["name"] for p in kube.pod_spec(sts)["containers"][0]["ports"]}
    (peer,) = rule["from"]
    pods = [d["spec"]["template"] for d in kube.by_kind(docs, "Deployment").values()]
    assert len(pods) == 4 and all(selects(peer["podSelector"], p) for p in pods)
    assert not selects(peer["podSelector"], sts["spec"]["template"])
    other_release = {"metadata": {"labels": {**pods[0]["metadata"]["labels"], "app.kubernetes.io/instance": "x"}}}
    assert not selects(peer["podSelector"], other_release)
    assert "namespaceSelector" not in peer, "this namespace only"

    (policy,) = kube.by_kind(render(VALUES["keda"]), "NetworkPolicy").values()
    peers = policy["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}} in peers
    assert not kube.by_kind(render(VALUES["external-redis"]), "NetworkPolicy"), "no in-chart Redis, no policy"
    assert not kube.by_kind(render(sets=["networkPolicy.enabled=false"]), "NetworkPolicy")
    extra = render(set_json=['networkPolicy.extraFrom=[{"podSelector":{"matchLabels":{"app":"exporter"}}}]'])
    (policy,) = kube.by_kind(extra, "NetworkPolicy").values()
    assert {"podSelector": {"matchLabels": {"app": "exporter"}}} in policy["spec"]["ingress"][0]["from"]


def test_redis_memory_is_bounded_with_noeviction(render):
    for case, bound in (("defaults", "1536mb"), ("internal-redis", "4gb")):
        (sts,) = kube.by_kind(render(VALUES[case]), "StatefulSet").values()
        args = kube.pod_spec(sts)["containers"][0]["args"]
        assert args[args.index("--maxmemory") + 1] == bound
        assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
        assert args.count("--maxmemory") == 1
    (sts,) = kube.by_kind(render(sets=["redis.internal.maxmemory=0"]), "StatefulSet").values()
    assert "--maxmemory" not in kube.pod_spec(sts)["containers"][0]["args"]
    with pytest.raises(helmbin.RenderError, match="maxmemory"):
        render(set_json=['redis.internal.extraArgs=["--maxmemory-policy","allkeys-lru"]'])
    with pytest.raises(helmbin.RenderError, match="maxmemory"):
        render(sets=["redis.internal.maxmemory=lots"])


def test_in_chart_redis_command_runs(render, tmp_path):
    """The StatefulSet's redis-server command line, run locally: AOF on, password required."""
    binary = shutil.which("redis-server")
    if not binary:
        pytest.skip("redis-server is not on PATH")
    docs = render(VALUES["internal-redis"])
    (sts,) = kube.by_kind(docs, "StatefulSet").values()
    (c,) = kube.pod_spec(sts)["containers"]
    env = kube.resolve_env(c, docs, "redis-0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]  # kubelet's $(VAR)
    args[args.index("--port") + 1] = str(port)
    args[args.index("--dir") + 1] = str(tmp_path)
    proc = subprocess.Popen([binary, *args, "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=env["REDIS_PASSWORD"], socket_connect_timeout=0.5)
    try:
        wait_until_up(client, proc)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("maxmemory") == {"maxmemory": str(4 << 30)}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def test_external_redis_with_tls(render):
    docs = render(VALUES["external-redis"])
    assert not kube.by_kind(docs, "StatefulSet")
    cfg = config(docs)
    assert cfg["RSINFER_REDIS_URL"] == "rediss://redis.example.internal:6380/2"
    assert cfg["RSINFER_NAMESPACE"] == "team-a"
    assert not kube.by_kind(docs, "Secret"), "auth.existingSecret: the chart makes no Secret"
    for dep in kube.by_kind(docs, "Deployment").values():
        (c,) = kube.pod_spec(dep)["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["RSINFER_REDIS_TLS_CA"]["value"] == "/etc/rsinfer/redis-ca/ca.crt"
        assert env["RSINFER_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "rsinfer-credentials"
        ca_mount = {"name": "redis-ca", "mountPath": "/etc/rsinfer/redis-ca", "readOnly": True}
        assert ca_mount in c["volumeMounts"]


def test_external_redis_cluster_with_tls_password_and_keda(render):
    docs = render(VALUES["redis-cluster"])
    cfg = config(docs)
    assert cfg["RSINFER_REDIS_CLUSTER"] == "yes", "said, not detected: pods may start while Redis is down"
    assert cfg["RSINFER_REDIS_URL"] == "rediss://clustercfg.redis.example.internal:6379/0"
    nodes = ",".join(f"redis-{i}.redis.example.internal:6379" for i in range(3))
    for so in kube.by_kind(docs, "ScaledObject").values():
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "redis-cluster-streams"
        assert trigger["metadata"]["addresses"] == nodes and trigger["metadata"]["enableTLS"] == "true"
    (auth,) = kube.by_kind(docs, "TriggerAuthentication").values()
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    assert refs["password"]["name"] == "rsinfer-credentials"
    assert refs["ca"] == {"parameter": "ca", "name": "redis-ca", "key": "ca.crt"}
    for dep in kube.by_kind(docs, "Deployment").values():
        env = {e["name"]: e for e in kube.pod_spec(dep)["containers"][0]["env"]}
        assert env["RSINFER_REDIS_TLS_CA"]["value"] == "/etc/rsinfer/redis-ca/ca.crt"
        assert env["RSINFER_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "rsinfer-credentials"
    # without clusterNodes the scaler starts from the URL's node
    docs = render(VALUES["keda"], sets=["redis.mode=external", "redis.external.url=redis://cfg.example/0",
                                        "redis.external.cluster=true"])
    assert {so["spec"]["triggers"][0]["metadata"]["addresses"]
            for so in kube.by_kind(docs, "ScaledObject").values()} == {"cfg.example:6379"}
    assert config(render([]))["RSINFER_REDIS_CLUSTER"] == "no"
    assert config(render(VALUES["external-redis"]))["RSINFER_REDIS_CLUSTER"] == "no"


def test_redis_namespace_defaults_to_release_and_is_configurable(render):
    assert config(render([]))["RSINFER_NAMESPACE"] == "rs"
    assert config(render([], release="other"))["RSINFER_NAMESPACE"] == "other"
    docs = render(VALUES["keda"], sets=["redisNamespace=shared-b"])
    assert config(docs)["RSINFER_NAMESPACE"] == "shared-b"
    assert all(so["spec"]["triggers"][0]["metadata"]["stream"].startswith("shared-b:")
               for so in kube.by_kind(docs, "ScaledObject").values())


def test_config_change_rolls_pods(render):
    def checksum(docs):
        return kube.by_kind(docs, "Deployment")["rs-rsinfer-api"]["spec"]["template"]["metadata"][
            "annotations"]["checksum/config"]

    assert checksum(render([])) != checksum(render([], sets=["settings.log_level=DEBUG"]))
    (redis,) = kube.by_kind(render([]), "StatefulSet").values()
    annotations = redis["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/config" not in annotations, "a settings change must not restart Redis"
    assert "checksum/secret" in annotations


# ---------- NOTES.txt ----------

def test_notes_print_the_redis_recipes_for_this_release(helm_bin, tmp_path):
    # `helm template` does not render NOTES.txt: render it through a wrapper template in a copy.
    chart = tmp_path / "rsinfer"
    shutil.copytree(helmbin.CHART, chart)
    (chart / "notes.txt").write_text((chart / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n'
        'data:\n  notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')
    docs = helmbin.render([CI / "two-pools-values.yaml"], sets=["redisNamespace=llm-prod"], chart=chart)
    notes = kube.by_kind(docs, "ConfigMap")["notes"]["data"]["notes"]
    assert "--scan --pattern 'llm-prod:req:*'" in notes
    assert "ZRANGE llm-prod:inflight -inf +inf BYSCORE" in notes  # the index of requests in flight
    assert "HGETALL llm-prod:req:{<uid>}" in notes
    assert "XRANGE llm-prod:reply:{<uid>} - +" in notes
    assert "SET llm-prod:abort:{<uid>} admin EX 300" in notes
    for model in ("llama-70b", "qwen3-0.6b"):
        assert f"XINFO GROUPS llm-prod:schedule:{model}" in notes
        assert f"XPENDING llm-prod:schedule:{model} scheduler" in notes
    assert "exec -it rs-rsinfer-redis-0 -- redis-cli" in notes
    assert "redis-cli -c" not in notes
    docs = helmbin.render([CI / "redis-cluster-values.yaml"], chart=chart)
    notes = kube.by_kind(docs, "ConfigMap")["notes"]["data"]["notes"]
    url = "rediss://clustercfg.redis.example.internal:6379/0"
    assert f"alias rcli='redis-cli -c -u {url} --tls --cacert ca.crt'" in notes


def test_notes_say_where_files_are_kept_without_object_storage(helm_bin, tmp_path):
    chart = tmp_path / "rsinfer"
    shutil.copytree(helmbin.CHART, chart)
    (chart / "notes.txt").write_text((chart / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n'
        'data:\n  notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')

    def notes(*sets: str) -> str:
        return kube.by_kind(helmbin.render([], sets=list(sets), chart=chart), "ConfigMap")["notes"]["data"]["notes"]

    assert "objectStorage.url is empty" in notes() and "WARNING" not in notes()
    shared = notes("api.replicas=3", "objectStorage.allowPerPod=true")
    assert "WARNING: the API may run 3 pods" in shared
    assert "objectStorage.url is empty" not in notes("objectStorage.url=s3://files/rsinfer")


# ---------- tenants: the keys file from a Secret ----------

def test_the_api_keys_file_is_mounted_from_a_secret_that_can_change_under_the_pods(render, tmp_path):
    """auth.apiKeysSecret: the API pods mount it as a whole volume (a subPath mount never sees the kubelet's
    updates, so rotation would need a restart) and read the file it holds as --api-keys-file; the workers do
    not get it."""
    docs = render(sets=["auth.apiKeysSecret=team-keys", "auth.apiKeysKey=keys.yaml"])
    deployments = kube.by_kind(docs, "Deployment")
    api = deployments.pop("rs-rsinfer-api")
    spec, (c,) = kube.pod_spec(api), kube.containers(api)
    (volume,) = [v for v in spec["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"] == {"secretName": "team-keys", "items": [{"key": "keys.yaml", "path": "keys.yaml"}]}
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "api-keys"]
    assert mount["readOnly"] is True and "subPath" not in mount
    env = kube.resolve_env(c, docs, pod_name="api-0")
    assert env["RSINFER_API_KEYS_FILE"] == f"{mount['mountPath']}/keys.yaml"
    assert ApiSettings(api_keys_file=env["RSINFER_API_KEYS_FILE"]).api_keys_file == env["RSINFER_API_KEYS_FILE"]
    for dep in deployments.values():
        (w,) = kube.containers(dep)
        assert "RSINFER_API_KEYS_FILE" not in kube.resolve_env(w, docs, pod_name="w-0")
        assert all(v["name"] != "api-keys" for v in kube.pod_spec(dep).get("volumes", []))
    (default_api,) = kube.containers(kube.by_kind(render([]), "Deployment")["rs-rsinfer-api"])
    assert "RSINFER_API_KEYS_FILE" not in kube.resolve_env(default_api, render([]), pod_name="api-0")
    for doc in docs:
        kube.validate(doc)


def test_the_api_keys_key_must_be_a_file_name(helm_bin):
    proc = helmbin.helm("template", "rs", str(helmbin.CHART), "--set", "auth.apiKeysSecret=k",
                        "--set", "auth.apiKeysKey=../etc/passwd")
    assert proc.returncode != 0 and "apiKeysKey" in proc.stdout + proc.stderr


def test_the_api_pods_share_the_responses_key(render):
    """The key sealing reasoning `encrypted_content` reaches every API pod from the release's Secret; rendered
    without a cluster and none given there is none (no random key per render: a GitOps sync would change it)."""
    docs = render(VALUES["internal-redis"], sets=["auth.responsesKey=a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2U="])
    api = next(d for d in kube.by_kind(docs, "Deployment").values() if "api" in d["metadata"]["name"])
    env = kube.resolve_env(kube.pod_spec(api)["containers"][0], docs, "api-0")
    assert env["RSINFER_RESPONSES_KEY"] == "a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2U="
    (secret,) = kube.by_kind(render(VALUES["internal-redis"]), "Secret").values()
    assert "responses-key" not in secret["data"]
