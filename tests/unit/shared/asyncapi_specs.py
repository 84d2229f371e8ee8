"""AsyncAPI's own JSON Schemas (the `@asyncapi/specs` npm package), fetched once with `npm pack` into
.cache/asyncapi-specs/ like the deploy tests' helm (tests/deploy/helmbin.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CACHE = ROOT / ".cache" / "asyncapi-specs"
NPM_PACKAGE = "@asyncapi/specs@6.11.1"


def schema(version: str) -> dict:
    """The JSON Schema of AsyncAPI `version` (e.g. "3.0.0"), self-contained (no remote $ids)."""
    name = f"{version}-without-$id.json"
    cached = CACHE / name
    if not cached.exists():
        _fetch()
    return json.loads(cached.read_text())


def _fetch() -> None:
    npm = shutil.which("npm")
    if not npm:
        raise RuntimeError("npm is needed once to fetch AsyncAPI's JSON Schemas (@asyncapi/specs)")
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        out = subprocess.run([npm, "pack", NPM_PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True,
                             timeout=120, check=True)
        with tarfile.open(Path(tmp) / out.stdout.strip().splitlines()[-1]) as tar:
            for member in tar.getmembers():
                if member.name.startswith("package/schemas/") and member.name.endswith("-without-$id.json"):
                    staged = Path(tmp) / Path(member.name).name
                    staged.write_bytes(tar.extractfile(member).read())
                    os.replace(staged, CACHE / staged.name)
