"""Every measuring module of `hf_specsample_bench` runs on tiny models, so none of them breaks unnoticed.

Their figures are printed, never asserted: these tests only check that each entry point runs to its table with the
smallest settings it takes (tiny pair or tiny shapes, one prompt, a few tokens). The modules that time private
library methods (`hybrid_rollback`) fail loudly when those methods are renamed or no longer called; running them here
is what catches it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_blocks import REPO

from hf_specsample_bench import (
    code_editing,
    compiled_verification,
    draft_weight_forms,
    hybrid_rollback,
    processor_cost,
    rank_oracle,
    round_profile,
    structured,
    suffix,
)
from hf_specsample_bench.hybrids import tiny_hybrid


def test_code_editing_on_the_tiny_pair(capsys):
    code_editing.main(
        ["--pair", "tiny", "--num-prompts", "1", "--prompt-offset", "0", "--max-new-tokens", "4",
         "--methods", "lookup,draft,draft + lookup"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "same text from every method: True" in out
    assert "draft + lookup" in out.splitlines()[-1]


def test_compiled_verification_eager_methods_on_the_tiny_pair(capsys):
    compiled_verification.main(
        ["--pair", "tiny", "--prompts", "1", "--new-tokens", "4", "--skip-curve", "--modes", "greedy",
         "--methods", "target eager,target + kernel,assistant_model=,hf_specsample eager"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "hf_specsample eager" in out.splitlines()[-1]


def test_round_profile_on_the_tiny_pair(capsys):
    round_profile.main(
        ["--pair", "tiny", "--lookahead", "2", "--context", "16", "--repeats", "1", "--bandwidth-gib", "0.01"]
    )
    out = capsys.readouterr().out
    assert "rollback (crop both caches)" in out.splitlines()[-1]
    assert "target forward, 3 position(s)" in out


def test_processor_cost_on_the_poor_pair(capsys):
    processor_cost.main(
        ["--processor-ms", "0", "--pairs", "poor", "--modes", "greedy", "--new-tokens", "4", "--repeats", "1"]
    )
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("poor  0 ms processor") and "ratio" in out[-1]


def test_structured_on_the_tiny_pair(capsys):
    pytest.importorskip("xgrammar")
    modes = "greedy,sampling,sampling-manual-seed"
    structured.main(["--pair", "tiny", "--problems", "1", "--max-new-tokens", "8", "--modes", modes])
    out = capsys.readouterr().out
    assert "identical texts 1/1" in out  # greedy under the grammar: plain's text
    assert "sampling:" in out and "sampling-manual-seed:" in out and "assistant_model=" in out.splitlines()[-1]


def test_suffix_workloads_on_the_tiny_pair(capsys):
    suffix.main(["--pair", "tiny", "--workload", "repeated", "--problems", "1", "--samples", "2", "--max-new-tokens",
                 "6", "--methods", "plain,suffix,suffix + model", "--batched", "--pass-at"])  # fmt: skip
    out = capsys.readouterr().out
    assert "suffix + model:" in out and "x plain" in out and "pass@2" in out.splitlines()[-1]
    suffix.main(["--pair", "tiny", "--workload", "agent", "--problems", "1", "--max-new-tokens", "4",
                 "--methods", "suffix"])  # fmt: skip
    out = capsys.readouterr().out
    assert "x plain" not in out  # plain runs only when named
    assert "suffix:" in out and "store of 'suffix'" in out.splitlines()[-1]


def test_draft_weight_forms_on_a_tiny_shape(capsys):
    from hf_specsample.kernels import small_rows

    if small_rows.load().problem is not None:
        pytest.skip(f"the small-rows kernel is not available here: {small_rows.load().problem}")
    draft_weight_forms.main(["--tiny", "--layers", "1", "--repeats", "1", "--bandwidth-gib", "0.01"])
    out = capsys.readouterr().out
    assert "tiny" in out.splitlines()[-1] and "M=5" in out.splitlines()[-1]


def test_hybrid_rollback_on_one_tiny_family(capsys):
    pytest.importorskip("transformers.models.lfm2")
    hybrid_rollback.main(
        ["--families", "lfm2", "--size", "tiny", "--batch", "2", "--new-tokens", "6", "--repeats", "1", "--no-defer"]
    )
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("lfm2") and "hybrid" in out[-1]


def test_hybrid_rollback_refuses_when_rollbacks_go_untimed(monkeypatch):
    """A rollback that no longer goes through `CachedModel.rollback` is an error, not a table of zeros."""
    pytest.importorskip("transformers.models.lfm2")
    monkeypatch.setattr(hybrid_rollback, "timed_rollbacks", lambda target: _nothing_timed())
    target = tiny_hybrid("lfm2", seed=0, vocab_size=hybrid_rollback.VOCAB)
    draft = hybrid_rollback._noisy_copy(target, 0.5)
    with pytest.raises(RuntimeError, match="no rollback was timed"):
        hybrid_rollback.measure(target, draft, batch=2, new_tokens=8, repeats=1)


class _nothing_timed:
    def __enter__(self):
        return []

    def __exit__(self, *exc):
        return False


def test_versions_against_this_checkout_on_the_tiny_pair():
    """Its own process: importing the base copy of the library wraps `generate()` once more."""
    result = subprocess.run(
        [sys.executable, "-m", "hf_specsample_bench.versions", "--base", "HEAD", "--pair", "tiny",
         "--num-prompts", "1", "--max-new-tokens", "2", "--modes", "greedy"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "this/base" in result.stdout


def test_a_base_with_another_kernel_source_gets_operators_of_its_own(tmp_path):
    """Two builds registering one operator namespace abort the process: a base whose small_rows.cpp differs is renamed
    throughout (its C++ library, its Python calls, its extension's name); an identical one is left sharing ours."""
    from hf_specsample_bench.versions import own_kernel

    mine = (REPO / "hf_specsample" / "kernels" / "small_rows.cpp").read_text()
    wrapper = (
        'load("hf_specsample_small_rows")\ntorch.ops.hf_specsample.paths()\nfake("hf_specsample::small_rows_linear")\n'
    )
    for changed in (False, True):
        kernels = tmp_path / str(changed) / "kernels"
        kernels.mkdir(parents=True)
        (kernels / "small_rows.cpp").write_text(mine + ("// changed\n" if changed else ""))
        (kernels / "small_rows.py").write_text(wrapper)
        own_kernel(kernels.parent)
        source, calls = (kernels / "small_rows.cpp").read_text(), (kernels / "small_rows.py").read_text()
        assert ("TORCH_LIBRARY(hf_specsample_base," in source) is changed
        assert ("TORCH_LIBRARY_IMPL(hf_specsample_base," in source) is changed
        assert ("TORCH_LIBRARY(hf_specsample," in source) is not changed
        renamed = 'load("hf_specsample_base_small_rows")\ntorch.ops.hf_specsample_base.paths()\n'
        renamed += 'fake("hf_specsample_base::small_rows_linear")\n'
        assert calls == (renamed if changed else wrapper)


def test_the_renamed_library_names_none_of_our_operators(tmp_path):
    """This checkout's own package, renamed as a later checkout renames it as a base (its kernel source differs): no
    spelling of the `hf_specsample` operator namespace or extension name is left (a missed one would call or
    register ours: a wrong kernel measured, or the process aborted), and every operator its Python calls is one its
    C++ library defines."""
    from hf_specsample_bench.versions import own_kernel

    package = tmp_path / "hf_specsample_base"
    shutil.copytree(REPO / "hf_specsample", package, ignore=shutil.ignore_patterns("__pycache__"))
    source = package / "kernels" / "small_rows.cpp"
    source.write_text(source.read_text() + "// changed\n")
    own_kernel(package)
    ours = re.compile(
        r"torch\.ops\.hf_specsample\b(?!_base)|torch\.ops,\s*[\"']hf_specsample\b(?!_base)|\bhf_specsample::|"
        r"TORCH_LIBRARY\w*\(\s*hf_specsample\s*,|\bhf_specsample_small_rows\b"
    )
    for path in [*package.rglob("*.py"), *package.rglob("*.cpp")]:
        text = path.read_text()
        if path.suffix == ".cpp":
            text = re.sub(r"//[^\n]*", "", text)  # comments name the operators too
        assert not ours.findall(text), f"{path.relative_to(package)} still names our operators: {ours.findall(text)}"
    defined = set(re.findall(r'm\.def\("(\w+)\(', source.read_text()))
    assert "TORCH_LIBRARY(hf_specsample_base," in source.read_text() and defined
    called = {
        name
        for path in package.rglob("*.py")
        for name in re.findall(r"hf_specsample_base(?:\.|::)(\w+)", path.read_text())
    }
    assert called and called <= defined, called - defined


def test_rank_oracle_walks_rounds_along_the_ranks():
    """Rounds along a rank sequence 0 1 0 0 0: a chain of 2 commits (0, then the target's token where the draft's
    second choice was right) and (0 0 0): 2 passes; a tree holding that second choice and first choices under it
    keeps all 5 in one pass, as does every top-2 choice at every node; the best tree of the frequencies takes the
    paths most often taken."""
    ranks = [[0, 1, 0, 0, 0]]
    assert rank_oracle.tokens_per_pass(ranks, rank_oracle.chain(2)) == 5 / 2
    assert rank_oracle.tokens_per_pass(ranks, {(0,), (0, 1), (0, 1, 0), (0, 1, 0, 0)}) == 5 / 1
    assert rank_oracle.coverage_tokens_per_pass(ranks, top=2, depth=5) == 5 / 1
    assert rank_oracle.coverage_tokens_per_pass(ranks, top=1, depth=5) == 5 / 2
    frequencies = rank_oracle.path_frequencies([[0, 1, 0, 1, 0, 1]], depth=2)
    assert rank_oracle.best_tree(frequencies, nodes=3, depth=2) == {(0,), (1,), (0, 1)}


def test_rank_oracle_on_the_tiny_pair(capsys):
    rank_oracle.main(["--pair", "tiny", "--num-problems", "4", "--costs", "30", "230", "10"])
    out = capsys.readouterr().out
    assert "chain of 8" in out and "top 3 choices" in out


def stand_in_llama_cpp(folder: Path, script: str) -> list[str]:
    """A `llama-speculative-simple` in `folder` that runs the shell `script` (llama.cpp is not installed here), empty
    GGUF files beside it, and `llama_cpp.main`'s arguments that run them with ours on the tiny pair."""
    binary = folder / "llama-speculative-simple"
    binary.write_text(f"#!/bin/sh\n{script}\n")
    binary.chmod(0o755)
    (folder / "t.gguf").touch()
    (folder / "d.gguf").touch()
    return ["--pair", "tiny", "--max-new-tokens", "4", "--bin", str(folder), "--target-gguf", str(folder / "t.gguf"),
            "--draft-gguf", str(folder / "d.gguf")]  # fmt: skip


def test_llama_cpp_timings_are_read_from_its_output():
    from hf_specsample_bench.llama_cpp import parse_speculative

    output = (
        "...\nencoded  118 tokens in    1.394 seconds, speed:   84.6 t/s\n"
        "decoded   21 tokens in    2.261 seconds, speed:    9.3 t/s\n"
    )
    run = parse_speculative(output)
    assert (run.tokens, run.prefill_seconds, run.decode_seconds) == (21, 1.394, 2.261)
    assert abs(run.decode_rate - 21 / 2.261) < 1e-9 and abs(run.whole_rate - 21 / 3.655) < 1e-9
    with pytest.raises(ValueError, match="no 'encoded'/'decoded' timing lines"):
        parse_speculative("error: failed to load model")


def test_llama_cpp_comparison_on_the_tiny_pair_with_a_stand_in_binary(tmp_path, capsys):
    """llama.cpp itself is not installed here: a script prints its two timing lines, so the whole comparison runs."""
    from hf_specsample_bench import llama_cpp

    script = 'echo "encoded 9 tokens in 0.100 seconds" >&2; echo "decoded 4 tokens in 0.200 seconds" >&2'
    llama_cpp.main(stand_in_llama_cpp(tmp_path, script) + ["--num-prompts", "2", "--draft-max", "3"])
    out = capsys.readouterr().out
    assert "llama.cpp, draft max 3" in out and "decoding  20.00 tok/s" in out  # 4 tokens in 0.2 s
    assert "over all 2 prompts" in out and "ours, chain of 8" in out
    assert "x llama.cpp's best" in out


def test_llama_cpp_rates_are_set_against_its_best_at_each_rate(tmp_path, capsys):
    """llama.cpp's best decoding and its best whole call can come from different draft sizes: each of ours' rates is
    set against the best at that rate (here draft max 3 decodes faster, draft max 8 has the faster whole call)."""
    from hf_specsample_bench import llama_cpp

    fast_decoding = 'echo "encoded 9 tokens in 1.000 seconds" >&2; echo "decoded 4 tokens in 0.100 seconds" >&2'
    fast_whole = 'echo "encoded 9 tokens in 0.100 seconds" >&2; echo "decoded 4 tokens in 0.200 seconds" >&2'
    script = f'case "$*" in *"-n-max 3"*) {fast_decoding};; *) {fast_whole};; esac'
    llama_cpp.main(stand_in_llama_cpp(tmp_path, script) + ["--num-prompts", "1", "--draft-max", "3,8"])
    out = " ".join(capsys.readouterr().out.split())
    assert "llama.cpp, draft max 3 40.00 3.64 (1.00x, 0.27x llama.cpp's best)" in out
    assert "llama.cpp, draft max 8 20.00 13.33 (0.50x, 1.00x llama.cpp's best)" in out


def test_llama_cpp_counts_ours_first_round_with_the_prompt():
    """The target verifies our first round's draft in the prompt's forward (over more than 16 positions, the
    prefill): that round's tokens count toward the whole call, not toward decoding, as llama.cpp's first round,
    verified in its decoding, counts toward its own."""
    import torch

    import hf_specsample
    from hf_specsample import SpeculativeConfig
    from hf_specsample_bench.llama_cpp import PREFILL_POSITIONS, PrefillClock, ours
    from hf_specsample_bench.pairs import BenchPair, load_bench_pair

    target, draft, tokenizer = load_bench_pair(BenchPair.TINY, torch.bfloat16, progress=False)
    prepared = hf_specsample.prepare_draft(draft, target)
    input_ids = tokenizer("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", return_tensors="pt").input_ids
    assert input_ids.shape[1] > PREFILL_POSITIONS
    widths = []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    clock = PrefillClock([target, draft, prepared.model])
    config = SpeculativeConfig(num_lookahead=4, draft_shape="chain")
    run = ours(target, prepared, clock, input_ids, 12, config)
    clock.remove()
    assert widths[0] == input_ids.shape[1] + 4  # the prompt and the first round's draft, in one forward
    assert max(widths[1:]) <= PREFILL_POSITIONS and run.prefill_seconds > 0
    first_round = run.tokens - run.decode_tokens
    assert run.tokens == 12 and 1 <= first_round <= 5
    assert run.decode_rate == run.decode_tokens / run.decode_seconds
    every_id = sorted(tokenizer.get_vocab().values())  # any token ends the text: it stops at its first
    assert ours(target, prepared, clock, input_ids, 12, config, every_id).tokens == 1


def test_llama_cpp_end_ids_are_the_checkpoints_and_llama_cpps():
    """Ours ends a text where llama.cpp does: the checkpoint's eos and every token llama.cpp ends a text at by its
    text (Qwen2.5: <|endoftext|>, <|im_end|>, <|fim_pad|>, <|repo_name|>, <|file_sep|>)."""
    from hf_specsample_bench.llama_cpp import end_ids

    class Vocabulary:
        def get_vocab(self):
            return {"a": 1, "<|endoftext|>": 5, "<|im_end|>": 7, "<|file_sep|>": 9, "<|im_start|>": 11}

    assert end_ids(Vocabulary(), 7) == [5, 7, 9]
    assert end_ids(Vocabulary(), [3, 7]) == [3, 5, 7, 9]
    assert end_ids(Vocabulary(), None) == [5, 7, 9]


def test_llama_cpp_refuses_what_cannot_run_before_loading_models(tmp_path, capsys):
    """No binary in --bin, missing GGUF files, a bad --draft-max: a usage error saying what to do, no traceback."""
    from hf_specsample_bench import llama_cpp

    gguf = ["--target-gguf", str(tmp_path / "t.gguf"), "--draft-gguf", str(tmp_path / "d.gguf")]
    for argv, said in (
        (["--bin", str(tmp_path), *gguf], "no executable llama-speculative-simple in"),
        (["--bin", str(tmp_path), *gguf], "--target-gguf " + str(tmp_path / "t.gguf") + ": no such file"),
        (["--draft-max", "3,x"], "--draft-max '3,x': whole numbers"),
        (["--pair", "qwen-coder-smollm2"], "its draft has its own tokenizer; choose a pair with one"),
    ):
        with pytest.raises(SystemExit) as exited:
            llama_cpp.main(["--pair", "tiny", *argv])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err


def test_llama_cpp_binary_that_fails_is_reported_with_its_command(tmp_path, capsys):
    """A llama.cpp run that exits with an error: exit status 1, the command and the end of its output quoted."""
    from hf_specsample_bench import llama_cpp

    binary = tmp_path / "llama-speculative-simple"
    binary.write_text('#!/bin/sh\necho "error: failed to load model" >&2\nexit 1\n')
    binary.chmod(0o755)
    (tmp_path / "t.gguf").touch()
    (tmp_path / "d.gguf").touch()
    with pytest.raises(SystemExit) as exited:
        llama_cpp.main(
            ["--pair", "tiny", "--num-prompts", "1", "--max-new-tokens", "4", "--bin", str(tmp_path),
             "--target-gguf", str(tmp_path / "t.gguf"), "--draft-gguf", str(tmp_path / "d.gguf"), "--draft-max", "3"]
        )  # fmt: skip
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert "exited with status 1; run it by hand" in err and "failed to load model" in err and str(binary) in err
    with pytest.raises(llama_cpp.LlamaCppFailed, match="no 'encoded'/'decoded' timing lines"):
        binary.write_text("#!/bin/sh\necho hello\n")
        llama_cpp.llama_speculative(tmp_path, tmp_path / "t.gguf", tmp_path / "d.gguf", "def f():", 4, 3)


def test_llama_cpp_reads_the_prompt_as_given(monkeypatch):
    """`-f` drops a file's last newline: the file holds one more, so llama.cpp continues the prompt ours continues."""
    from hf_specsample_bench import llama_cpp

    seen = {}

    def run(command, **kwargs):
        seen["prompt"] = Path(command[command.index("-f") + 1]).read_text().removesuffix("\n")  # as llama.cpp reads
        output = "encoded 9 tokens in 0.100 seconds\ndecoded 4 tokens in 0.200 seconds\n"
        return subprocess.CompletedProcess(command, 0, stdout="", stderr=output)

    monkeypatch.setattr(llama_cpp.subprocess, "run", run)
    prompt = 'def f():\n    """Doc."""\n'
    llama_cpp.llama_speculative(Path("/bin"), Path("t.gguf"), Path("d.gguf"), prompt, 4, 3)
    assert seen["prompt"] == prompt
