"""llama.cpp's tokenizer test files, from the llama.cpp source that llama-cpp-python 0.3.36 ships.

Its `models/` folder holds vocab-only GGUFs with test vectors (`ggml-vocab-*`), and
`src/llama-vocab.cpp` the vocabulary and pre types llama.cpp knows. Four of the vocabularies are
committed in tests/data/tokenizer-vectors; the rest (13 MB compressed) come from the source package,
fetched with pip from PyPI into the cache on first use (77 MB) and checked against its hash.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tokenmill.catalog import cache_root

VECTORS = Path(__file__).parent / "data" / "tokenizer-vectors"
SDIST = "llama-cpp-python==0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
WANTED = ("vendor/llama.cpp/models/ggml-vocab-", "vendor/llama.cpp/src/llama-vocab.cpp")


@functools.cache
def llama_cpp_files() -> Path:
    """A folder with the `ggml-vocab-*` files and `llama-vocab.cpp`, fetched once."""
    folder = cache_root() / "test-data" / SDIST.replace("==", "-")
    if (folder / "llama-vocab.cpp").is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", SDIST, "--no-deps", "--no-binary", ":all:",
             "--dest", tmp, "--quiet"],
            check=True,
        )  # fmt: skip
        archive = next(Path(tmp).glob("*.tar.gz"))
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{archive.name} has sha256 {digest}, expected {SDIST_SHA256}")
        unpacked = Path(tmp) / "files"
        unpacked.mkdir()
        with tarfile.open(archive) as tar:
            for member in tar:
                path = member.name.split("/", 1)[-1]  # past the top folder
                source = tar.extractfile(member) if path.startswith(WANTED) else None
                if source is not None:
                    (unpacked / Path(path).name).write_bytes(source.read())
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.move(unpacked, folder)  # the cache may be on another file system than tmp
    return folder


def vocab_file(name: str, suffix: str) -> Path:
    """Path to llama.cpp's file `ggml-vocab-{name}{suffix}`: committed, else from the source
    package."""
    committed = VECTORS / f"ggml-vocab-{name}{suffix}"
    return committed if committed.is_file() else llama_cpp_files() / committed.name
