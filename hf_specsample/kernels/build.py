"""Building a C++ operator library once per build key, into a folder of its own (`compiled_library`).

torch's extension builder keeps one folder per extension name and rebuilds whenever the command it would run
differs from the last one run there; that command names the torch and the Python it builds against, so two
environments sharing the folder would rebuild each other's binary each time they take turns.
Here every build has its own folder, named by a key made of what the binary depends on (`BuildKey`): the source's
bytes, torch (version, git revision, C++ ABI), Python (implementation and version), the machine's architecture, the
compiler (its file and the first line of its `--version`) and the flags. Environments whose torch and Python
are the same share one build; any other pair gets two folders, each built once.

Where: `<cache>/kernels/<name>-<digest>/` under the library's cache folder (`cache_folder.default_cache_dir()`,
`$HF_SPECSAMPLE_CACHE`), holding torch's build files, the library and `key.json`, the key's parts, written once the
library is whole: a folder with `key.json` is loaded as it is, never rebuilt.

Processes that build one key at once take turns on an OS file lock (`fcntl.flock` on `<folder>/build.lock`, which
the OS releases if its holder dies): one compiles, the others wait, then load what it built. torch's own baton (a
file `lock`, created and deleted by the builder) is left behind by a build that was killed, and would make every
later build of the folder wait for ever; under the flock no one else is building, so a leftover baton is removed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.cache_folder import default_cache_dir

DONE_FILE = "key.json"  # written last: its presence says the library in the folder is whole
SUFFIX = ".pyd" if sys.platform == "win32" else ".so"  # what torch's builder names a library


@dataclass(frozen=True)
class BuildKey:
    """What a built library depends on, part by part; two builds with equal keys make interchangeable binaries.

    Attributes:
        parts: (what, value) pairs, e.g. ("torch", "2.13.0+cpu"), in a fixed order.
    """

    parts: tuple[tuple[str, str], ...]

    @property
    def digest(self) -> str:
        """16 hex digits of the parts' SHA-256: the folder's and the library's suffix."""
        return hashlib.sha256(json.dumps(self.parts).encode()).hexdigest()[:16]

    def folder(self, name: str, root: Path | None = None) -> Path:
        """Where the library `name` built with this key lives: `<root>/<name>-<digest>` (root: the library's cache
        folder's `kernels/`)."""
        return (root if root is not None else default_cache_dir() / "kernels") / f"{name}-{self.digest}"


def build_key(source: Path, cflags: Sequence[str], ldflags: Sequence[str]) -> BuildKey:
    """The key of building `source` with these flags here (`compiler_identity` runs the compiler once a process)."""
    return BuildKey(
        (
            ("source", hashlib.sha256(source.read_bytes()).hexdigest()),
            ("torch", torch.__version__),
            ("torch_git", str(torch.version.git_version)),
            ("cxx11_abi", str(torch._C._GLIBCXX_USE_CXX11_ABI)),
            ("python", f"{sys.implementation.cache_tag} {platform.python_version()}"),
            ("machine", f"{sys.platform} {platform.machine()}"),
            ("compiler", compiler_identity()),
            ("cflags", " ".join(cflags)),
            ("ldflags", " ".join(ldflags)),
        )
    )


def compiler_identity() -> str:
    """The C++ compiler torch's builder runs (`$CXX`, else `c++`): its file, links resolved (`c++` and `g++` are
    often one compiler), and the first line of its `--version`."""
    command = os.environ.get("CXX", "c++")
    found = shutil.which(command)
    return f"{os.path.realpath(found) if found else command}: {_compiler_version(command)}"


@functools.cache  # one `--version` per compiler and process: a compiler does not change under a running process
def _compiler_version(command: str) -> str:
    try:
        result = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:  # no compiler: the build will fail and say so
        return f"unavailable ({type(error).__name__})"
    return (result.stdout.strip().splitlines() or ["?"])[0]


@dataclass(frozen=True)
class Built:
    """A library made ready in this process.

    Attributes:
        path: the shared library, loaded (`torch.ops.load_library`).
        compiled: this process compiled it (else it loaded one an earlier process built, or waited for one
            another process was building).
        seconds: wall time of compiling or waiting, and loading.
    """

    path: Path
    compiled: bool
    seconds: float


def compiled_library(
    name: str, source: Path, cflags: Sequence[str], ldflags: Sequence[str], root: Path | None = None
) -> Built:
    """Load the library built from `source` with these flags, building it first where its key's folder holds none.

    Args:
        name: the library's name; the folder and the file add the key's digest (two keys never share a file).
        root: the folder the keyed folders live in (tests); None: the library's cache folder's `kernels/`.

    Raises:
        whatever building raises (no compiler, a compile error, a folder that cannot be written).
    """
    start = time.perf_counter()
    key = build_key(source, cflags, ldflags)
    folder = key.folder(name, root)
    library = folder / f"{name}_{key.digest}{SUFFIX}"
    compiled = False
    if not _whole(library):
        folder.mkdir(parents=True, exist_ok=True)
        with _exclusive(folder / "build.lock"):
            if not _whole(library):  # no one built it while this process waited
                _compile(library.stem, source, cflags, ldflags, folder)
                (folder / DONE_FILE).write_text(json.dumps(dict(key.parts), indent=1) + "\n")
                compiled = True
    if not compiled:  # the builder loaded it already
        torch.ops.load_library(str(library))
    return Built(library, compiled, time.perf_counter() - start)


def is_built(name: str, source: Path, cflags: Sequence[str], ldflags: Sequence[str], root: Path | None = None) -> bool:
    """Whether a whole build of `source` with these flags waits in its key's folder (`compiled_library` would load it
    without compiling)."""
    key = build_key(source, cflags, ldflags)
    return _whole(key.folder(name, root) / f"{name}_{key.digest}{SUFFIX}")


def _whole(library: Path) -> bool:
    """Whether `library` was built whole (its folder's `DONE_FILE` is written after it) and is still there."""
    return (library.parent / DONE_FILE).exists() and library.exists()


def _compile(name: str, source: Path, cflags: Sequence[str], ldflags: Sequence[str], folder: Path) -> None:
    """torch's extension builder, into `folder` (it compiles, links and loads the library `<folder>/<name>.so`)."""
    from torch.utils.cpp_extension import load as load_extension  # imports setuptools: only when building

    with contextlib.suppress(FileNotFoundError):
        (folder / "lock").unlink()  # torch's baton, left by a killed build: under our lock no one else is building
    load_extension(
        name,
        sources=[str(source)],
        extra_cflags=list(cflags),
        extra_ldflags=list(ldflags),
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (waiting for another process's); the OS drops it with its process.

    Where `fcntl` does not exist (Windows), torch's baton alone keeps two builds apart."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
