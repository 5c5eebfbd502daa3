"""A real Prometheus server for the tests that check what it scrapes (Debian's `prometheus`): started on a free
port, scraping one target every second, stopped after."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ports import free_port


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


PROMETHEUS_DEADLINE_S = 30.0


@dataclasses.dataclass
class Prometheus:
    """A real Prometheus server scraping one exporter every second."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = json.loads(get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def wait_for(self, expr: str, accept: Any, what: str) -> list[dict[str, Any]]:
        """Poll ``expr`` until ``accept(result)``: bounded, and says what Prometheus logged when it fails."""
        deadline = time.monotonic() + PROMETHEUS_DEADLINE_S
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited: {self.log.read_text()[-2000:]}"
            result = self.query(expr)
            if accept(result):
                return result
            time.sleep(0.2)
        raise AssertionError(f"{what}: {expr} gave {result} after {PROMETHEUS_DEADLINE_S} s")


def start_prometheus(binary: str, tmp: Path, target: str) -> Prometheus:
    """Start it and wait for /-/ready; a web port taken between free_port() and the bind gets a retry."""
    config = tmp / "prometheus.yml"
    scrape = {"job_name": "redline", "static_configs": [{"targets": [target]}]}
    config.write_text(
        json.dumps({"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": [scrape]})
    )
    for attempt in range(3):
        url, log = f"http://127.0.0.1:{free_port()}", tmp / f"prometheus-{attempt}.log"
        args = [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / f'data-{attempt}'}"]
        args += [f"--web.listen-address={url.removeprefix('http://')}", "--log.level=warn"]
        with log.open("wb") as sink:
            process = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        server = Prometheus(url, process, log)
        if _ready(server):
            return server
        stop(process)
        if "address already in use" not in log.read_text():
            break
    raise AssertionError(f"prometheus did not become ready: {log.read_text()[-2000:]}")


def _ready(server: Prometheus) -> bool:
    deadline = time.monotonic() + PROMETHEUS_DEADLINE_S
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            get(f"{server.url}/-/ready", timeout=2)
            return True
        except OSError:  # refused while it starts, 503 while it replays its (empty) WAL
            time.sleep(0.1)
    return False


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
