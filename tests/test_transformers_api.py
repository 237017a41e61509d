"""The one seam to transformers (`core/transformers_api.py`): the installed version's names, the version check, the
caller's cache under every name plain `generate()` accepts, and the suite's deprecation guard (conftest.py)."""

import ast
import logging
import os
import re
import warnings

import pytest
import torch
import transformers
from conftest import OwnDeprecation
from packaging.version import Version
from tiny import PAD, cache_of, perturbed_copy, tiny_lm, with_cache
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils.deprecation import deprecate_kwarg

import hf_specsample
from hf_specsample.core import transformers_api

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = torch.tensor([[1, 5, 2, 5, 3]])
RENAMED = "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__  # transformers >= 5.24


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=16)
    return target, perturbed_copy(target, seed=1, scale=0.2)


def test_the_names_are_the_installed_versions():
    assert transformers_api.CACHE == ("cache" if RENAMED else "past_key_values") == hf_specsample.CACHE
    assert transformers_api.CALLER_CACHE_NAMES[0] == transformers_api.CACHE
    assert ("past_key_values" in transformers_api.CALLER_CACHE_NAMES) is True  # both versions still take it


def test_a_models_forward_names_its_own_cache_argument(pair):
    target, _ = pair
    assert transformers_api.forward_cache_name(target) == transformers_api.CACHE

    class OldStyle(torch.nn.Module):  # remote code written for an older transformers
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return past_key_values

    assert transformers_api.forward_cache_name(OldStyle()) == "past_key_values"
    assert transformers_api.cache_kwargs(OldStyle(), "c") == {"past_key_values": "c"}


def test_the_output_carries_the_cache_under_plains_name(pair):
    target, draft = pair
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True)
    plain = target.generate(PROMPT, **kwargs)
    mine = target.generate(PROMPT, draft_model=draft, num_lookahead=2, **kwargs)
    assert set(plain.keys()) <= set(mine.keys()) | {"scores", "logits"}
    assert transformers_api.CACHE in mine.keys() and transformers_api.CACHE in plain.keys()
    assert cache_of(mine).get_seq_length() == cache_of(plain).get_seq_length() == mine.sequences.shape[1] - 1


@pytest.mark.parametrize("name", ["current", "past_key_values"])
def test_a_chat_turns_cache_is_taken_under_every_name_plain_generate_takes(pair, name):
    """`cache=` (5.24) and `past_key_values=` (both, deprecated on 5.24): the second turn equals plain's."""
    target, draft = pair
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True)
    first = target.generate(PROMPT, **kwargs)
    conversation = torch.cat([first.sequences, torch.tensor([[4, 1]])], dim=1)
    plain = target.generate(conversation, **with_cache(cache_of(target.generate(PROMPT, **kwargs))), **kwargs)
    argument = transformers_api.CACHE if name == "current" else name
    deprecated = argument != transformers_api.CACHE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = target.generate(conversation, **{argument: cache_of(first)}, draft_model=draft, **kwargs)  # line L
    ours = [w for w in caught if issubclass(w.category, FutureWarning) and argument in str(w.message)]
    if deprecated:  # transformers' message, once, at the caller's line (this file), as plain generate() gives it
        assert len(ours) == 1 and ours[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]
    else:
        assert ours == []
    assert mine.sequences.tolist() == plain.sequences.tolist()
    assert cache_of(mine) is cache_of(first)  # the caller's object, left holding what plain's holds


@pytest.mark.skipif(not RENAMED, reason="transformers < 5.24 takes the cache as `past_key_values` only")
def test_both_names_at_once_are_refused(pair):
    target, draft = pair
    cache = cache_of(target.generate(PROMPT, max_new_tokens=2, pad_token_id=PAD, return_dict_in_generate=True))
    with pytest.raises(ValueError, match="Pass the cache once"):
        target.generate(PROMPT, cache=cache, past_key_values=cache, draft_model=draft, pad_token_id=PAD)


def test_an_older_transformers_is_refused_naming_the_floor():
    with pytest.raises(ImportError, match=re.escape(f"needs transformers >= {transformers_api.OLDEST_SUPPORTED}")):
        transformers_api.check_installed("5.22.2")
    transformers_api.check_installed(transformers_api.OLDEST_SUPPORTED)  # the floor itself is fine


def test_a_newer_untested_transformers_gets_a_warning_naming_the_tested_range():
    newest = Version(transformers_api.NEWEST_TESTED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transformers_api.check_installed(f"{newest.major}.{newest.minor}.9")  # a patch release of a tested minor
    with pytest.warns(UserWarning, match=rf"tested with transformers .* to {re.escape(str(newest))}"):
        transformers_api.check_installed(f"{newest.major}.{newest.minor + 1}.0")


def test_a_missing_hook_is_refused_at_import(monkeypatch):
    monkeypatch.delattr(transformers.generation.utils.GenerationMixin, "_valid_auto_compile_criteria")
    with pytest.raises(ImportError, match="lacks GenerationMixin._valid_auto_compile_criteria"):
        transformers_api.check_installed()


def test_pyproject_states_the_tested_range():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    floor, ceiling = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', text).groups()
    assert Version(floor) == Version(transformers_api.OLDEST_SUPPORTED)
    tested = Version(transformers_api.NEWEST_TESTED)
    assert Version(ceiling) == Version(f"{tested.major}.{tested.minor + 1}")  # patch releases of the tested minor
    assert Version(transformers.__version__) >= Version(floor)


def test_no_module_but_the_seam_spells_transformers_cache_names():
    """Code outside `core/transformers_api.py` never spells the names transformers renames: no such string, keyword
    argument or attribute (prose in docstrings may name them; `cache=` of the library's own classes is theirs)."""
    old, names = {"past_key_values", "cache_params"}, {"past_key_values", "cache_params", "cache"}
    offenders = []
    for folder in ("hf_specsample", "hf_specsample_bench", "examples", "benchmarks", "custom_generate"):
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            for file in files:
                path = os.path.join(directory, file)
                if not file.endswith(".py") or path.endswith("transformers_api.py"):
                    continue
                for node in ast.walk(ast.parse(open(path).read())):
                    spelled = (
                        (isinstance(node, ast.Constant) and node.value in names)
                        or (isinstance(node, ast.keyword) and node.arg in old)
                        or (isinstance(node, ast.Attribute) and node.attr in old)
                    )
                    if spelled:
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


# --- the deprecation guard (conftest.py): it must fail our calls and leave a test's own calls alone -----------------

_DEPRECATED = deprecate_kwarg("old", version="99.0.0", new_name="new")(lambda new=None: new)


def _as_if_in(folder: str, source: str, **names):
    """Run `source` as code of a file in `folder` of this repository (the guard judges by the caller's file)."""
    code = compile(source, os.path.join(ROOT, folder, "_guard_probe.py"), "exec")
    exec(code, {"__name__": f"{folder}._guard_probe", **names})


def test_the_guard_fails_a_deprecated_argument_passed_by_our_code():
    with pytest.raises(OwnDeprecation, match=r"hf_specsample[/\\]_guard_probe.py:1"):
        _as_if_in("hf_specsample", "f(old=1)", f=_DEPRECATED)
    with pytest.raises(OwnDeprecation):
        _as_if_in("examples", "f(old=1)", f=_DEPRECATED)


def test_the_guard_fails_a_deprecation_logged_for_our_call():
    logger = logging.getLogger("transformers.test_probe")
    with pytest.raises(OwnDeprecation, match="`thing` is deprecated"):
        _as_if_in("hf_specsample_bench", "log.warning('`thing` is deprecated. Use `other`.')", log=logger)


def test_the_guard_leaves_a_tests_own_deprecated_call_alone():
    with pytest.warns(FutureWarning, match="`old` is deprecated"):
        assert _DEPRECATED(old=1) == 1
    logging.getLogger("transformers.test_probe").warning("`thing` is deprecated. Use `other`.")


@pytest.mark.skipif(not RENAMED, reason="transformers < 5.24 takes `past_key_values` without a deprecation")
def test_the_guard_fails_the_projects_own_generate_call_with_the_old_name(pair):
    """The registered generate() renames `past_key_values=` itself (so transformers never sees it): the guard counts
    that rename's message as transformers' and fails it where the project's code passed the old name."""
    target, _ = pair
    with pytest.raises(OwnDeprecation, match=r"examples[/\\]_guard_probe.py:1"):
        _as_if_in("examples", "model.generate(prompt, past_key_values=None, max_new_tokens=1)", model=target,
                  prompt=PROMPT)  # fmt: skip
