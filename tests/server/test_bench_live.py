"""`tokenmill bench` against a running tokenmill server (the tiny model)."""

from __future__ import annotations

import json

from tests.server.conftest import API_KEY
from tokenmill.cli.main import main


def test_bench_against_a_running_tokenmill(server, tmp_path, capsys) -> None:
    """`tokenmill bench` against the real server (tiny model): the table is printed and the PNG
    written."""
    plot, result = tmp_path / "bench.png", tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--base-url",
            server.url,
            "--api-key",
            API_KEY,
            "--num-prompts",
            "6",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--max-concurrency",
            "3",
            "--ignore-eos",
            "--plot",
            str(plot),
            "--result-json",
            str(result),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Successful requests" in out and "Output token throughput" in out and "TTFT" in out
    assert "Speculative Decoding" not in out  # the server does not speculate
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(result.read_text())["completed"] == 6
