"""Benchmark pieces: Leviathan's formula, aggregation, formatting, prompts, and a run on tiny models."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import thread_share
from tiny import char_tokenizer, perturbed_copy, tiny_lm

from hf_specsample_bench.measure import Measurement
from hf_specsample_bench.methods import Method, MethodSpec, Mode, parse_methods
from hf_specsample_bench.passk import truncate
from hf_specsample_bench.prompts import Prompt, PromptSet, PromptStyle, load_problems, load_prompts
from hf_specsample_bench.report import expected_speedup, format_table, summarise, to_json
from hf_specsample_bench.runner import BenchmarkConfig, run_benchmark
from hf_specsample_bench.sweep import plot_sweep, run_sweep


@pytest.mark.parametrize(
    "alpha, lookahead, c, expected",
    [
        (0.0, 3, 0.5, 1 / 2.5),  # nothing accepted: pay for drafting, gain nothing
        (1.0, 3, 0.5, 4 / 2.5),  # everything accepted: K+1 tokens per round
        (0.8, 4, 0.45, (1 - 0.8**5) / (0.2 * 2.8)),
        (0.7, 0, 0.3, 1.0),  # no drafting
    ],
)
def test_expected_speedup_is_theorem_3_8(alpha, lookahead, c, expected):
    assert expected_speedup(alpha, lookahead, c) == pytest.approx(expected)


def test_parse_methods():
    assert parse_methods("target, assisted,hf_specsample,hf_specsample:4") == [
        MethodSpec(Method.TARGET), MethodSpec(Method.ASSISTED), MethodSpec(Method.SPECULATIVE),
        MethodSpec(Method.SPECULATIVE, 4),
    ]  # fmt: skip
    assert MethodSpec(Method.SPECULATIVE, 4).label == "hf_specsample K=4"
    with pytest.raises(ValueError):
        parse_methods("beam")


def test_parse_methods_named_lever_fields():
    from hf_specsample import SpeculativeConfig
    from hf_specsample_bench.methods import Drafter, MethodDrafts

    token, plain, lookup, named, peer = parse_methods(
        "hf_specsample:2:as_given:verify=token,hf_specsample:processors=plain,hf_specsample:lookup=7,"
        "hf_specsample:draft=prompt_lookup,lookup:5"
    )
    assert token == MethodSpec(Method.SPECULATIVE, 2, "as_given", verification="token")
    assert token.label == "hf_specsample K=2 draft as_given verify token"
    assert plain.speculative_config == SpeculativeConfig(fast_processors=False) and plain.uses_draft
    drafts = MethodDrafts(None, None, None)
    drafts.prepared = lambda spec: "prepared"  # what the model drafter passes (no model in this test)
    assert drafts.generate_kwargs(lookup)["prompt_lookup_num_tokens"] == 7 and lookup.label.endswith("lookup 7")
    assert named.drafter is Drafter.PROMPT_LOOKUP and not named.uses_draft
    assert drafts.generate_kwargs(named)["draft_model"] == "prompt_lookup"
    assert peer.label == "transformers lookup 5" and drafts.generate_kwargs(peer) == {"prompt_lookup_num_tokens": 5}
    (tree,) = parse_methods("hf_specsample:8::shape=tree")
    assert tree == MethodSpec(Method.SPECULATIVE, 8, draft_shape="tree") and tree.label.endswith(" tree")
    assert tree.speculative_config == SpeculativeConfig(draft_shape="tree")
    with pytest.raises(ValueError, match="DraftShape"):
        parse_methods("hf_specsample:shape=bush")
    with pytest.raises(ValueError, match="unknown method fields"):
        parse_methods("hf_specsample:speed=fast")


def test_cli_lever_table_on_the_tiny_pair():
    from hf_specsample_bench.cli import run
    from hf_specsample_bench.methods import LEVER_METHODS

    args = ["--pair", "tiny", "--dtype", "float32", "--num-prompts", "1", "--max-new-tokens", "4", "--no-progress"]
    report = run(args + ["--levers", "--modes", "sampling"])
    labels = {row["label"] for row in report["summary"]}
    assert labels == {spec.label for spec in parse_methods(LEVER_METHODS)} and len(labels) == 9
    assert report["meta"]["load_from"] == "checkpoint"


def fake(label, seconds, tokens=100, passes=100, stats=None, mode="sampling"):
    return Measurement(label, mode, "p", seconds, tokens, passes, 0, stats)


def test_summarise_aggregates_and_predicts():
    stats = {"accepted_tokens": 60, "row_rejections": [20], "draft_tokens": 90, "lookahead_per_round": [3] * 30}
    rows = summarise([fake("target", 20.0), fake("hf_specsample K=3", 10.0, passes=40, stats=stats)], c=0.4)
    target, spec = rows
    assert target.tokens_per_s == 5.0 and target.speedup == 1.0 and target.alpha is None
    assert spec.speedup == 2.0 and spec.tokens_per_target_pass == 2.5
    assert spec.alpha == pytest.approx(60 / 80) and spec.acceptance_rate == pytest.approx(60 / 90)
    assert spec.mean_lookahead == 3.0
    assert spec.predicted_speedup == pytest.approx(expected_speedup(0.75, 3, 0.4))
    table = format_table(rows)
    assert "tok/s" in table and "2.00x" in table and "hf_specsample K=3" in table
    assert json.loads(json.dumps(to_json(rows, [], {"pair": "x"})))["summary"][1]["speedup"] == 2.0


def test_truncate_stops_at_the_next_top_level_statement():
    assert truncate("    return x\n\ndef other():\n    pass") == "    return x\n"
    assert truncate("    return x\n") == "    return x\n"


def test_prompt_sets_load_offline():
    code = load_prompts(PromptSet.HUMANEVAL, 3)
    assert [p.prompt_id for p in code] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(p.style is PromptStyle.COMPLETION and "def " in p.text for p in code)
    docs = load_prompts(PromptSet.PYDOC, 2, offset=1)
    assert len(docs) == 2 and all(p.style is PromptStyle.CHAT and p.text.startswith("Summarise") for p in docs)
    assert set(load_problems(1)[0]) >= {"task_id", "prompt", "test", "entry_point"}


@pytest.fixture(scope="module")
def tiny_setup():
    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=32, init_range=0.3)
    draft = perturbed_copy(target, seed=1, scale=0.1)
    prompts = [Prompt(f"p{i}", text, PromptStyle.COMPLETION) for i, text in enumerate(["abc", "hello world"])]
    return target, draft, char_tokenizer(64), prompts


def test_run_benchmark_on_tiny_models(tiny_setup):
    target, draft, tokenizer, prompts = tiny_setup
    config = BenchmarkConfig(max_new_tokens=12, progress=False)
    result = run_benchmark(target, draft, tokenizer, prompts, config)
    assert {(row.label, row.mode) for row in result.rows} == {
        (spec.label, mode.value) for spec in config.methods for mode in (Mode.GREEDY, Mode.SAMPLING)
    }
    assert all(m.new_tokens == 12 for m in result.measurements)  # fixed lengths: equal work
    for m in result.measurements:
        if m.stats:  # the hook count agrees with the library's own statistics
            assert m.target_passes == m.stats["target_forward_passes"]
        if m.label == "target":
            assert m.target_passes == 12 and m.draft_passes == 0
    greedy_texts = {m.label: m.text for m in result.measurements if m.mode == "greedy" and m.prompt_id == "p0"}
    assert len(set(greedy_texts.values())) == 1  # every method is exact in greedy mode
    assert 0 < result.cost["c"]


def test_sweep_and_plot(tiny_setup, tmp_path):
    target, draft, tokenizer, prompts = tiny_setup
    rows = run_sweep(
        target,
        draft,
        tokenizer,
        prompts,
        [1, 3],
        Mode.SAMPLING,
        BenchmarkConfig(max_new_tokens=8, progress=False),
        c=0.5,
    )
    assert [row.label for row in rows] == ["target", "hf_specsample K=1", "hf_specsample K=3"]
    path = plot_sweep(rows, tmp_path / "sweep.png", "tiny")
    assert path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_benchmark_cli_end_to_end_on_smollm2(tmp_path):
    from hf_specsample_bench.cli import run

    torch.set_num_threads(thread_share(2))
    report = run([
        "--pair", "smollm2", "--num-prompts", "1", "--max-new-tokens", "8", "--prompts", "humaneval", "pydoc",
        "--sweep", "1,2", "--plot", str(tmp_path / "sweep.png"), "--pass-at-1", "1", "--json", str(tmp_path / "b.json"),
        "--no-progress",
    ])  # fmt: skip
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["meta"]["pair"] == "smollm2" and len(saved["summary"]) == 8 and len(saved["sweep"]) == 3
    assert set(report["pass_at_1"]) == {"target", "hf_specsample default"}
    assert (tmp_path / "sweep.png").exists()


def test_batch_sweep_on_the_tiny_pair():
    from hf_specsample_bench.batch import batch_inputs, run_batch_sweep
    from hf_specsample_bench.pairs import BenchPair, load_bench_pair

    target, draft, tokenizer = load_bench_pair(BenchPair.TINY, torch.float32)
    prompts = [Prompt(f"p{i}", text, PromptStyle.COMPLETION) for i, text in enumerate(["def f(x):", "ab", "hello"])]
    inputs = batch_inputs(tokenizer, prompts, 4)
    assert inputs["input_ids"].shape[0] == 4 and (inputs["attention_mask"][:, 0] == 0).any()  # left-padded
    rows = run_batch_sweep(
        target, draft, tokenizer, prompts, [1, 4], parse_methods("target,hf_specsample:2"), Mode.SAMPLING,
        BenchmarkConfig(max_new_tokens=6, progress=False),
    )  # fmt: skip
    assert {(row.label, row.mode) for row in rows} == {
        (label, f"sampling B={b}") for label in ("target", "hf_specsample K=2") for b in (1, 4)
    }
    by_key = {(row.label, row.mode): row for row in rows}
    assert by_key[("target", "sampling B=4")].new_tokens == 24
    assert by_key[("target", "sampling B=4")].speedup == 1.0


def test_cli_every_section_on_the_tiny_pair(tmp_path, monkeypatch):
    from hf_specsample_bench import cli
    from hf_specsample_bench.cli import run

    real_method_c = cli.method_cost_ratios  # a marker value: sweep and batch rows must use the prepared draft's c
    monkeypatch.setattr(cli, "method_cost_ratios", lambda *a: {k: 0.125 for k in real_method_c(*a)})

    args = ["--pair", "tiny", "--dtype", "float32", "--num-prompts", "1", "--max-new-tokens", "6", "--no-progress"]
    report = run(
        args
        + ["--methods", "target,hf_specsample:2:as_given,hf_specsample:auto:dynamic_int8:40", "--sweep", "1,2"]
        + ["--plot", str(tmp_path / "k.png"), "--batch-sizes", "1,2", "--json", str(tmp_path / "r.json")]
    )
    assert {row["label"] for row in report["summary"]} == {
        "target", "hf_specsample K=2 draft as_given", "hf_specsample K=auto draft dynamic_int8 vocab 0k"
    }  # fmt: skip
    assert set(report["meta"]["method_c"]) == {
        "hf_specsample K=2 draft as_given", "hf_specsample K=auto draft dynamic_int8 vocab 0k"
    }  # fmt: skip
    assert len(report["sweep"]) == 3 and len(report["batches"]) == 4
    drafted = [row for row in report["sweep"] + report["batches"] if row["label"] != "target"]
    assert drafted and all(row["c"] == 0.125 for row in drafted)
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["pair"] == "tiny"
    skipped = run(args + ["--skip-main", "--random-draft"])
    assert skipped["summary"] == [] and skipped["meta"]["random_draft"] and skipped["meta"]["cost"]["c"] > 0


def test_run_benchmark_with_a_draft_of_another_tokenizer(tiny_setup):
    """The benchmark with a draft of its own tokenizer: hf_specsample gets a draft prepared with both tokenizers (no
    per-call map), c is timed on the draft's own ids, and transformers' assisted generation gets `assistant_tokenizer=`
    and a copy of the draft per mode (sampling prunes its assistant in place, after which greedy calls on it fail)."""
    from test_cross_tokenizer import bpe_tokenizer

    from hf_specsample_bench.methods import MethodDrafts

    target, _, tokenizer, prompts = tiny_setup
    draft_tokenizer = bpe_tokenizer(["<pad>", "<s>", "</s>", *"lohewrdabc ", "lo", "he"], [("l", "o"), ("h", "e")])
    draft = tiny_lm(seed=3, vocab_size=len(draft_tokenizer), layers=1, hidden=32, init_range=0.3)
    drafts = MethodDrafts(target, draft, tokenizer, draft_tokenizer)
    hello = tokenizer("hello", return_tensors="pt")["input_ids"]
    assert drafts.draft_input_ids(hello).tolist() == [[15, 3, 14]]  # he l lo
    assisted = {mode: drafts.generate_kwargs(MethodSpec(Method.ASSISTED), mode) for mode in Mode}
    assert len({id(kwargs["assistant_model"]) for kwargs in assisted.values()} | {id(draft)}) == 3
    assert all(kwargs["assistant_tokenizer"] is draft_tokenizer for kwargs in assisted.values())
    config = BenchmarkConfig(methods=parse_methods("target,assisted,hf_specsample:2"), max_new_tokens=8, progress=False)
    result = run_benchmark(target, drafts, tokenizer, prompts, config)
    greedy_texts = {m.label: m.text for m in result.measurements if m.mode == "greedy" and m.prompt_id == "p1"}
    assert len(set(greedy_texts.values())) == 1
    speculative = [m for m in result.measurements if m.stats]
    assert speculative and all(m.stats["shared_vocabulary"] == 13 for m in speculative)
    assert drafts.prepared(MethodSpec(Method.SPECULATIVE, 2)).shared_vocabulary.size == 13  # the target has no space


def test_demo_times_eager_verification_on_a_tiny_model():
    # The demo's --compile auto probe: it must run on the cache API transformers ships (crop takes a negative count).
    from hf_specsample import LinearKernel
    from hf_specsample.core.model_facts import ModelFacts
    from hf_specsample.kernels.routing import KernelRouting
    from hf_specsample_bench.demo import eager_verification_cost

    model = tiny_lm(seed=0, vocab_size=32)
    prompt = torch.randint(0, 32, (1, 20), generator=torch.Generator().manual_seed(0))
    routing = KernelRouting.for_model(ModelFacts.of(model), LinearKernel.AUTO)  # off: a float32 model
    cost = eager_verification_cost(model, prompt, routing, prefix=16, repeats=2)
    assert 0.0 < cost < 100.0


def test_weightless_benchmark_runs_on_tiny_shapes(capsys):
    """`hf-specsample-weightless` on the CPU with tiny shapes: every setting, one and two rows, the per-round split and
    operator counts; the acceptance it sets is the one it reports (all accepted, alpha near the target, useless)."""
    from hf_specsample_bench import weightless

    weightless.main(
        ["--target", "tiny", "--draft", "tiny", "--rows", "1,2", "--prompt-tokens", "12", "--new-tokens", "6",
         "--repeats", "1", "--split", "--alpha", "0.5"]
    )  # fmt: skip
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 2 * len(weightless.Setting)
    assert all("refuses batches" in row for row in rows if row.split("|")[2].strip() == "2")
    by_setting = {row.split("|")[1].strip(): row for row in rows}
    assert "argmax agreement 1.00" in by_setting[str(weightless.Setting.ALL_ACCEPTED)]
    assert "6.00/pass" in by_setting[str(weightless.Setting.ALL_ACCEPTED)]  # 6 new tokens: one round of K=8, capped
    alpha = float(by_setting[str(weightless.Setting.SAMPLED)].split("alpha")[1].split("|")[0])
    assert abs(alpha - 0.5) < 0.02
    assert "plain steps" in by_setting[str(weightless.Setting.DRAFT_IS_TARGET)]
    assert out.count("operators per forward") == 2 * len(weightless.Setting)


def test_memory_benchmark_runs_on_tiny_shapes(capsys):
    """`python -m hf_specsample_bench.memory` with tiny shapes: one fresh process per measurement, a table of plain's
    and ours peaks per mode; and the peak it reads holds an allocation made inside the measured call."""
    from hf_specsample_bench import memory

    # In a fresh process, as the benchmark measures: a long-lived one (a test worker) may hold freed, still resident
    # heap that serves the 64 MiB without any growth of resident memory.
    probe = (
        "import torch; from hf_specsample_bench import memory; held = []; "
        "peak, how = memory.peak_beyond(lambda: held.append(torch.ones(16 * 2**20))); print(peak, how)"
    )  # 64 MiB, touched
    peak, how = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.split()
    assert int(peak) >= 60 * 2**20 and how in ("VmHWM", "sampled")
    memory.main(["--rows", "2", "--shape", "tiny", "--new-tokens", "3", "--lookahead", "2", "--prompt-tokens", "4",
                 "--modes", "greedy,sampling"])  # fmt: skip
    out = capsys.readouterr().out
    assert "rows x vocabulary x K = 2 x 512 x 2" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split("|")[1].strip() for row in rows] == ["greedy", "sampling"]
    assert all(row.count("GiB") == 2 and row.rstrip(" |").endswith("x") for row in rows)


def test_weightless_acceptance_settings():
    """The final norms set acceptance: zeroed ones agree everywhere; a useless pair barely overlaps."""
    from hf_specsample_bench import weightless

    cpu = torch.device("cpu")
    prompt = torch.randint(1, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    target, draft = (weightless.build(weightless.Shape.TINY, seed, torch.float32, cpu) for seed in (0, 1))
    assert weightless.set_acceptance(target, draft, weightless.Setting.USELESS_SAMPLED, prompt, 0.8) < 0.05
    target, draft = (weightless.build(weightless.Shape.TINY, seed, torch.float32, cpu) for seed in (0, 1))
    assert weightless.set_acceptance(target, draft, weightless.Setting.SAMPLED, prompt, 0.8) == pytest.approx(
        0.8, abs=0.01
    )
    assert weightless.acceptance(target, draft, prompt) == pytest.approx(0.8, abs=0.01)


def test_gpu_check_skips_cleanly_without_cuda(capsys, monkeypatch):
    """Issue 42's part 5 script: on a machine without CUDA it says so and exits 0, checking nothing."""
    from hf_specsample_bench import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_weightless_ours_with_graphs_is_compile_true():
    from hf_specsample_bench import weightless

    kwargs = weightless.method_kwargs(weightless.Method.OURS_GRAPHS, "draft", 4, torch.device("cpu"), {})
    assert kwargs["speculative_config"].compile and kwargs["num_lookahead"] == 4
