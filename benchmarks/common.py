"""Shared helpers of the benchmark scripts: models, the llama.cpp peer, servers, machine facts.

Nothing here is part of the tokenmill package; the scripts import it as a sibling module.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Where JSON results and logs go: BENCH_RESULTS (run_all.sh sets it to results/<machine>/<commit>),
# else results/local. Only a suite's summary.md and PNGs are meant for git (see .gitignore).
RESULTS = Path(os.environ.get("BENCH_RESULTS") or HERE / "results" / "local")
MiB = 1 << 20

# The llama.cpp peer: its tools are in LLAMA_CPP_PREFIX/build/bin. When some are missing and
# LLAMA_CPP_BUILD_SCRIPT names a build script, it is run as `bash SCRIPT PREFIX` to build them.
LLAMA_PREFIX = Path(
    os.environ.get("LLAMA_CPP_PREFIX") or "~/.cache/tokenmill-peers/llama.cpp"
).expanduser()
BUILD_SCRIPT = (
    Path(os.environ["LLAMA_CPP_BUILD_SCRIPT"]).expanduser()
    if os.environ.get("LLAMA_CPP_BUILD_SCRIPT")
    else None
)


# ---------------------------------------------------------------- models


def add_dtype_arg(parser: argparse.ArgumentParser, what: str = "tokenmill's dtype") -> None:
    """--dtype, kept resolved ("auto" becomes this CPU's bf16 or fp32) so that results record what
    ran."""
    from tokenmill.model.loader import dtype_name

    parser.add_argument(
        "--dtype",
        default="auto",
        type=dtype_name,
        choices=["fp32", "bf16", "fp16"],
        metavar="{auto,fp32,bf16,fp16}",
        help=f"{what} (default: auto, bf16 where the CPU multiplies it natively, else fp32)",
    )


def add_server_pair_args(parser: argparse.ArgumentParser) -> None:
    """--model, --dtype and --threads of a script that runs `tokenmill serve` and llama-server on
    the same file with the same threads."""
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="catalog alias or GGUF path"
    )
    add_dtype_arg(parser, "tokenmill serve --dtype")
    parser.add_argument(
        "--threads", type=int, default=2, help="llama-server -t, OMP_NUM_THREADS for tokenmill"
    )


def resolve_model(name: str) -> Path:
    """A catalog alias (pulled on first use, as `tokenmill pull` does) or a GGUF path."""
    path = Path(name).expanduser()
    if path.is_file():
        return path.resolve()
    from tokenmill.catalog import pull

    return Path(pull(name)).resolve()


def model_slug(name: str) -> str:
    """A short file-name-safe name for results: the alias, or the file's stem."""
    stem = Path(name).name
    for suffix in (".gguf",):
        stem = stem.removesuffix(suffix)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-").lower()


# ---------------------------------------------------------------- llama.cpp


def llama_bin(tool: str) -> Path:
    return LLAMA_PREFIX / "build" / "bin" / tool


def missing_llama_hint(tools: list[str]) -> str:
    """What to set when llama.cpp tools are not where the scripts look for them."""
    return (
        f"llama.cpp's {', '.join(tools)} not found in {LLAMA_PREFIX / 'build' / 'bin'}: set "
        "LLAMA_CPP_PREFIX to the llama.cpp directory whose build/bin holds them, or "
        "LLAMA_CPP_BUILD_SCRIPT to a script that builds them there (run as `bash SCRIPT PREFIX`, "
        "e.g. the peers' build-llama-cpp.sh)"
    )


def ensure_llama(tools: list[str], build: bool = True) -> dict[str, Path | None]:
    """Paths of the llama.cpp tools asked for; None for a tool that is missing and could not be
    built.

    Missing core tools are built with LLAMA_CPP_BUILD_SCRIPT when it is set (about 10 minutes on
    2 cores); tools such a script does not build (llama-batched-bench) are added incrementally to
    the existing build tree with cmake.
    """
    core = {"llama-server", "llama-bench", "llama-perplexity", "llama-tokenize", "llama-cli"}
    missing = [t for t in tools if not llama_bin(t).is_file()]
    if missing and build and any(t in core for t in missing):
        if BUILD_SCRIPT is None or not BUILD_SCRIPT.is_file():
            where = "" if BUILD_SCRIPT is None else f" ({BUILD_SCRIPT} does not exist)"
            log(missing_llama_hint(missing) + where)
        else:
            log(f"building llama.cpp into {LLAMA_PREFIX} with {BUILD_SCRIPT} (about 10 minutes)")
            subprocess.run(["bash", str(BUILD_SCRIPT), str(LLAMA_PREFIX)], check=True)
    extra = [t for t in tools if t not in core and not llama_bin(t).is_file()]
    if extra and build and (LLAMA_PREFIX / "build" / "CMakeCache.txt").is_file():
        log(f"building {', '.join(extra)} in the existing llama.cpp build tree")
        proc = subprocess.run(
            [
                "cmake",
                "--build",
                str(LLAMA_PREFIX / "build"),
                "-j",
                str(os.cpu_count() or 2),
                "--target",
                *extra,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            log(f"could not build {', '.join(extra)}:\n{proc.stderr[-2000:]}")
    return {t: (llama_bin(t) if llama_bin(t).is_file() else None) for t in tools}


def run_measured(
    cmd: list[str], timeout: float | None = None
) -> tuple[int, str, str, float, float]:
    """Run a command to completion; (returncode, stdout, stderr, wall seconds, peak RSS MiB of it).

    The peak RSS is the child's VmHWM (/proc/PID/status), polled every 20 ms: ru_maxrss from wait4
    would be wrong, since Linux carries the forking parent's RSS into the child's ru_maxrss at exec.
    """
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        hwm = 0
        try:
            deadline = None if timeout is None else t0 + timeout
            while True:
                # read before reaping, while /proc/PID still exists
                hwm = max(hwm, vm_hwm(proc.pid))
                if proc.poll() is not None:
                    break
                if deadline is not None and time.perf_counter() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                time.sleep(0.02)
        except BaseException:
            kill_tree(proc)
            raise
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return (
            proc.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            wall,
            hwm / MiB,
        )


def vm_hwm(pid: int) -> int:
    """Peak resident bytes of a live process (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


# ---------------------------------------------------------------- servers


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def tree_rss(proc) -> int:
    """Resident bytes of a process and all its descendants (psutil.Process)."""
    import psutil

    total = 0
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class RSSSampler:
    """Samples the resident memory of a process tree every `interval` seconds in a thread."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self.last = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.last = tree_rss(self.proc)
            self.peak = max(self.peak, self.last)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def kill_tree(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM a process and its descendants, SIGKILL whatever is left after `grace` seconds."""
    import psutil

    if proc.poll() is not None:
        return
    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        procs = []
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


class Server:
    """A server subprocess that is always killed: use as a context manager.

    Measures the time from start to the first 200 on /health and samples the tree's RSS.
    stdout/stderr go to `log_path`.
    """

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        log_path: Path,
        env: dict | None = None,
        startup_timeout: float = 600.0,
    ) -> None:
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.env = env
        self.startup_timeout = startup_timeout
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.sampler: RSSSampler | None = None
        self.startup_s: float | None = None
        self.ready_s: float | None = None  # when a background compilation (tokenmill) had finished

    def __enter__(self) -> Server:
        import httpx

        if port_in_use(self.port):
            raise RuntimeError(
                f"port {self.port} is already in use; pick another "
                "(it would be benchmarked instead)"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        log(f"starting {self.name}: {shlex.join(self.cmd)}")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )
        try:
            self.sampler = RSSSampler(self.proc.pid)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with code {self.proc.returncode} before it was "
                        f"healthy; see {self.log_path}:\n{tail(self.log_path)}"
                    )
                try:
                    if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > self.startup_timeout:
                    raise RuntimeError(
                        f"{self.name} not healthy after {self.startup_timeout:g} s; "
                        f"see {self.log_path}"
                    )
                time.sleep(0.05)
            self.startup_s = time.perf_counter() - t0
            log(
                f"{self.name} healthy after {self.startup_s:.2f} s "
                f"(RSS {self.sampler.last / MiB:.0f} MiB)"
            )
            # tokenmill answers at once and compiles its decode step in the background: measure the
            # steady state, not the eager steps served meanwhile
            while httpx.get(self.url + "/health", timeout=5.0).json().get("decode") == "compiling":
                if time.perf_counter() - t0 > self.startup_timeout:
                    raise RuntimeError(
                        f"{self.name} still compiling after {self.startup_timeout:g} s"
                    )
                time.sleep(0.5)
            self.ready_s = time.perf_counter() - t0
            if self.ready_s - self.startup_s > 1:
                log(f"{self.name} decode graphs compiled after {self.ready_s:.1f} s")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def peak_rss_mib(self) -> float:
        return self.sampler.peak / MiB if self.sampler else 0.0

    def __exit__(self, *exc) -> None:
        if self.sampler:
            self.sampler.stop()
        if self.proc:
            kill_tree(self.proc)
        self._log.close()


def handle_sigterm() -> None:
    """Turn SIGTERM (and SIGHUP) into KeyboardInterrupt so `finally` blocks kill the servers."""

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    # even when started with SIGINT ignored (`cmd &`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_interrupt)
    signal.signal(signal.SIGHUP, raise_interrupt)


def main_guard(main) -> int:
    """Run a script's main; Ctrl-C / SIGTERM end it with status 130 after its `finally` blocks
    ran."""
    handle_sigterm()
    try:
        return main()
    except KeyboardInterrupt:
        log("interrupted (any server started was stopped)")
        return 130


def tokenmill_cmd() -> list[str]:
    """The `tokenmill` console script of this interpreter's environment."""
    script = Path(sys.executable).parent / "tokenmill"
    if script.is_file():
        return [str(script)]
    return [
        sys.executable,
        "-c",
        "import sys; from tokenmill.cli.main import main; sys.exit(main())",
    ]


def tokenmill_serve_cmd(model: Path, port: int, *flags: str) -> list[str]:
    """`tokenmill serve` of the model on loopback at the port, logging warnings only, with the
    flags."""
    return tokenmill_cmd() + [
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *flags,
    ]


def llama_server_cmd(binary: Path, model: Path, port: int, threads: int, *flags: str) -> list[str]:
    """llama-server serving the model on loopback at the port with this many threads, with the
    flags."""
    return [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        *flags,
    ]


def thread_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------- reporting


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# The CPU features that decide tokenmill's kernels and dtype (and llama.cpp's), as /proc/cpuinfo
# names them; results record which of them the machine has.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def machine_info() -> dict[str, object]:
    import torch

    cpu = platform.processor()
    flags: set[str] = set()
    try:  # the first processor's entry: every core of these machines is the same
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        first = ""
    for line in first.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            cpu = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    try:
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        rev += "-dirty" if dirty else ""
    except OSError:
        rev = ""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "cpu": cpu,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "tokenmill_git": rev,
        "load_avg_1m_at_start": load,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def run_record(
    benchmark: str, script: str, args: argparse.Namespace, path: Path, argv: list[str] | None
) -> dict[str, object]:
    """The fields every result JSON starts with: what ran (the script's command line, its settings
    but --out), on which model file and machine."""
    return {
        "benchmark": benchmark,
        "model": args.model,
        "model_path": str(path),
        "model_file": path.name,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "command": shlex.join(
            ["python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": machine_info(),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain text table, first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers] + rows) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    log(f"wrote {path}")
