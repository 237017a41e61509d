"""hf_specsample: exact speculative sampling as a one-argument change to `model.generate()`.

    import hf_specsample  # registers draft_model= / num_lookahead= on generate()
    out = target.generate(**inputs, draft_model=draft, do_sample=True, temperature=0.7, top_p=0.95)

    prepared = hf_specsample.prepare_draft(draft, target)  # optional: prepare once, hold it, pass it
    out = target.generate(**inputs, draft_model=prepared)

    hf_specsample.generate(target, **inputs, draft_model=draft)  # the same, whether registered or not

Outputs follow the target's own distribution exactly (greedy: token for token), under every logits processor.
"""

from .core.transformers_api import CACHE, check_installed

check_installed()  # before anything else: an unsupported transformers is refused here, with what to do

from .cache.compiled import release_compiled
from .decoding import speculative_generate
from .options import (
    DraftForm,
    DraftShape,
    DynamicTree,
    LinearKernel,
    NamedDraft,
    SpeculativeConfig,
    TreeShape,
    Verification,
)
from .outputs import SpeculativeDecoderOnlyOutput
from .policy.lookahead import DEFAULT_MAX_LOOKAHEAD, AdaptiveLookahead, FixedLookahead, LookaheadPolicy
from .prepare.prepared_draft import PreparedDraft, prepare_draft
from .prepare.vocabulary import frequent_tokens
from .proposers.suffix_store import SuffixDraft, SuffixStats
from .registration import generate, is_registered, register, unregister
from .stats import SpeculativeStats

__version__ = "0.1.0"

__all__ = [
    "CACHE",
    "AdaptiveLookahead",
    "DEFAULT_MAX_LOOKAHEAD",
    "DraftForm",
    "DraftShape",
    "DynamicTree",
    "FixedLookahead",
    "NamedDraft",
    "frequent_tokens",
    "generate",
    "LookaheadPolicy",
    "PreparedDraft",
    "prepare_draft",
    "SpeculativeConfig",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeStats",
    "SuffixDraft",
    "SuffixStats",
    "TreeShape",
    "Verification",
    "LinearKernel",
    "is_registered",
    "register",
    "release_compiled",
    "speculative_generate",
    "unregister",
]

register()
