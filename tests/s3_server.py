"""A real S3-compatible server for tests: moto in server mode (`python -m moto.server`), a child process on a
free loopback port, spoken to over HTTP by boto3 exactly as an S3 or MinIO endpoint would be."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

from rsinfer import children
from rsinfer.redis_server import free_port

# What a client needs besides the endpoint: the standard AWS variables (moto accepts any credentials), and no
# shared config or instance metadata lookups from the machine running the tests.
CLIENT_ENV = {
    "AWS_ACCESS_KEY_ID": "rsinfer-test",
    "AWS_SECRET_ACCESS_KEY": "rsinfer-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


class MotoServer:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self._client = None
        self._bucket = ""

    def start(self, timeout: float = 30.0) -> MotoServer:
        for _ in range(3):  # another process may take the free port before moto binds it
            port = free_port()
            self.proc = children.spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.url = f"http://127.0.0.1:{port}"
            if self._wait_up(timeout):
                return self
            self.stop()
        raise RuntimeError("moto server did not start")

    def _wait_up(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2):
                    return True
            except urllib.error.HTTPError:
                return True  # it answers
            except OSError:
                time.sleep(0.1)
        return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self):
        """A plain boto3 client of this server, to set up and inspect buckets behind the code under test."""
        import boto3

        if self._client is None:
            session = boto3.session.Session(aws_access_key_id=CLIENT_ENV["AWS_ACCESS_KEY_ID"],
                                            aws_secret_access_key=CLIENT_ENV["AWS_SECRET_ACCESS_KEY"])
            self._client = session.client("s3", endpoint_url=self.url, region_name=CLIENT_ENV["AWS_DEFAULT_REGION"])
        return self._client

    def new_bucket(self) -> str:
        name = f"rsinfer-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    @property
    def bucket(self) -> str:
        """One bucket for the session (moto takes about half a second to make one): give each test a prefix."""
        if not self._bucket:
            self._bucket = self.new_bucket()
        return self._bucket

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
