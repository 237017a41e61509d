"""hf_specsample's exact speculative sampling as a transformers `custom_generate` method.

    out = model.generate(**inputs, custom_generate="<this repository>", trust_remote_code=True,
                         draft_model=draft, num_lookahead=4, do_sample=True)

transformers calls `generate(model=..., **arguments)` with every argument of the `generate()` call (the
`custom_generate` and `trust_remote_code` ones excepted). They go to hf_specsample's `generate()` wrapper, which
routes them through transformers' `custom_generate` hook to `hf_specsample.speculative_generate`: transformers still
prepares the inputs, logits processors and stopping criteria and validates every other argument. Nothing of the
decoding loop lives here; `pip install hf-specsample` provides it.
"""

from hf_specsample import registration  # importing hf_specsample also adds draft_model= to every generate()


def generate(model, **kwargs):
    """Speculative sampling with `draft_model=` (a small causal LM sharing the target's tokenizer, "auto" or
    "prompt_lookup"); every other argument is `generate()`'s own or hf_specsample's (`num_lookahead`,
    `speculative_config`, `generator`, ...)."""
    if kwargs.get("draft_model") is None:
        raise ValueError(
            "This custom_generate method is hf_specsample's speculative sampling: pass `draft_model=` (a small causal "
            'LM that shares the target\'s tokenizer, "auto" for a draft made from the target, or "prompt_lookup"), '
            "or leave out `custom_generate=` for the model's own generate()."
        )
    # The wrapper itself, not `model.generate`: a model loaded with trust_remote_code from a repository holding this
    # folder has `generate` replaced by this very function.
    return registration.generate(model, **kwargs)
