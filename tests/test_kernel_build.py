"""The small-rows kernel is built once per build key and only where a call's plan runs it (`kernels/build.py`,
`kernels.small_rows.load`): float32 / float16 models and `linear_kernel="off"` calls build nothing, a build's
folder is named by what the binary depends on, processes building one key at once build it once, and the call
that paid for the build says so (`SpeculativeStats.kernel_build_seconds`)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny import PAD, perturbed_copy, tiny_lm

from hf_specsample import DraftForm, SpeculativeConfig, prepare_draft
from hf_specsample.kernels import build, small_rows
from hf_specsample.prepare.form_choice import weighed_forms

PROMPT = torch.tensor([[1, 5, 2, 5, 3, 7, 1, 4, 2, 6, 3, 5, 1, 7, 2, 4, 6]])  # 17 tokens: AUTO calibrates on it
REPO = Path(__file__).resolve().parents[1]


def pair(dtype=torch.float32):
    target = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=64).to(dtype)
    return target, perturbed_copy(target, seed=1, scale=0.3)


def generate(target, **kwargs):
    return target.generate(
        PROMPT, do_sample=False, max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True, **kwargs
    )


@pytest.fixture
def no_build(monkeypatch):
    """Fails a test that builds (or loads) the kernel."""

    def refuse():
        raise AssertionError("the small-rows kernel was built for a call whose plan cannot run it")

    monkeypatch.setattr(small_rows, "load", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_float32_or_float16_call_builds_nothing(no_build, dtype):
    """Under every default (draft_form="auto", linear_kernel="auto"), seeded or timed: the draft's forms are as given
    and dynamic int8, the models' linears run eagerly."""
    target, draft = pair(dtype)
    out = generate(target, draft_model=draft)
    assert out.speculative_stats.kernel_build_seconds == 0.0
    assert "int8_weights" not in out.speculative_stats.draft_form  # not weighed
    generate(target, draft_model=perturbed_copy(target, seed=2, scale=0.3), generator=torch.Generator().manual_seed(0))
    generate(target, draft_model="auto")


def test_a_linear_kernel_off_call_builds_nothing(no_build):
    """bf16 models under linear_kernel="off": their linears run eagerly and AUTO leaves the kernel's forms out; a
    draft prepared as given (target bf16) times nothing and builds nothing either."""
    target, draft = pair(torch.bfloat16)
    for form in ("as_given", "auto", "dynamic_int8"):
        config = SpeculativeConfig(linear_kernel="off", draft_form=form)
        out = generate(target, draft_model=draft, speculative_config=config)
        assert out.speculative_stats.kernel_build_seconds == 0.0
        assert "weights" not in out.speculative_stats.draft_form
    assert prepare_draft(draft, target, form="as_given").form is DraftForm.AS_GIVEN


def test_auto_weighs_the_kernels_forms_for_bf16_drafts_only():
    fp32, bf16 = tiny_lm(seed=0, vocab_size=16, layers=1, hidden=16), tiny_lm(seed=0, vocab_size=16, layers=1)
    bf16 = bf16.to(torch.bfloat16)
    assert weighed_forms(fp32) == weighed_forms(fp32.half()) == (DraftForm.DYNAMIC_INT8,)
    assert weighed_forms(bf16) == (DraftForm.DYNAMIC_INT8, DraftForm.INT8_WEIGHTS, DraftForm.INT4_WEIGHTS)
    assert weighed_forms(bf16, kernel=False) == (DraftForm.DYNAMIC_INT8,)


def test_the_call_that_builds_the_kernel_says_how_long_it_took(built, monkeypatch):
    """The first call in a process whose plan runs the kernel carries the build's seconds; later ones 0.0. (The
    operator is already registered here: `_build` stands for the 15-20 s of compiling it.)"""
    monkeypatch.setattr(small_rows, "_LOADED", [])
    monkeypatch.setattr(small_rows, "_build", lambda: small_rows.Build(None, 17.5, compiled=True))
    fp32_target, fp32_draft = pair()
    assert generate(fp32_target, draft_model=fp32_draft).speculative_stats.kernel_build_seconds == 0.0
    assert small_rows.loaded() is None  # the float32 call did not build
    target, draft = pair(torch.bfloat16)
    first = generate(target, draft_model=draft).speculative_stats
    assert first.kernel_build_seconds == 17.5 and "17.5 s readying the kernel" in str(first)
    assert "operator compiled in 17.5 s" in first.linear_kernel
    assert generate(target, draft_model=draft).speculative_stats.kernel_build_seconds == 0.0


def test_the_build_key_changes_with_what_the_binary_depends_on(tmp_path, monkeypatch):
    """Source, flags, torch, Python and the compiler each change the key, and so the folder: two environments of
    different torches never share (and rebuild) one folder; the same inputs give the same folder."""
    source = tmp_path / "kernel.cpp"
    source.write_text("int answer() { return 42; }\n")
    monkeypatch.setattr(build, "compiler_identity", lambda: "c++: g++ 12.2.0")

    def key(cflags=("-O3",)):
        return build.build_key(source, cflags, ["-fopenmp"])

    base = key()
    assert key() == base
    keys = {"flags": key(("-O2",))}
    for what, owner, name, value in (
        ("compiler", build, "compiler_identity", lambda: "c++: clang 17"),
        ("torch", torch, "__version__", "2.99.0+cpu"),
        ("python", build.platform, "python_version", lambda: "3.99.0"),
    ):
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, value)
            keys[what] = key()
    source.write_text("int answer() { return 43; }\n")
    keys["source"] = key()
    folders = {what: key.folder("lib", tmp_path) for what, key in keys.items()}
    assert len({*folders.values(), base.folder("lib", tmp_path)}) == len(keys) + 1
    assert all(folder.parent == tmp_path and folder.name.startswith("lib-") for folder in folders.values())
    monkeypatch.setenv("HF_SPECSAMPLE_CACHE", str(tmp_path / "cache"))
    assert base.folder("lib") == tmp_path / "cache" / "kernels" / f"lib-{base.digest}"


CHILD = """
import sys
from pathlib import Path
from hf_specsample.kernels import build
built = build.compiled_library("hf_specsample_test_library", Path(sys.argv[1]), [], [], root=Path(sys.argv[2]))
print("compiled" if built.compiled else "loaded")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the fake compiler is a shell script")
def test_processes_building_one_key_at_once_build_it_once(tmp_path, monkeypatch):
    """Two processes start building into a fresh folder at the same time, through a compiler that logs each
    compilation and takes a second longer: one compiles, the other waits and loads its library. A baton torch's
    builder left behind (a build killed midway) does not make them wait for ever."""
    real = subprocess.run(["sh", "-c", "command -v c++"], capture_output=True, text=True).stdout.strip()
    if not real:
        pytest.skip("no C++ compiler here")
    log = tmp_path / "compilations.log"
    compiler = tmp_path / "bin" / "g++"  # a name torch's builder takes for gcc's
    compiler.parent.mkdir()
    compiler.write_text(
        textwrap.dedent(f"""\
            #!/bin/sh
            case " $* " in *" -c "*) echo "$*" >> {log}; sleep 1;; esac
            exec {real} "$@"
            """)
    )
    compiler.chmod(0o755)
    source = tmp_path / "answer.cpp"
    source.write_text('extern "C" int hf_specsample_test_answer() { return 42; }\n')
    monkeypatch.setenv("CXX", str(compiler))
    folder = build.build_key(source, [], []).folder("hf_specsample_test_library", tmp_path / "builds")
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # torch's baton, as a killed build leaves it
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", CHILD, str(source), str(tmp_path / "builds")]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    children = [subprocess.Popen(command, **pipes) for _ in range(2)]
    results = [child.communicate(timeout=300) for child in children]
    assert all(child.returncode == 0 for child in children), [err[-2000:] for _, err in results]
    assert sorted(out.strip() for out, _ in results) == ["compiled", "loaded"]
    assert len(log.read_text().splitlines()) == 1
    assert (folder / build.DONE_FILE).exists() and not (folder / "lock").exists()
