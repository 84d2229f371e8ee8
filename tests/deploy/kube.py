"""Offline validation of rendered manifests and small accessors the chart tests share.

Built-in kinds are checked by kubernetes-validate against the Kubernetes JSON schemas in strict mode
(unknown fields fail, as `kubectl apply` with server-side field validation does). kubernetes-validate
only warns on custom resources, so those are checked against the CRDs kept in `crds/` (KEDA v2.20.2,
Prometheus Operator v0.93.0), made strict the same way.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import yaml

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest the schemas know.
KUBE_VERSIONS = ("1.27", kubernetes_validate.utils.latest_version())
CRD_DIR = Path(__file__).parent / "crds"

# kubernetes-validate re-reads its (large) schema files on every call; read each once.
kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(
    kubernetes_validate.utils.schema_contents)


def _strict(schema: dict) -> dict:
    """Reject unknown fields wherever the CRD lists the fields and does not ask to keep unknown ones."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the CRD's openAPIV3Schema, made strict."""
    out = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd:
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schema = _strict(version["schema"]["openAPIV3Schema"])
                schema["properties"]["metadata"] = {"type": "object"}
                out[(f"{group}/{version['name']}", kind)] = schema
    return out


def validate(doc: dict) -> None:
    """Raise with the offending path if `doc` is not a valid object of its kind."""
    key = (doc["apiVersion"], doc["kind"])
    schema = crd_schemas().get(key)
    if schema is not None:
        jsonschema.Draft7Validator(schema).validate(doc)
        return
    # SchemaNotFoundError (an unknown built-in kind or apiVersion) is an error here, not a warning.
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def containers(doc: dict) -> list[dict]:
    spec = pod_spec(doc)
    return spec.get("initContainers", []) + spec["containers"]


def resolve_env(container: dict, docs: list[dict], pod_name: str) -> dict[str, str]:
    """A container's environment as the kubelet would set it, from the rendered ConfigMaps and Secrets.

    Unresolvable optional references are left out, as Kubernetes does; a missing required one raises.
    """
    configmaps = by_kind(docs, "ConfigMap")
    secrets = by_kind(docs, "Secret")
    env: dict[str, str] = {}
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = item["value"]
        elif (value := _value_from(name, item["valueFrom"], configmaps, secrets, pod_name)) is not None:
            env[name] = value
    return env


def _value_from(name: str, src: dict, configmaps: dict, secrets: dict, pod_name: str) -> str | None:
    """An env var's `valueFrom`; None for an optional reference that does not resolve."""
    if "fieldRef" in src:
        assert src["fieldRef"]["fieldPath"] == "metadata.name", src
        return pod_name
    if "configMapKeyRef" in src:
        ref = src["configMapKeyRef"]
        data = configmaps.get(ref["name"], {}).get("data", {})
        if ref["key"] in data:
            return data[ref["key"]]
        if not ref.get("optional"):
            raise KeyError(f"{name}: ConfigMap {ref['name']} has no key {ref['key']}")
        return None
    if "secretKeyRef" in src:
        return _secret_value(name, src["secretKeyRef"], secrets)
    raise AssertionError(f"unsupported env source for {name}: {src}")


def _secret_value(name: str, ref: dict, secrets: dict) -> str | None:
    import base64

    data = (secrets[ref["name"]].get("data") or {}) if ref["name"] in secrets else {}
    if ref["key"] in data:
        return base64.b64decode(data[ref["key"]]).decode()
    if not ref.get("optional"):
        raise KeyError(f"{name}: Secret {ref['name']} (key {ref['key']}) is not in the chart")
    return None
