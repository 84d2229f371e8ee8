"""values.schema.json: wrong values make `helm template` fail, and the schema agrees with the code."""

from __future__ import annotations

import json
import typing
from typing import Literal

import pytest
import yaml

from shared.settings import ApiSettings, CommonSettings, SchedulerSettings, StageSettings, TokenizerSettings
from tests.deploy import helmbin

pytestmark = pytest.mark.timeout(60)

SCHEMA = json.loads((helmbin.CHART / "values.schema.json").read_text())
POOL = {"name": "m", "servedModelName": "m", "model": {"source": "demo"}}

# (id, values, text helm's error must contain). Schema violations and the chart's own `fail` checks.
BAD_VALUES = [
    ("port-not-a-number", {"api": {"port": "eighty"}}, "api.port"),
    ("replicas-negative", {"api": {"replicas": -1}}, "api.replicas"),
    ("unknown-stage-in-defaults", {"stages": {"embedder": {"replicas": 1}}}, "embedder"),
    ("unknown-stage-in-pool", {"modelPools": [{**POOL, "embedder": {}}]}, "embedder"),
    ("unknown-setting", {"stages": {"scheduler": {"settings": {"max_kv_token": 5}}}}, "max_kv_token"),
    ("setting-of-another-stage", {"stages": {"tokenizer": {"settings": {"max_running": 5}}}}, "max_running"),
    ("setting-wrong-type", {"stages": {"scheduler": {"settings": {"prefix_cache": "yes"}}}}, "prefix_cache"),
    ("setting-bad-choice", {"stages": {"scheduler": {"settings": {"device": "tpu"}}}}, "device"),
    ("api-setting-wrong-type", {"api": {"settings": {"max_queued": 1.5}}}, "max_queued"),
    ("chart-owned-setting", {"settings": {"redis_url": "redis://x:6379"}}, "redis_url"),
    ("gpu-not-a-number", {"stages": {"scheduler": {"gpu": "one"}}}, "gpu"),
    ("keda-lag-as-string", {"stages": {"tokenizer": {"keda": {"lagCount": "10"}}}}, "lagCount"),
    ("keda-unknown-key", {"stages": {"tokenizer": {"keda": {"lagcount": 10}}}}, "lagcount"),
    ("redis-mode", {"redis": {"mode": "sentinel"}}, "redis.mode"),
    ("redis-url-scheme", {"redis": {"mode": "external", "external": {"url": "http://redis:6379"}}}, "url"),
    ("redis-cluster-not-bool", {"redis": {"external": {"cluster": "yes"}}}, "cluster"),
    ("redis-cluster-node-without-port", {"redis": {"external": {"clusterNodes": ["redis-0"]}}}, "clusterNodes"),
    ("redis-cluster-mode-as-setting", {"settings": {"redis_cluster": "yes"}}, "redis_cluster"),
    ("pool-name", {"modelPools": [{**POOL, "name": "Big_Model"}]}, "name"),
    ("served-name-with-colon", {"modelPools": [{**POOL, "servedModelName": "a:b"}]}, "servedModelName"),
    ("pool-without-model", {"modelPools": [{"name": "m", "servedModelName": "m"}]}, "model"),
    ("model-source", {"modelPools": [{**POOL, "model": {"source": "s3"}}]}, "source"),
    ("pvc-without-claim", {"modelPools": [{**POOL, "model": {"source": "pvc", "path": "x"}}]}, "claimName"),
    ("hub-without-id", {"modelPools": [{**POOL, "model": {"source": "hub"}}]}, "hubId"),
    ("no-pools", {"modelPools": []}, "modelPools"),
    ("top-level-typo", {"modelPool": [POOL]}, "modelPool"),
    ("settings-env-in-extraEnv", {"extraEnv": [{"name": "RSINFER_MODEL", "value": "x"}]}, "extraEnv"),
    ("kernel-cache-typo", {"stages": {"scheduler": {"kernelCache": {"persistant": True}}}}, "persistant"),
    ("kernel-cache-not-bool", {"stages": {"scheduler": {"kernelCache": {"persistent": "yes"}}}}, "persistent"),
    ("kernel-cache-access-mode", {"stages": {"scheduler": {"kernelCache": {"accessModes": ["ReadOnlyMany"]}}}},
     "accessModes"),
    ("kernel-cache-on-tokenizer", {"stages": {"tokenizer": {"kernelCache": {"persistent": True}}}}, "kernelCache"),
    ("worker-metrics-port-zero", {"metrics": {"workers": {"port": 0}}}, "metrics.workers.port"),
    ("worker-metrics-port-string", {"metrics": {"workers": {"port": "9100"}}}, "metrics.workers.port"),
    ("worker-metrics-typo", {"metrics": {"workers": {"enable": True}}}, "enable"),
    ("worker-metrics-port-as-setting", {"stages": {"tokenizer": {"settings": {"metrics_port": 9100}}}},
     "metrics_port"),
    ("otlp-endpoint-without-scheme", {"tracing": {"otlpEndpoint": "otel-collector:4318"}}, "otlpEndpoint"),
    ("otlp-endpoint-as-setting", {"settings": {"otlp_endpoint": "http://otel:4318"}}, "otlp_endpoint"),
    ("redis-maxmemory-unit", {"redis": {"internal": {"maxmemory": "2 GiB"}}}, "maxmemory"),
    ("redis-eviction-policy", {"redis": {"internal": {"extraArgs": ["--maxmemory-policy", "allkeys-lru"]}}},
     "maxmemory"),
    ("network-policy-typo", {"networkPolicy": {"enable": True}}, "enable"),
    ("reloader-not-bool", {"auth": {"reloader": "yes"}}, "reloader"),
    ("drain-timeout-below-drain", {"api": {"settings": {"drain_timeout_s": 5}}}, "drain_timeout_s"),
    # the chart's `fail` checks: what a schema cannot say
    ("duplicate-pool-name", {"modelPools": [POOL, {**POOL, "servedModelName": "other"}]}, "used twice"),
    ("duplicate-served-name", {"modelPools": [POOL, {**POOL, "name": "other"}]}, "used twice"),
    ("external-without-url", {"redis": {"mode": "external"}}, "redis.external.url"),
    ("ca-without-tls", {"redis": {"mode": "external", "external": {"url": "redis://r:6379/0",
                                                                    "tlsCaSecret": "ca"}}}, "rediss://"),
    ("redis-cluster-database", {"redis": {"mode": "external", "external": {
        "url": "redis://cfg:6379/2", "cluster": True}}}, "database 0"),
    ("grace-too-short", {"api": {"terminationGracePeriodSeconds": 5}}, "terminationGracePeriodSeconds"),
    ("worker-grace-not-above-drain", {"stages": {"scheduler": {"terminationGracePeriodSeconds": 20}}},
     "must exceed settings.grace_period_s"),
    ("pool-worker-grace-not-above-drain", {"modelPools": [{**POOL, "tokenizer": {"settings": {
        "grace_period_s": 45}}}]}, "terminationGracePeriodSeconds (30) must exceed settings.grace_period_s (45)"),
    ("keda-min-above-max", {"stages": {"tokenizer": {"keda": {"minReplicaCount": 9, "maxReplicaCount": 8}}}},
     "minReplicaCount"),
    ("models-as-api-setting", {"api": {"settings": {"models": "a,b"}}}, "models"),
    ("kernel-cache-without-size", {"stages": {"scheduler": {"kernelCache": {"persistent": True, "size": ""}}}},
     "kernelCache"),
]


@pytest.mark.parametrize(("values", "needle"), [pytest.param(v, n, id=i) for i, v, n in BAD_VALUES])
def test_bad_values_fail_helm_template(helm_bin, tmp_path, values, needle):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(helmbin.RenderError) as err:
        helmbin.render([path])
    assert needle in str(err.value), str(err.value)


def test_lint_reports_schema_errors(helm_bin, tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"api": {"port": "eighty"}}))
    proc = helmbin.helm("lint", "--strict", str(helmbin.CHART), "-f", str(path))
    assert proc.returncode != 0 and "api.port" in proc.stdout + proc.stderr


def _walk(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield path, k, v
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}/{i}")


def test_schema_has_no_remote_refs():
    refs = [(p, v) for p, k, v in _walk(SCHEMA) if k == "$ref"]
    assert refs, "the schema uses local definitions"
    assert all(v.startswith("#/") for _, v in refs), refs
    assert "$id" not in SCHEMA


def _json_types(annotation) -> set[str]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return {"enum"}
    if args:  # Optional[...] / unions
        return set().union(*(_json_types(a) for a in args if a is not type(None)))
    return {bool: {"boolean"}, int: {"integer"}, float: {"number", "integer"}, str: {"string"}}[annotation]


# schema definition -> the settings class its keys must be fields of (fields the chart sets are left out)
SETTINGS_DEFS = {
    "commonSettings": CommonSettings,
    "apiSettings": ApiSettings,
    "workerSettings": StageSettings,
    "tokenizerSettings": TokenizerSettings,
    "schedulerSettings": SchedulerSettings,
}


@pytest.mark.parametrize("definition", list(SETTINGS_DEFS))
def test_schema_settings_are_fields_of_the_code(definition):
    """A setting renamed or retyped in shared/settings.py must be changed in the chart too."""
    cls = SETTINGS_DEFS[definition]
    props = SCHEMA["definitions"][definition]["properties"]
    assert SCHEMA["definitions"][definition]["additionalProperties"] is False
    common = set(CommonSettings.model_fields) if cls is not CommonSettings else set()
    for key, spec in props.items():
        assert key in cls.model_fields, f"{definition}.{key} is no field of {cls.__name__}"
        assert key not in common, f"{definition}.{key} belongs in the top-level settings"
        field = cls.model_fields[key]
        kinds = _json_types(field.annotation)
        if kinds == {"enum"}:
            assert set(spec["enum"]) == set(typing.get_args(field.annotation)), key
        else:
            assert spec["type"] in kinds, f"{definition}.{key}: {spec['type']} vs {field.annotation}"
