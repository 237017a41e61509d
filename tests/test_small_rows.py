"""The small-rows linear kernel (`kernels/small_rows.py`): correct, batch-invariant, routed only where eligible, and
exact end to end (greedy identity, chi-square) when the loop's forwards run on it.

The operator is built once per machine (about 12 s; torch's extension cache keeps it). Without a C++ compiler the
kernel tests skip with the build's reason, and the tests of `linear_kernel="auto"`/"on" check the fallback instead.
"""

import contextlib
import copy
import os
import platform
import shutil
import subprocess
import sysconfig
import time

import pytest
import torch
import torch.nn.functional as F
from exact import chisquare_pvalue, continuations, exact_distribution
from tiny import PAD, FakeClock, perturbed_copy, prepared_processors, tiny_lm

from hf_specsample import LinearKernel, SpeculativeConfig, prepare_draft
from hf_specsample.core.model_facts import ModelFacts, Role
from hf_specsample.kernels import routing as kernel_routing
from hf_specsample.kernels import small_rows
from hf_specsample.kernels.quantized_linear import Int4Linear
from hf_specsample.kernels.routing import KernelRouting
from hf_specsample.kernels.small_rows import KernelPath, SmallRowsLinear

PROMPT = torch.tensor([[1, 5, 2, 5]])
DRAFT_AS_GIVEN = dict(draft_form="as_given")


def bf16_pair(vocab_size=16, hidden=32):
    target = tiny_lm(seed=0, vocab_size=vocab_size, layers=2, hidden=hidden).to(torch.bfloat16)
    return target, perturbed_copy(target, seed=1, scale=0.3)


def reference(x, weight, bias=None):
    """fp32 F.linear, rounded to bf16 as the kernel's output is."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)


@pytest.mark.parametrize("in_features", [8, 13, 64, 1533])
@pytest.mark.parametrize("out_features", [1, 3, 17, 100])
def test_kernel_matches_fp32_linear_up_to_bf16_rounding(built, in_features, out_features):
    generator = torch.Generator().manual_seed(in_features * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16)
    for rows in (1, 2, 3, 5, 6, 7, 9, 13, 16):
        x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
        for b in (None, bias):
            out = small_rows.small_rows_linear(x, weight, b)
            expected = reference(x, weight, b)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
            # one bf16 rounding of the output (2^-8 relative) plus fp32 accumulation-order differences
            scale = (x.float().abs() @ weight.float().abs().T) + (0 if b is None else b.float().abs())
            assert ((out.float() - expected.float()).abs() <= 2**-7 * scale + 1e-6).all(), (rows, b is None)


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


# The four x86 classes (their flags as /proc/cpuinfo names them), the paths each offers, fastest first, and the path
# each weight form runs by default there: bf16, int8, int4 (packed, torch.uint8).
AVX2 = {"avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
CPU_CLASSES = {
    "avx2_only": (AVX2, "avx2_fma scalar", ("avx2_fma", "avx2_fma", "scalar")),
    "avx512_without_bf16": (AVX512, "avx512_vnni avx512f avx2_fma scalar", ("avx512f", "avx512_vnni", "avx512_vnni")),
    "avx512_bf16": (
        AVX512 | {"avx512_bf16"},
        "avx512_bf16 avx512_vnni avx512f avx2_fma scalar",
        ("avx512_bf16", "avx512_vnni", "avx512_vnni"),
    ),
    "amx": (
        AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"},
        "amx_bf16 avx512_bf16 avx512_vnni avx512f avx2_fma scalar",
        ("amx_bf16", "avx512_vnni", "avx512_vnni"),
    ),
}


@pytest.mark.parametrize("cpu_class", list(CPU_CLASSES))
def test_each_weight_form_runs_its_fastest_path_on_every_x86_class(cpu_class):
    """The choice for CPUs this machine is not (an Ice Lake Xeon offers avx512_vnni first, yet bf16 weights run on
    avx512f: VNNI reads int8 and int4 only). Python's choice (`fastest_path`), and the operator's own where it builds
    here: a wrong choice for any class fails on every machine."""
    flags, offered, expected = CPU_CLASSES[cpu_class]
    paths = small_rows.offered_paths(flags)
    assert [str(path) for path in paths] == offered.split()
    assert small_rows.offered_paths(flags, amx_granted=False) == [p for p in paths if p is not KernelPath.AMX_BF16]
    for weights, path in zip(small_rows.FORMS, expected):  # the fastest offered path that reads the form
        readers = [reader for reader in small_rows.READS[weights] if reader in paths]
        assert small_rows.fastest_path(paths, weights) == KernelPath(path) == readers[0], weights
    if small_rows.load().problem is None:  # the operator numbers its paths as `path_name` names them
        numbers = {torch.ops.hf_specsample.path_name(index): index for index in range(len(KernelPath))}
        indices = [numbers[str(path)] for path in paths]
        for form, path in enumerate(expected):
            assert torch.ops.hf_specsample.path_name(torch.ops.hf_specsample.fastest_path(indices, form)) == path


def test_the_paths_offered_here_are_those_the_cpu_flags_allow(built):
    """Names the paths built here (see the test log): those this CPU's flags allow (AMX where Linux granted its tile
    state; only those `$HF_SPECSAMPLE_KERNEL_PATHS` names where it is set), fastest first; each form's default is
    the fastest that reads it, and the operator runs it (its output is that path's, bit for bit)."""
    found = small_rows.paths()
    print(f"small-rows kernel paths on this CPU, best first: {[str(path) for path in found]}")
    print(f"default paths: {[f'{weights}: {small_rows.best_path(weights)}' for weights in small_rows.FORMS]}")
    assert found[-1] is KernelPath.SCALAR
    flags = _cpu_flags()
    if platform.machine() in ("x86_64", "AMD64") and flags:
        expected = small_rows.offered_paths(flags, amx_granted=KernelPath.AMX_BF16 in found)
        allowed = os.environ.get(small_rows.PATHS_ENV_VAR, "").replace(" ", "")
        if allowed:
            expected = [path for path in expected if path is KernelPath.SCALAR or str(path) in allowed.split(",")]
        assert found == expected
    for weights in small_rows.FORMS:
        assert small_rows.best_path(weights) == next(path for path in small_rows.READS[weights] if path in found)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(5, 256, generator=generator).to(torch.bfloat16)
    weight = torch.randn(48, 256, generator=generator).to(torch.bfloat16)
    int8, scale = (weight.float() * 20).round().clamp(-127, 127).to(torch.int8), torch.full((48,), 0.05)
    packed, scales = small_rows.pack_int4(torch.randint(-8, 8, (48, 256), generator=generator)), torch.rand(48, 2)
    runs = {
        torch.bfloat16: lambda path: small_rows.small_rows_linear(x, weight, path=path),
        torch.int8: lambda path: small_rows.small_rows_linear_int8(x, int8, scale, path=path),
        torch.uint8: lambda path: small_rows.small_rows_linear_int4(x, packed, scales, 128, path=path),
    }
    for weights, run in runs.items():  # the default (no path named) is the best path's output, bit for bit
        assert torch.equal(run(None), run(small_rows.best_path(weights))), weights


def every_path():
    return [pytest.param(path, id=str(path)) for path in KernelPath]


@pytest.mark.parametrize("path", every_path())
@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_every_path_matches_fp32_and_is_batch_invariant(built, path, weights):
    """Each vector path this CPU runs that reads the weight form (the others skip), on odd shapes: within bf16
    rounding of eager fp32 `F.linear` (int8, int4: of the dequantized weight), and a row's output bit for bit the
    same alone and among up to 16 rows, and among 17-40 (prompts; AMX takes rows in groups of 16, weights in blocks
    of 16 and 32 rows)."""
    form = {"bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}[weights]
    if path not in small_rows.READS[form]:
        pytest.skip(f"the {path} path does not read {weights} weights")
    if path not in small_rows.paths():
        pytest.skip(f"this CPU has no {path} path")
    generator = torch.Generator().manual_seed(9)
    shapes = ((8, 3), (13, 17), (33, 5), (64, 100), (96, 48), (1533, 37))
    if weights == "int4":  # inputs in whole groups of 64 or 128
        shapes = ((64, 3), (128, 17), (256, 5), (256, 48), (1536, 37))
    for in_features, out_features in shapes:
        x = torch.randn(40, in_features, generator=generator).to(torch.bfloat16)
        bias = torch.randn(out_features, generator=generator).to(torch.bfloat16)
        if weights == "bf16":
            weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
            dense = weight.float()

            def run(rows, b=None, weight=weight):
                return small_rows.small_rows_linear(rows, weight, b, path=path)
        elif weights == "int8":
            weight = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
            scale = torch.rand(out_features, generator=generator) / 64
            dense = weight.float() * scale[:, None]

            def run(rows, b=None, weight=weight, scale=scale):
                return small_rows.small_rows_linear_int8(rows, weight, scale, b, path=path)

            if path is KernelPath.AVX512_VNNI:  # x rounded to int8 per row first: the reference is that x's
                rounding = x.float().abs().amax(1, keepdim=True) / 254  # (rows, 1) half a step of each row
                slack = rounding * dense.abs().sum(1)[None, :]  # (rows, out)
        else:
            group = 64 if in_features % 128 else 128
            values = torch.randint(-8, 8, (out_features, in_features), generator=generator)
            scale = torch.rand(out_features, in_features // group, generator=generator) / 4
            dense = (values.float().view(out_features, -1, group) * scale[:, :, None]).view(out_features, in_features)
            packed = small_rows.pack_int4(values)
            assert torch.equal(small_rows.unpack_int4(packed).long(), values)

            def run(rows, b=None, packed=packed, scale=scale, group=group):
                return small_rows.small_rows_linear_int4(rows, packed, scale, group, b, path=path)

            if path is KernelPath.AVX512_VNNI:
                if group != 128:
                    continue
                rounding = x.float().abs().amax(1, keepdim=True) / 254  # x rounded to int8 per row first
                slack = rounding * dense.abs().sum(1)[None, :]

        for b in (None, bias):
            expected = F.linear(x.float(), dense, None if b is None else b.float())
            bound = x.float().abs() @ dense.abs().T + (0 if b is None else b.float().abs())
            out = run(x, b)
            assert out.dtype == torch.bfloat16 and out.shape == (40, out_features)
            allowed = 2**-7 * bound + 1e-6 + (slack if path is KernelPath.AVX512_VNNI else 0)
            assert ((out.float() - expected).abs() <= allowed).all(), (in_features, out_features)
        alone = torch.cat([run(x[i : i + 1]) for i in range(40)])
        for rows in (*range(1, 18), 24, 32, 33, 40):
            assert torch.equal(run(x[:rows]), alone[:rows]), (in_features, rows)


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None, reason="no aarch64 cross compiler here")
def test_the_kernel_compiles_for_arm():
    """Other architectures build the scalar path alone (the timing then leaves eager F.linear in place): the source
    must compile there. Checked with Debian's g++-aarch64-linux-gnu where it is installed."""
    from torch.utils.cpp_extension import include_paths

    command = ["aarch64-linux-gnu-g++", "-fsyntax-only", "-std=c++20", "-fopenmp", "-w", str(small_rows.SOURCE)]
    command += [f"-I{path}" for path in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_path_the_cpu_lacks_is_refused(built):
    missing = [path for path in KernelPath if path not in small_rows.paths()]
    if not missing:
        pytest.skip("this CPU runs every path")
    with pytest.raises(RuntimeError, match="this CPU cannot run"):
        small_rows.small_rows_linear(
            torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(2, 8).bfloat16(), path=missing[0]
        )


def test_kernel_keeps_leading_dimensions(built):
    weight = torch.randn(24, 40).to(torch.bfloat16)
    x = torch.randn(2, 3, 40).to(torch.bfloat16)
    out = small_rows.small_rows_linear(x, weight)
    assert out.shape == (2, 3, 24)
    assert torch.equal(out.reshape(6, 24), small_rows.small_rows_linear(x.reshape(6, 40), weight))


def test_a_rows_output_never_depends_on_the_other_rows(built):
    """Batch invariance: one position alone and among K+1 gives bit-identical outputs (row-tile sizes differ)."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 203, generator=generator).to(torch.bfloat16)
    x = torch.randn(16, 203, generator=generator).to(torch.bfloat16)
    alone = torch.cat([small_rows.small_rows_linear(x[i : i + 1], weight) for i in range(16)])
    for rows in range(1, 17):
        assert torch.equal(small_rows.small_rows_linear(x[:rows], weight), alone[:rows]), rows


def test_mode_routes_only_eligible_linears(built, monkeypatch):
    calls = []
    real = small_rows.small_rows_linear
    monkeypatch.setattr(small_rows, "small_rows_linear", lambda *args: calls.append(args[0].shape) or real(*args))
    weight = torch.randn(8, 16).to(torch.bfloat16)
    few, many = torch.randn(4, 16).to(torch.bfloat16), torch.randn(17, 16).to(torch.bfloat16)
    with SmallRowsLinear():
        assert torch.equal(F.linear(few, weight), real(few, weight))  # routed
        F.linear(many, weight)  # more than MAX_ROWS rows: eager GEMM
        F.linear(few.float(), weight.float())  # fp32: eager
        F.linear(few, weight.T.contiguous().T)  # a transposed weight (not row-major): eager
        with torch.enable_grad():
            F.linear(few, weight.clone().requires_grad_())  # autograd: eager
        module = torch.nn.Linear(16, 8, bias=True).to(torch.bfloat16).requires_grad_(False)
        module(few)  # nn.Linear goes through F.linear: routed, with its bias
        F.linear(input=few, weight=weight)  # keywords, as F.linear accepts them: routed
        with torch.enable_grad():  # a frozen weight with a trainable bias (bias-only fine-tuning): eager
            F.linear(few, weight, torch.zeros(8, dtype=torch.bfloat16, requires_grad=True))
    F.linear(few, weight)  # outside the mode: eager
    assert calls == [(4, 16), (4, 16), (4, 16)]
    with SmallRowsLinear(max_rows=None):
        F.linear(many, weight)
    assert calls[-1] == (17, 16)


def test_forward_mode_autodiff_stays_eager(built):
    """The operator has no derivative: dual tensors and torch.func transforms get eager F.linear's tangents."""
    import torch.autograd.forward_ad as forward_ad

    generator = torch.Generator().manual_seed(4)
    weight, x, tangent = (
        torch.randn(*shape, generator=generator).to(torch.bfloat16) for shape in ((8, 16), (3, 16), (3, 16))
    )
    expected = F.linear(tangent, weight)
    with SmallRowsLinear():
        with forward_ad.dual_level():
            assert torch.equal(
                forward_ad.unpack_dual(F.linear(forward_ad.make_dual(x, tangent), weight)).tangent, expected
            )
        assert torch.equal(torch.func.jvp(lambda x: F.linear(x, weight), (x,), (tangent,))[1], expected)


def greedy(model, **kwargs):
    return model.generate(PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=PAD, **kwargs)


@torch.no_grad()
def test_greedy_with_the_kernel_equals_plain(built):
    target, draft = bf16_pair()
    config = SpeculativeConfig(linear_kernel="on", **DRAFT_AS_GIVEN)
    out = greedy(target, draft_model=draft, num_lookahead=3, speculative_config=config, return_dict_in_generate=True)
    assert (
        out.speculative_stats.linear_kernel.startswith("target on")
        and "draft on" in out.speculative_stats.linear_kernel
    )
    with SmallRowsLinear():  # plain decoding with the kernel: the same per-row arithmetic (batch invariance)
        assert out.sequences.tolist() == greedy(target).tolist()
    assert out.sequences.tolist() == greedy(target).tolist()  # and here also plain eager's tokens


@torch.no_grad()
def test_ragged_batch_greedy_with_the_kernel_equals_plain(built):
    target, draft = bf16_pair(vocab_size=24)
    prompts = torch.tensor([[PAD, PAD, 1, 5, 2], [1, 7, 3, 9, 4]])
    mask = (prompts != PAD).long()
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    config = SpeculativeConfig(linear_kernel="on", **DRAFT_AS_GIVEN)
    out = target.generate(prompts, draft_model=draft, num_lookahead=2, speculative_config=config, **kwargs)
    with SmallRowsLinear():
        plain = target.generate(prompts, **kwargs)
    assert_same_greedy_up_to_bf16_ties(target, out, plain, mask)


@torch.no_grad()
def test_ragged_greedy_check_catches_a_kernel_that_is_not_batch_invariant(built, monkeypatch):
    """Power: a kernel that adds 0.5 to one token's head logit in forwards of 4-8 rows (the loop's 2 rows x 3
    verified positions; plain decodes 2 rows per step) makes the speculative tokens leave plain's path at no tie."""
    target, draft = bf16_pair(vocab_size=24)
    prompts = torch.tensor([[PAD, PAD, 1, 5, 2], [1, 7, 3, 9, 4]])
    mask = (prompts != PAD).long()
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    with SmallRowsLinear():
        plain = target.generate(prompts, **kwargs)
    real = small_rows.small_rows_linear

    def wrong(x, weight, bias=None):
        out = real(x, weight, bias)
        if weight.shape[0] == target.config.vocab_size and 4 <= out.numel() // out.shape[-1] <= 8:
            out = out.clone()
            out[..., 3] += 0.5
        return out

    monkeypatch.setattr(small_rows, "small_rows_linear", wrong)
    config = SpeculativeConfig(linear_kernel="on", **DRAFT_AS_GIVEN)
    out = target.generate(prompts, draft_model=draft, num_lookahead=2, speculative_config=config, **kwargs)
    with pytest.raises(AssertionError, match="not a bf16 tie"):
        assert_same_greedy_up_to_bf16_ties(target, out, plain, mask)


def assert_same_greedy_up_to_bf16_ties(model, ours, plain, prompt_mask, steps: int = 2):
    """Each row of `ours` equals plain's, except that a row may leave plain's path at a bf16 tie.

    The kernel is batch-invariant, but attention is not invariant to where a row's slots sit: SDPA's vector
    reductions group the terms by slot, and the speculative cache holds a ragged row's slots after masked holes
    (plain's after its left padding). So logits can differ by a rounding step, and an exact bf16 tie (seen on an
    AVX-512 Xeon: two tokens at 3.53125) resolves either way. Where a row first differs, both tokens must score
    within `steps` bf16 steps of the best one in a forward over that prefix; anything else is a wrong result.

    Args:
        ours, plain: `(batch, length)` greedy sequences; prompt_mask: `(batch, prompt_length)` 1 for real tokens.
    """
    prompt_length = prompt_mask.shape[1]
    for row in range(ours.shape[0]):
        differ = (ours[row] != plain[row]).nonzero()
        if differ.numel() == 0:
            continue
        first = int(differ[0])
        assert first >= prompt_length, "the prompts differ"
        prefix = ours[row, int(prompt_mask[row].argmax()) : first][None, :]
        with torch.no_grad():
            logits = model(prefix).logits[0, -1].float()
        best = logits.max()
        step = 2.0 ** (torch.floor(torch.log2(best.abs())) - 7)  # one bf16 rounding step at this magnitude
        for token in (int(ours[row, first]), int(plain[row, first])):
            assert best - logits[token] <= steps * step, (
                f"row {row} leaves plain's path at token {first}: {token} scores {float(logits[token])}, the best "
                f"{float(best)}: not a bf16 tie"
            )


def every_forward_on_the_kernel(monkeypatch):
    """The loop's kernel routing serves every forward, however many rows (a 4000-row sampling batch included)."""
    monkeypatch.setattr(KernelRouting, "for_model", classmethod(lambda cls, *args: cls.every_round("on (test)")))
    monkeypatch.setattr(KernelRouting, "applied", lambda self, rows: SmallRowsLinear(max_rows=None))


SETTINGS = dict(temperature=0.9, top_k=5)
NUM_TOKENS = 3


def kernel_exact(target):
    """The target's exact distribution of 3 tokens, as the kernel computes it."""
    processors, _ = prepared_processors(target, PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, **SETTINGS)
    with SmallRowsLinear(max_rows=None):
        return exact_distribution(target, PROMPT, processors, NUM_TOKENS)


def speculative_samples(target, draft, seed=5, rows=4000):
    out = target.generate(
        PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, num_return_sequences=rows, pad_token_id=PAD,
        generator=torch.Generator().manual_seed(seed), draft_model=draft, num_lookahead=2,
        speculative_config=SpeculativeConfig(**DRAFT_AS_GIVEN), **SETTINGS,
    )  # fmt: skip
    return continuations(out, PROMPT.shape[1])


@torch.no_grad()
def test_sampling_on_the_kernel_is_exact(built, monkeypatch):
    target, draft = bf16_pair()
    every_forward_on_the_kernel(monkeypatch)
    assert chisquare_pvalue(kernel_exact(target), speculative_samples(target, draft)) > 1e-3


@torch.no_grad()
def test_sampling_test_catches_a_wrong_kernel(built, monkeypatch):
    """Power: a kernel whose head logits are off by a factor 1.3 in the loop fails the same test."""
    target, draft = bf16_pair()
    every_forward_on_the_kernel(monkeypatch)
    exact = kernel_exact(target)
    real = small_rows.small_rows_linear

    def wrong(x, weight, bias=None):
        out = real(x, weight, bias)
        return out * 1.3 if weight.shape[0] == target.config.vocab_size else out

    monkeypatch.setattr(small_rows, "small_rows_linear", wrong)
    assert chisquare_pvalue(exact, speculative_samples(target, draft)) < 1e-3


def test_auto_leaves_float32_models_alone():
    target = tiny_lm(seed=0, vocab_size=16, layers=1, hidden=16)
    routing = KernelRouting.for_model(ModelFacts.of(target), LinearKernel.AUTO)
    assert not routing.is_on and "float32" in routing.reason
    assert routing.applied(3).__class__.__name__ == "nullcontext"


def test_on_is_refused_before_any_work_where_it_cannot_run(monkeypatch):
    target, draft = bf16_pair()
    fp32 = tiny_lm(seed=0, vocab_size=16, layers=1, hidden=16)
    with pytest.raises(
        ValueError, match="linear_kernel='on' cannot be honoured: the target's weights are torch.float32"
    ):
        greedy(fp32, draft_model=draft.float(), speculative_config=SpeculativeConfig(linear_kernel="on"))
    monkeypatch.setattr(small_rows, "load", _failed_load)
    with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
        greedy(target, draft_model=draft, speculative_config=SpeculativeConfig(linear_kernel="on"))


def test_auto_falls_back_to_eager_and_says_why_when_the_kernel_cannot_be_built(monkeypatch):
    target, draft = bf16_pair()
    plain = greedy(target)
    monkeypatch.setattr(small_rows, "load", _failed_load)
    out = greedy(target, draft_model=draft, num_lookahead=2, return_dict_in_generate=True)
    assert "off: no C++ compiler (test)" in out.speculative_stats.linear_kernel
    assert out.sequences.tolist() == plain.tolist()


def _failed_load():
    return small_rows.Build("no C++ compiler (test)", 0.0)


def test_auto_times_the_kernel_once_per_model(built, monkeypatch):
    target, _ = bf16_pair(hidden=64)
    timed = []
    real = kernel_routing._timed_routing
    monkeypatch.setattr(kernel_routing, "_timed_routing", lambda weight: timed.append(weight.shape) or real(weight))
    first = KernelRouting.for_model(ModelFacts.of(target), LinearKernel.AUTO)
    again = KernelRouting.for_model(ModelFacts.of(target), LinearKernel.AUTO)
    assert len(timed) == 1 and first.reason == again.reason and "timed" in first.reason
    with torch.no_grad():
        ModelFacts.of(target).largest_linear.mul_(1.0)  # the weights changed (version counter): timed again
    KernelRouting.for_model(ModelFacts.of(target), LinearKernel.AUTO)
    assert len(timed) == 2


def test_a_seeded_call_decides_without_the_clock(built, monkeypatch):
    target, _ = bf16_pair()
    monkeypatch.setattr(kernel_routing, "_timed_routing", lambda weight: pytest.fail("a seeded call timed the kernel"))
    routing = KernelRouting.for_model(ModelFacts.of(copy.deepcopy(target)), LinearKernel.AUTO, clock_free=True)
    assert "without the clock" in routing.reason


def test_auto_decides_each_width_on_its_own(built, monkeypatch):
    """A kernel slower than eager from 7 rows on serves 1-6 rows only: a wide round (or a lookup round of 11
    positions) runs eagerly, a narrow one on the kernel. The timing reads a fake clock that only the calls advance
    (eager 1 ms at every width, the kernel 3 ms from 7 rows on, nothing below), never the wall clock."""
    real = small_rows.small_rows_linear
    clock = FakeClock()

    def slow_from_seven(x, weight, bias=None, path=None):
        clock.advance(0.003 if x.shape[0] >= 7 else 0.0)
        return real(x, weight, bias, path)

    class SlowEager:
        @staticmethod
        def linear(*args, **kwargs):
            clock.advance(0.001)
            return F.linear(*args, **kwargs)

    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(small_rows, "small_rows_linear", slow_from_seven)
    monkeypatch.setattr(kernel_routing, "F", SlowEager)
    target, _ = bf16_pair(hidden=64)
    routing = KernelRouting.for_model(ModelFacts.of(target), LinearKernel.AUTO)
    assert routing.rows == frozenset(range(1, 7)) and "on for 1-6 rows" in routing.reason
    assert isinstance(routing.applied(5), SmallRowsLinear) and not isinstance(routing.applied(9), SmallRowsLinear)


def test_plain_generate_with_the_plan_everywhere_routes_by_each_linears_rows(built, monkeypatch):
    """`KernelRouting.everywhere()` (plain generate() with the kernel where it pays): a linear runs on the kernel when
    the routing serves its row count (the prompt's and each step's), eagerly otherwise; tokens as plain's."""
    target, _ = bf16_pair()
    calls = []
    real = small_rows.small_rows_linear
    monkeypatch.setattr(
        small_rows, "small_rows_linear", lambda x, *a, **k: calls.append(x.shape[-2]) or real(x, *a, **k)
    )
    routing = KernelRouting(frozenset({1}), "test")  # one-row steps only: the 4-token prompt stays eager
    with routing.everywhere():
        out = greedy(target)
    assert calls and set(calls) == {1}
    assert out.tolist() == greedy(target).tolist()
    assert isinstance(KernelRouting.off("test").everywhere(), contextlib.nullcontext)


def test_a_kernel_that_disagrees_with_eager_is_turned_off(built, monkeypatch):
    """The check on the model's own weights: a path off by 1.3x (an untested CPU, a miscompilation) never serves
    the model: AUTO turns it off and says why, 'on' is refused for the target and runs the draft without it."""
    real = small_rows.small_rows_linear
    monkeypatch.setattr(small_rows, "small_rows_linear", lambda *args, **kwargs: real(*args, **kwargs) * 1.3)
    target, draft = bf16_pair()
    routing = KernelRouting.for_model(ModelFacts.of(target), LinearKernel.AUTO)
    assert not routing.is_on and "disagrees with eager F.linear" in routing.reason
    assert "disagrees" in KernelRouting.for_model(ModelFacts.of(draft), LinearKernel.ON, role=Role.DRAFT).reason
    with pytest.raises(ValueError, match="disagrees with eager F.linear"):
        KernelRouting.for_model(ModelFacts.of(copy.deepcopy(target)), LinearKernel.ON, role=Role.TARGET)
    out = greedy(target, draft_model=draft, num_lookahead=2, return_dict_in_generate=True)
    assert "disagrees" in out.speculative_stats.linear_kernel
    monkeypatch.setattr(small_rows, "small_rows_linear", real)
    assert out.sequences.tolist() == greedy(target).tolist()


def test_on_runs_a_draft_whose_form_has_no_bf16_linears(built):
    """'on' means the kernel wherever the forms allow it: a draft's dynamic-int8 copy (no bf16 nn.Linear) or its
    int8-weights copy (its own kernel path) is no reason to refuse."""
    target, draft = bf16_pair()
    for form in ("dynamic_int8", "int8_weights"):
        config = SpeculativeConfig(linear_kernel="on", draft_form=form)
        out = greedy(
            target, draft_model=draft, num_lookahead=2, speculative_config=config, return_dict_in_generate=True
        )
        assert out.speculative_stats.linear_kernel.startswith("target on"), out.speculative_stats.linear_kernel
        with SmallRowsLinear():
            assert out.sequences.tolist() == greedy(target).tolist()


@torch.no_grad()
def test_sampling_with_an_int8_weights_draft_on_the_kernel_is_exact(built, monkeypatch):
    target, draft = bf16_pair()
    every_forward_on_the_kernel(monkeypatch)
    out = target.generate(
        PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, num_return_sequences=4000, pad_token_id=PAD,
        generator=torch.Generator().manual_seed(6), draft_model=draft, num_lookahead=2,
        speculative_config=SpeculativeConfig(draft_form="int8_weights"), **SETTINGS,
    )  # fmt: skip
    assert chisquare_pvalue(kernel_exact(target), continuations(out, PROMPT.shape[1])) > 1e-3


def test_config_checks_linear_kernel():
    assert SpeculativeConfig(linear_kernel="off").linear_kernel is LinearKernel.OFF
    with pytest.raises(ValueError, match="linear_kernel must be one of 'auto', 'on', 'off'"):
        SpeculativeConfig(linear_kernel="fast")


# --- the draft's int4-weights form and AUTO's weighing of forms by acceptance ---

needs_int4 = pytest.mark.skipif(
    small_rows.load().problem is not None or small_rows.best_path(torch.uint8) is KernelPath.SCALAR,
    reason="int4 weights need a vector path that reads them (AVX-512 VNNI or BF16)",
)


@needs_int4
def test_int4_linear_computes_its_dequantized_weight():
    linear = torch.nn.Linear(256, 40, bias=True).to(torch.bfloat16)
    layer = Int4Linear.from_linear(linear)
    assert layer.packed.dtype == torch.uint8 and layer.packed.shape == (40, 128) and layer.scale.shape == (40, 2)
    x = torch.randn(3, 256).to(torch.bfloat16)
    expected = F.linear(x.float(), layer.dequantized(torch.float32), linear.bias.float())
    assert torch.allclose(layer(x).float(), expected, rtol=2**-6, atol=1e-2)
    # the rounding is int4's: each weight within half a step of its group's scale
    step = layer.scale.repeat_interleave(128, dim=1)
    assert ((layer.dequantized(torch.float32) - linear.weight.float()).abs() <= step / 2 + 1e-6).all()


@needs_int4
@torch.no_grad()
def test_an_int4_weights_draft_is_exact(monkeypatch):
    """The int4 form drafts worse, never differently: greedy equals plain, sampling follows the target."""
    target = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=128).to(torch.bfloat16)
    draft = perturbed_copy(target, seed=1, scale=0.3)
    config = SpeculativeConfig(draft_form="int4_weights")
    out = greedy(target, draft_model=draft, num_lookahead=3, speculative_config=config, return_dict_in_generate=True)
    assert out.speculative_stats.draft_form == "int4_weights" and "int4 weights" in out.speculative_stats.linear_kernel
    assert out.sequences.tolist() == greedy(target).tolist()
    every_forward_on_the_kernel(monkeypatch)
    samples = target.generate(
        PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, num_return_sequences=4000, pad_token_id=PAD,
        generator=torch.Generator().manual_seed(7), draft_model=draft, num_lookahead=2, speculative_config=config,
        **SETTINGS,
    )  # fmt: skip
    assert chisquare_pvalue(kernel_exact(target), continuations(samples, PROMPT.shape[1])) > 1e-3


def test_int4_weights_is_refused_where_no_vector_path_reads_it(monkeypatch):
    target, draft = bf16_pair()
    monkeypatch.setattr(small_rows, "paths", lambda: [KernelPath.AVX2_FMA, KernelPath.SCALAR])
    with pytest.raises(ValueError, match="draft_form='int4_weights' needs"):
        greedy(target, draft_model=draft, speculative_config=SpeculativeConfig(draft_form="int4_weights"))


def test_acceptance_is_one_for_the_target_itself_and_less_for_another_model():
    from hf_specsample.prepare.draft_timing import acceptance

    target = tiny_lm(seed=0, vocab_size=16, layers=1, hidden=16)
    ids = torch.randint(0, 16, (40,), generator=torch.Generator().manual_seed(0))
    same, other = acceptance(target, [target, tiny_lm(seed=3, vocab_size=16)], ids, contextlib.nullcontext())
    assert same == pytest.approx(1.0) and 0.0 < other < 0.95


@pytest.mark.parametrize("int4_rate, chosen", [(0.9, "int4_weights"), (0.3, "int8_weights")])
def test_auto_with_calibration_weighs_acceptance_against_step_time(monkeypatch, int4_rate, chosen):
    """int4 steps fastest here (by the fake clock): AUTO keeps it where it drafts about as well as the others, and
    an int8 form where its acceptance drops too far to pay for the faster step."""
    from hf_specsample import DraftForm as Form
    from hf_specsample.prepare import form_choice, prepared_draft

    forms = {Form.AS_GIVEN: 0.030, Form.DYNAMIC_INT8: 0.025, Form.INT8_WEIGHTS: 0.020, Form.INT4_WEIGHTS: 0.012}
    monkeypatch.setattr(prepared_draft, "quantized_forms", lambda model, wanted: {
        form: (lambda model: model) for form in wanted
    })  # fmt: skip
    monkeypatch.setattr(form_choice, "time_forms", lambda made, source, target, plan, kernel: form_choice.FormTimings(
        {form: forms[form] for form in made}, 0.15
    ))  # fmt: skip
    rates = {Form.AS_GIVEN: 0.9, Form.DYNAMIC_INT8: 0.9, Form.INT8_WEIGHTS: 0.9, Form.INT4_WEIGHTS: int4_rate}
    monkeypatch.setattr(form_choice, "acceptance", lambda target, drafts, *args: list(rates.values()))
    target, draft = bf16_pair()
    prepared = prepare_draft(draft, target, calibration=torch.arange(32) % 16)
    assert prepared.form == chosen and prepared.acceptance[Form.INT4_WEIGHTS] == int4_rate
    assert "acceptance: as_given 0.90" in prepared.description
    assert prepare_draft(draft, target).form == "int8_weights"  # no calibration: int4 is not considered


@pytest.mark.parametrize("path", [pytest.param(path, id=str(path)) for path in small_rows.READS[torch.int8]])
@pytest.mark.parametrize("x_dtype, bias_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.float16, torch.float16), (torch.float32, None)])  # fmt: skip
def test_int8_weights_take_every_activation_and_bias_dtype(built, path, x_dtype, bias_dtype):
    """The VNNI path reads bf16 and fp32 x (and a bias of the same dtype) directly and writes x's dtype; every other
    mix goes through fp32: each returns x's dtype, within the path's rounding of the fp32 reference."""
    if path not in small_rows.paths():
        pytest.skip(f"this CPU has no {path} path")
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(-127, 128, (37, 200), generator=generator, dtype=torch.int8)
    scale = torch.rand(37, generator=generator) / 64
    dense = weight.float() * scale[:, None]
    x = torch.randn(5, 200, generator=generator).to(x_dtype)
    bias = None if bias_dtype is None else torch.randn(37, generator=generator).to(bias_dtype)
    out = small_rows.small_rows_linear_int8(x, weight, scale, bias, path=path)
    expected = F.linear(x.float(), dense, None if bias is None else bias.float())
    bound = x.float().abs() @ dense.abs().T + (0 if bias is None else bias.float().abs())
    slack = x.float().abs().amax(1, keepdim=True) / 254 * dense.abs().sum(1)[None, :]  # VNNI rounds x to int8
    assert out.dtype == x_dtype and out.shape == (5, 37)
    assert ((out.float() - expected).abs() <= 2**-7 * bound + 1e-5 + slack).all()


def sibling_copy_pair(make):
    """A tiny Llama (q/k/v with biases, gate/up) and its quantized copy with and without fused siblings."""
    import hf_specsample.prepare.surgery as surgery

    model = tiny_lm(seed=0, vocab_size=32, layers=2, hidden=64).to(torch.bfloat16)
    for layer in model.model.layers:  # q/k/v biases as Qwen2 has them (k and v here, q without: zeros fused in)
        attention = layer.self_attn
        for name in ("k_proj", "v_proj"):
            old = getattr(attention, name)
            new = torch.nn.Linear(old.in_features, old.out_features, bias=True).to(torch.bfloat16)
            new.weight.data.copy_(old.weight.data)
            torch.nn.init.normal_(new.bias, std=0.5)
            setattr(attention, name, new)
    fused = make(model)
    groups, surgery.SIBLING_GROUPS = surgery.SIBLING_GROUPS, ()
    try:
        separate = make(model)
    finally:
        surgery.SIBLING_GROUPS = groups
    return model, fused, separate


@pytest.mark.parametrize("form", ["int8_weights", "int4_weights"])
@torch.no_grad()
def test_sibling_projections_compute_what_separate_ones_do(built, form):
    """q/k/v and gate/up of a quantized draft run as one kernel call each and give the separate layers' outputs bit
    for bit (per-row scales round each row as alone), in and out of inference mode (an inference tensor has no
    version counter: the step timing of `draft_form="auto"` runs there), one token or several."""
    from hf_specsample.kernels.quantized_linear import SiblingProjection
    from hf_specsample.policy.round_costs import weight_bytes
    from hf_specsample.prepare.draft_timing import decode_step_seconds
    from hf_specsample.prepare.surgery import int4_weights_copy, int8_weights_copy

    if form == "int4_weights" and small_rows.best_path(torch.uint8) is KernelPath.SCALAR:
        pytest.skip("int4 weights need a vector path that reads them")
    make = int8_weights_copy if form == "int8_weights" else int4_weights_copy
    model, fused, separate = sibling_copy_pair(make)
    layer = fused.model.layers[0]
    siblings = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    assert all(isinstance(sibling, SiblingProjection) for sibling in siblings)
    assert siblings[0].fused is siblings[2].fused and layer.mlp.gate_proj.fused is layer.mlp.up_proj.fused
    assert not isinstance(separate.model.layers[0].self_attn.q_proj, SiblingProjection)
    q_zero_biases = 2 * 64 * 2  # 2 layers x 64 bf16 zeros: q has no bias of its own
    assert weight_bytes(fused) == weight_bytes(separate) + q_zero_biases  # the fused module counted once
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert torch.equal(fused(ids).logits, separate(ids).logits)
    assert torch.equal(fused(ids[:, :1]).logits, separate(ids[:, :1]).logits)
    with torch.inference_mode():
        assert torch.equal(fused(ids).logits, separate(ids).logits)
    assert all(seconds < float("inf") for seconds in decode_step_seconds([fused, separate]))


@torch.no_grad()
def test_a_sibling_given_another_input_projects_that_input(built):
    """A kept output is handed only to a sibling called with the very input it was computed from, unmodified, and
    only once; any other call computes its own projection."""
    from hf_specsample.prepare.surgery import int8_weights_copy

    model, fused, separate = sibling_copy_pair(int8_weights_copy)
    q, k, v = (getattr(fused.model.layers[0].self_attn, name) for name in ("q_proj", "k_proj", "v_proj"))
    k_alone, v_alone = separate.model.layers[0].self_attn.k_proj, separate.model.layers[0].self_attn.v_proj
    generator = torch.Generator().manual_seed(0)
    x, other = (torch.randn(1, 3, 64, generator=generator).to(torch.bfloat16) for _ in range(2))
    q(x)
    assert torch.equal(k(other), k_alone(other))  # another input: its own projection
    first = k(x)
    assert torch.equal(first, k_alone(x))
    again = k(x)  # handed out once: computed afresh
    assert again is not first and torch.equal(again, first)
    q(x)
    x.mul_(2)  # the input changed in place: the kept outputs are stale
    assert torch.equal(v(x), v_alone(x))
