"""`tokenmill serve --data-parallel-size 2 --ray-address ...` on a Ray cluster of two nodes, both on
this machine: a head and a worker of one CPU each, so that the two replicas (one CPU each) land
on different nodes.

The nodes run `ray start --block`, and the test ends them by their process ids (SIGTERM stops a
blocking `ray start` and everything it started), not with `ray stop`, which would stop every Ray
node on the machine, another test's or another user's included.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import ray  # noqa: F401 - a test extra: missing, the module fails rather than skips

from tests.server.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def _wait_for_line(log: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{log.name}: no {text!r}:\n{log.read_text(errors='replace')}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture()
def two_node_cluster():
    """(address, env) of a running two-node cluster; the nodes share a fresh auth token."""
    temp = Path(tempfile.mkdtemp(prefix="tmray", dir="/tmp"))  # short: Ray's socket paths
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        RAY_USAGE_STATS_ENABLED="0",
    )
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus", "1", "--object-store-memory", str(100 << 20), "--temp-dir", str(temp)]
    common += ["--block"]
    nodes: list[subprocess.Popen] = []
    try:
        for i, args in enumerate(
            (["--head", f"--port={port}", "--include-dashboard=false"], [f"--address={address}"])
        ):
            log = temp / f"node{i}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    [RAY, "start", *args, *common], env=env, stdout=out, stderr=subprocess.STDOUT
                )
            nodes.append(proc)
            _wait_for_line(log, "Ray runtime started", proc, timeout=60)
        yield address, env
    finally:
        for proc in reversed(nodes):
            _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


def test_serve_on_a_two_node_cluster(two_node_cluster, tiny_model_dir, tmp_path) -> None:
    address, env = two_node_cluster
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen(
            [
                sys.executable, "-m", "tokenmill.cli.main", "serve", str(tiny_model_dir),
                "--data-parallel-size", "2", "--ray-address", address, "--port", str(port),
                "--no-compile", "--dtype", "fp32", "--max-model-len", "512",
                "--kv-cache-memory", "0.01", "--threads-per-replica", "1",
            ],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        # two replicas start on a loaded 2-core machine (the other test worker busy): minutes
        _wait_for_line(log, "Uvicorn running", serve, timeout=240)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            health = http.get("/health").json()
            assert [r["status"] for r in health["replicas"]] == ["ok", "ok"]
            resp = http.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 5})
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 5
    finally:
        _stop(serve, signal.SIGINT)
    assert serve.returncode == 0, log.read_text(errors="replace")
