"""Shutdown of the real `tokenmill serve` process under load.

The server runs as a subprocess; eight requests (half streamed, half long) are put in flight and
the process gets SIGTERM, SIGINT (Ctrl-C), or SIGINT twice (Ctrl-C again: quit now). It must
exit with status 0 within 20 s and no request may hang: after one signal the short requests run
to their end in the grace period and the long ones complete or end cleanly; after two, every
request ends cleanly at once (an error status, an in-band error event, or a closed connection).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port

API_KEY = "shutdown-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# max_tokens of the short requests (they end well within the server's 10 s grace period) and the
# long ones (they may not)
SHORT, LONG = 60, 950
EXIT_WITHIN = 20.0
CLIENT_TIMEOUT = 40.0  # a request still open this long has hung
ERROR_KEYS = {"message", "type", "param", "code"}

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]


class ServeProcess:
    def __init__(self, model_dir: Path, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "serve.log"
        env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
        env["TOKENMILL_MODELS_DIR"] = str(workdir / "models")
        # One intra-op thread: on a busy machine torch's spinning OpenMP workers can slow the tiny
        # model 50x, which would make the grace-period timings below meaningless.
        env["OMP_NUM_THREADS"] = "1"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenmill.cli.main",
                "serve",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--api-key",
                API_KEY,
                "--max-model-len",
                "1024",
                "--kv-cache-memory",
                "0.01",
                "--no-compile",  # no background compilation skewing the grace-period timings
                "--log-level",
                "info",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"tokenmill serve exited with {self.proc.returncode}:\n{self.output()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"tokenmill serve did not come up in 60 s:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace")
        # no access log
        return "\n".join(line for line in text.splitlines() if '- "' not in line)[-6000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture()
def serve(tiny_model_dir, tmp_path):
    process = ServeProcess(tiny_model_dir, tmp_path)
    yield process
    process.close()


def _request(i: int) -> tuple[str, dict]:
    body = {
        "max_tokens": SHORT if i < 4 else LONG,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": i,
        "stream": i % 2 == 0,
    }
    if i % 4 in (2, 3):
        return "/v1/chat/completions", {
            **body,
            "messages": [{"role": "user", "content": f"Tell story {i}"}],
        }
    return "/v1/completions", {**body, "prompt": f"Once upon a time, story {i}"}


def _error_end(resp: httpx.Response) -> str:
    try:
        shaped = set(resp.json()["error"]) == ERROR_KEYS
    except (ValueError, KeyError, TypeError):
        shaped = False
    return "error-status" if shaped else "error-status-unshaped"


async def _run(client: httpx.AsyncClient, i: int) -> dict:
    """How request i ended: completed, error-status[-unshaped], in-band-error, closed, hung or
    broken."""
    route, body = _request(i)
    result = {"i": i, "route": route, "stream": body["stream"], "max_tokens": body["max_tokens"]}
    try:
        if not body["stream"]:
            resp = await client.post(route, json=body)
            if resp.status_code != 200:
                return result | {
                    "end": _error_end(resp),
                    "detail": f"{resp.status_code} {resp.text[:200]}",
                }
            data = resp.json()
            complete = [c["finish_reason"] for c in data["choices"]] == ["length"] and data[
                "usage"
            ]["completion_tokens"] == body["max_tokens"]
            return result | {
                "end": "completed" if complete else "broken",
                "detail": resp.text[:200],
            }
        events = []
        async with client.stream("POST", route, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return result | {
                    "end": _error_end(resp),
                    "detail": f"{resp.status_code} {resp.text[:200]}",
                }
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        if events and events[-1] == "[DONE]":
            chunks = [json.loads(e) for e in events[:-1]]
            if any("error" in c for c in chunks):
                return result | {"end": "in-band-error", "detail": events[-2][:200]}
            reasons = [
                ch.get("finish_reason")
                for c in chunks
                for ch in c["choices"]
                if ch.get("finish_reason")
            ]
            return result | {
                "end": "completed" if reasons == ["length"] else "broken",
                "detail": str(reasons),
            }
        return result | {
            "end": "broken",
            "detail": f"the stream ended without [DONE] after {len(events)} events",
        }
    except httpx.TimeoutException as exc:
        return result | {"end": "hung", "detail": repr(exc)}
    except (
        httpx.RemoteProtocolError,
        httpx.ReadError,
        httpx.ConnectError,
        httpx.WriteError,
    ) as exc:
        return result | {"end": "closed", "detail": repr(exc)}


def _admitted(url: str) -> float:
    """Requests the engine has taken: running, waiting or already finished."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(
            (
                "tokenmill:num_requests_running",
                "tokenmill:num_requests_waiting",
                "tokenmill:request_success_total",
            )
        ):
            total += float(line.rpartition(" ")[2])
    return total


async def _load_then_signal(
    serve: ServeProcess, signals: list[int]
) -> tuple[list[dict], float | None]:
    async with httpx.AsyncClient(
        base_url=serve.url, headers=AUTH, timeout=CLIENT_TIMEOUT
    ) as client:
        tasks = [asyncio.create_task(_run(client, i)) for i in range(8)]
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(_admitted, serve.url) < 8:
            assert time.monotonic() < deadline, "the requests never all reached the engine"
            await asyncio.sleep(0.02)
        sent = time.monotonic()
        for k, signum in enumerate(signals):
            if k:
                await asyncio.sleep(0.2)
            serve.proc.send_signal(signum)
        results = await asyncio.gather(*tasks)
        exited_after = None
        while time.monotonic() - sent < EXIT_WITHIN:
            if serve.proc.poll() is not None:
                exited_after = time.monotonic() - sent
                break
            await asyncio.sleep(0.05)
    return results, exited_after


VARIANTS = {
    "SIGTERM": [signal.SIGTERM],
    "SIGINT": [signal.SIGINT],
    "SIGINT-twice": [signal.SIGINT, signal.SIGINT],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_signal_under_load(serve, variant) -> None:
    results, exited_after = asyncio.run(_load_then_signal(serve, VARIANTS[variant]))
    summary = "\n".join(
        f"  request {r['i']} ({r['route']}, stream={r['stream']}, max_tokens={r['max_tokens']}): "
        f"{r['end']} {r['detail'][:160]}"
        for r in results
    )
    print(f"{variant}: exit status {serve.proc.returncode} after {exited_after} s\n{summary}")
    report = []
    if exited_after is None:
        report.append(f"still running {EXIT_WITHIN:.0f} s after {variant}")
    elif serve.proc.returncode != 0:
        report.append(
            f"exited with status {serve.proc.returncode} {exited_after:.1f} s after {variant}, "
            "expected 0"
        )
    bad = [r for r in results if r["end"] in ("hung", "broken")]
    if bad:
        report.append(f"{len(bad)} requests hung or ended malformed")
    if len(VARIANTS[variant]) == 1:
        cut = [r for r in results if r["max_tokens"] == SHORT and r["end"] != "completed"]
        if cut:
            report.append(
                f"{len(cut)} short requests were not allowed to finish in the grace period"
            )
    output = serve.output()
    if "Traceback" in output or "never retrieved" in output:
        report.append("the server printed a traceback")
    assert not report, "; ".join(report) + f"\n{summary}\n--- server output ---\n{output}"
