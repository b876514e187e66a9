"""C++ CPU kernels (`torch.ops.tokenmill.*`), compiled for the local CPU on first use and cached.

`int8_linear` multiplies a few activation rows by an int8 weight faster than PyTorch's
`_weight_int8pack_mm` (see gemv.cpp), `int4_rows_linear` and `int6_rows_linear` by 4- or 5-bit and
6-bit (Q6_K) ones. They and `int4_linear` pick their means (a weight-only kernel or a bf16 matmul)
by the number of rows when they run, so one compiled graph serves every batch size with the best of
both. `dense_linear` multiplies by a dense fp32 weight, summing every row in one order whatever the
batch (dense.cpp). `gated_activation` is the MLP's act(gate) * up in one pass, for eager steps
(activation.cpp), `rms_norm` the model's norm (norm.cpp), `rotary` the rotary embedding and
`rotary_write_kv` an eager step's way from the fused q/k/v projection to the cache (rotary.cpp);
`decode_attention` attends one query token per sequence over the paged KV cache (attention.cpp);
`greedy_ids` is a vectorized argmax of each row of logits and `sample_ids` a draw from each row's
softmax (sample.cpp); `decoder_layer` computes an eager step's pre-norm layer in one call of those
ops (layer.cpp, bound for Python only); `q4_k_groups`, `q4_k_int4_rows`, `q4_k_tiles`,
`q4_int4_rows`, `q6_k_int6_rows`, `q6_k_tiles`, `q6_k_int8_rows`, `q8_0_int8_rows` and `tile_bytes`
lay GGUF weights out for the others while a model loads (layout.cpp, bound for Python only).
Python's eager code calls them through their pybind11 bindings (`ops`, bindings.cpp), compiled
graphs through the dispatcher. They build (g++ through `torch.utils.cpp_extension`) as one
translation unit per core, each including several sources (balanced by `SOURCE_COMPILE_SECONDS`):
torch's headers are parsed once per unit, and only bindings.cpp's unit parses pybind11's and the
dispatcher's (the kernel sources include ATen's tensor and the ops they call).
`build_in_background` runs the build on a daemon thread, at the lowest priority, while PyTorch's
kernels serve; a model loaded inside `deferred()` meanwhile takes the layouts of PyTorch's kernels
rather than waiting for it. The library is cached under ~/.cache/tokenmill/kernels, keyed by its
sources, the torch version and the CPU's features, so later starts load it without compiling; a
build holds an OS lock on its directory (`build_lock`), so one killed midway stops no later one.
Where it cannot be built (no compiler, an x86 CPU without AVX2 and FMA, another architecture),
everything keeps using PyTorch's kernels. simd.h holds their vector operations for AVX-512 and for
AVX2.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tokenmill.catalog import cache_root

log = logging.getLogger("tokenmill.kernels")
# Each source's own share of the build: seconds of one core past the headers that every translation
# unit parses once (ATen's tensor and the few ops the kernels call); bindings.cpp's share includes
# the heavier headers of pybind11 and the dispatcher's registration, which only its unit parses.
# Their ratios are what count: `_translation_units` balances the units by them. With AVX-512,
# gemv.cpp also compiles the tile kernels; on AVX2 alone it is a smaller share.
SOURCE_COMPILE_SECONDS = {
    "gemv.cpp": 30.9,
    "bindings.cpp": 24.8,
    "attention.cpp": 15.2,
    "rotary.cpp": 5.9,
    "layout.cpp": 4.2,
    "sample.cpp": 3.1,
    "activation.cpp": 1.7,
    "dense.cpp": 1.2,
    "norm.cpp": 0.7,
    "layer.cpp": 0.2,
}
SOURCE_COMPILE_SECONDS_AVX2 = {
    "bindings.cpp": 23.2,
    "gemv.cpp": 10.7,
    "attention.cpp": 8.1,
    "layout.cpp": 4.0,
    "rotary.cpp": 3.3,
    "sample.cpp": 2.6,
    "activation.cpp": 1.2,
    "dense.cpp": 0.4,
    "norm.cpp": 0.4,
    "layer.cpp": 0.2,
}
SOURCES = [Path(__file__).with_name(name) for name in SOURCE_COMPILE_SECONDS]
HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "ops.h")]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
FAILED_MARKER = "build-failed.txt"  # a failed build is not retried on every start
# The nice value of the threads that compile in the background (this library's build where a model
# serves meanwhile, the decode graphs), and so of the compilers they start (they inherit it): the
# lowest priority, so that the steps serving meanwhile come first for the cores and a busy server's
# answers slow less, while the build takes longer (see the tuning log).
COMPILE_NICE = 19
_lock = threading.Lock()
_thread_lock = threading.Lock()
_loaded = False
_thread: threading.Thread | None = None
_bindings: ModuleType | None = None  # the library's pybind11 module, once loaded
_deferring = threading.local()  # .active: this thread loads a model without the kernels


def ops() -> Any:
    """Where Python calls the kernels: their pybind11 bindings in eager code, torch.ops.tokenmill
    where torch.compile traces (it sees ops through the dispatcher only). The same functions either
    way; a binding's call skips the dispatcher's argument parsing (ops.h)."""
    if _bindings is None or torch.compiler.is_compiling():
        return torch.ops.tokenmill
    return _bindings


def loaded() -> bool:
    """Whether the kernels are registered (as `torch.ops.tokenmill.*`)."""
    return _loaded


def build_directory() -> Path:
    key = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS))
    for part in (torch.__version__, platform.machine(), cpu_flags(), *CFLAGS):
        key.update(part.encode())
    return cache_root() / "kernels" / key.hexdigest()[:16]


def cpu_flags() -> str:
    """The CPU's feature flags: `-march=native` code must not run on another CPU model."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_has_amx() -> bool:
    """Whether the CPU has AMX (bf16): oneDNN's matmuls and PyTorch's flash attention then use the
    matrix unit, which changes which of tokenmill's kernels pay."""
    return "amx_bf16" in cpu_flags().split()


def load(build: bool = True) -> bool:
    """Register the kernels, compiling them first if they are not cached and `build` is set.

    Returns whether they are registered; a failed build is logged, remembered in the cache
    directory (delete it to retry) and leaves PyTorch's kernels in use. Inside `deferred()` it
    returns False at once, whatever the build has got to.
    """
    global _loaded, _bindings
    if getattr(_deferring, "active", False):
        return False
    with _lock:
        if _loaded:
            return True
        directory = build_directory()
        library = directory / "tokenmill_kernels.so"
        if not library.exists():
            if not build or (directory / FAILED_MARKER).exists():
                return False
            try:
                _compile(directory)
            except Exception as exc:  # noqa: BLE001 - no compiler or no AVX2: PyTorch's kernels serve
                (directory / FAILED_MARKER).write_text(f"{exc}\n")
                log.warning(
                    "building the CPU kernels failed, using PyTorch's instead (%s; details in %s)",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                    directory,
                )
                return False
        torch.ops.load_library(str(library))
        spec = importlib.util.spec_from_file_location("tokenmill_kernels", library)
        bindings = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bindings)
        torch.library.register_fake("tokenmill::int8_linear")(_int8_shape)
        torch.library.register_fake("tokenmill::int4_linear")(_int4_shape)
        torch.library.register_fake("tokenmill::int4_rows_linear")(_int4_rows_shape)
        torch.library.register_fake("tokenmill::int6_rows_linear")(_int6_rows_shape)
        torch.library.register_fake("tokenmill::quant_tiles_linear")(_quant_tiles_shape)
        torch.library.register_fake("tokenmill::gated_activation")(_gated_shape)
        torch.library.register_fake("tokenmill::decode_attention")(_decode_attention_shape)
        torch.library.register_fake("tokenmill::greedy_ids")(_greedy_ids_shape)
        torch.library.register_fake("tokenmill::rms_norm")(_rms_norm_shape)
        torch.library.register_fake("tokenmill::rotary")(_rotary_shape)
        torch.library.register_fake("tokenmill::dense_linear")(_dense_shape)
        _bindings, _loaded = bindings, True
        return True


def build_in_background() -> threading.Thread | None:
    """Load the kernels now if cached, else build them on a daemon thread (returned; None if
    there is nothing to wait for). Only the CPU has these kernels."""
    global _thread
    with _thread_lock:  # not `_lock`, which the build holds throughout
        if _thread is None:
            if load(build=False):
                return None
            _thread = threading.Thread(
                target=_build_at_low_priority, name="tokenmill-kernels", daemon=True
            )
            _thread.start()
        return _thread if _thread.is_alive() else None


def _build_at_low_priority() -> None:
    lower_thread_priority()
    load()


def lower_thread_priority() -> None:
    """Give the calling thread `COMPILE_NICE`, where the OS sets it per thread (Linux); elsewhere
    the thread keeps the process's priority."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
        except OSError as exc:  # a container that forbids it: compile at the usual priority
            log.debug("could not lower the compile thread's priority: %r", exc)


@contextmanager
def deferred() -> Iterator[None]:
    """On this thread, `load` answers False without waiting for a build: a model loaded meanwhile
    takes PyTorch's layouts throughout, even where the build ends halfway through its load. Its
    layers still call the kernels, once loaded, wherever their layouts allow."""
    _deferring.active = True
    try:
        yield
    finally:
        _deferring.active = False


def _compile(directory: Path) -> None:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        # torch drives the build with ninja: the pip package's will do
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    directory.mkdir(parents=True, exist_ok=True)
    log.info("building the CPU kernels in %s (once per machine and version)", directory)
    with build_lock(directory):
        cpp_extension.load(
            name="tokenmill_kernels",
            sources=[str(unit) for unit in _translation_units(directory)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )


# torch's lock file in a build directory (cpp_extension's FileBaton)
TORCH_BUILD_LOCK = "lock"


@contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold an OS lock on the build directory (`flock`) while building there. The OS releases it
    when its process ends, however it ends, where torch's own lock file (`TORCH_BUILD_LOCK`) stays
    behind a process killed mid-build (a server stopped during its first start) and makes every
    later build wait for it forever. Under this lock no other process builds in the directory, so
    such a file is a dead build's and goes."""
    with open(directory / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / TORCH_BUILD_LOCK).unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def source_compile_seconds() -> dict[str, float]:
    """`SOURCE_COMPILE_SECONDS` for this CPU: the AVX-512 table where `-march=native` compiles
    simd.h's AVX-512 code (AVX-512 F and BW), else the AVX2 one."""
    flags = cpu_flags().split()
    avx512 = "avx512f" in flags and "avx512bw" in flags
    return SOURCE_COMPILE_SECONDS if avx512 else SOURCE_COMPILE_SECONDS_AVX2


def _translation_units(directory: Path) -> list[Path]:
    """One source file per core in `directory`, together including every kernel source: each
    source, longest first, goes to the unit with the least compile time so far, so that the units
    (one per core, compiled at once) finish about together."""
    count = min(len(SOURCES), len(os.sched_getaffinity(0)))
    shares: list[list[Path]] = [[] for _ in range(count)]
    seconds = [0.0] * count
    own = source_compile_seconds()
    for source in sorted(SOURCES, key=lambda s: -own[s.name]):
        least = seconds.index(min(seconds))
        shares[least].append(source)
        seconds[least] += own[source.name]
    units = []
    for index, share in enumerate(shares):
        unit = directory / f"unit{index}.cpp"
        unit.write_text("".join(f'#include "{source}"\n' for source in share))
        units.append(unit)
    return units


def _int8_shape(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    dense: torch.Tensor | None,
    max_gemv_rows: int,
    chunk_rows: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _int4_shape(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    dense: torch.Tensor | None,
    max_packed_rows: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], scales_zeros.shape[1])


def _int4_rows_shape(
    x: torch.Tensor,
    nibbles: torch.Tensor,
    steps_lows: torch.Tensor,
    units: torch.Tensor,
    fifth_bits: torch.Tensor | None,
    dense: torch.Tensor | None,
    max_gemv_rows: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], nibbles.shape[0])


def _int6_rows_shape(
    x: torch.Tensor,
    nibbles: torch.Tensor,
    highs: torch.Tensor,
    steps: torch.Tensor,
    units: torch.Tensor,
    dense: torch.Tensor | None,
    max_gemv_rows: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], nibbles.shape[0])


def _quant_tiles_shape(
    x: torch.Tensor,
    tiles: torch.Tensor,
    tile_scales: torch.Tensor,
    fifth_masks: torch.Tensor | None,
    bits: int,
    dense: torch.Tensor | None,
    max_tile_rows: int,
    x_block: int = 8,
    max_coarse_rows: int = -1,
    amx_min_rows: int = -1,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], tile_scales.shape[0] * 16)


def _dense_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _decode_attention_shape(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _rms_norm_shape(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


def _rotary_shape(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


def _greedy_ids_shape(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.long)


def _gated_shape(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
