"""A model's cache kind is read off its config, never by building a cache: the answer must be what a built cache says,
for every architecture the tests build (sliding-window models and every hybrid family transformers ships included)."""

import pytest
from tiny import ARCHITECTURES, tiny_arch
from transformers import DynamicCache, StaticCache

from hf_specsample.cache import row_ops
from hf_specsample.core import transformers_api
from hf_specsample.core.model_facts import _cache_kind, linear_layers, unsupported_layers
from hf_specsample_bench.hybrids import HYBRID_FAMILIES, available, tiny_hybrid

MODELS = [("arch", name) for name in ARCHITECTURES] + [("hybrid", name) for name in HYBRID_FAMILIES]


def _model(kind: str, name: str):
    if kind == "hybrid" and not available(name):
        pytest.skip(f"{name} is not in this transformers")
    return tiny_arch(name, seed=0) if kind == "arch" else tiny_hybrid(name, seed=0)


def _cache_kind_of_a_built_cache(model) -> tuple[str | None, bool]:
    """`model_facts._cache_kind` answered the old way, from a `DynamicCache` built from the config: the reference."""
    if transformers_api.forward_cache_name(model) is None:
        return f"{type(model).__name__}'s forward takes no cache", False
    supports_dynamic = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_dynamic is not None and not supports_dynamic():
        own = "keeps a cache of its own, not a DynamicCache (transformers says so itself)"
        return f"{type(model).__name__} {own}", False
    try:
        cache = DynamicCache(config=model.config)
    except Exception as error:
        return f"no DynamicCache can be built for {type(model).__name__} ({error})", False
    keeps_state = any(True for _ in linear_layers(cache))
    if "reuse" in (getattr(model.config.get_text_config(decoder=True), "kv_sharing_modes", None) or ()):
        return (
            f"{type(model).__name__}'s layers reuse keys and values shared with other layers (KV sharing), which "
            "hf_specsample cannot roll back row by row"
        ), keeps_state
    unsupported = unsupported_layers(cache)
    if unsupported:
        return (
            f"{type(model).__name__}'s cache has layers of type {', '.join(unsupported)} (for instance a sparse-"
            "attention indexer), which hf_specsample cannot roll back row by row"
        ), keeps_state
    return None, keeps_state


@pytest.mark.parametrize("kind, name", MODELS, ids=[name for _, name in MODELS])
def test_the_cache_kind_read_off_the_config_is_what_a_built_cache_says(kind, name, monkeypatch):
    model = _model(kind, name)
    built = []
    real_init = DynamicCache.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(DynamicCache, "__init__", counting)
    answer = _cache_kind(model)
    assert built == []  # read, not built
    monkeypatch.undo()
    assert answer == _cache_kind_of_a_built_cache(model)
    config = model.config
    dynamic = [type(layer) for layer in DynamicCache(config=config).layers]
    assert transformers_api.cache_layer_classes(config) == dynamic
    try:
        static = StaticCache(config=config.get_text_config(decoder=True), max_cache_len=1)
    except Exception as error:  # a layer this config cannot make statically: reading it must not pass either
        with pytest.raises(type(error)):
            transformers_api.cache_layer_classes(config, static=True)
        return
    assert transformers_api.cache_layer_classes(config, static=True) == [type(layer) for layer in static.layers]
    assert row_ops.static_cache_problem(None, config) == row_ops.static_cache_problem(static, config)


def test_a_layer_type_transformers_does_not_know_is_refused_as_before():
    """A config naming a layer type no cache layer class registered: refused as a cache that cannot be built."""
    model = tiny_arch("llama", seed=0)
    model.config.layer_types = ["full_attention", "no_such_attention"]
    problem, keeps_state = _cache_kind(model)
    assert (problem, keeps_state) == _cache_kind_of_a_built_cache(model)
    assert problem.startswith("no DynamicCache can be built for LlamaForCausalLM") and not keeps_state
