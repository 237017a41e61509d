"""NaN or inf in the processed scores while sampling raises, as plain `generate()` does (it never emits token 0)."""

import math

import pytest
import torch
from tiny import PAD, perturbed_copy, tiny_lm
from transformers import LogitsProcessor, LogitsProcessorList

from hf_specsample.verify.rules import NonFinite, Verdict, flag_nonfinite

PROMPT = torch.tensor([[1, 5, 6, 7]])


@pytest.fixture(scope="module")
def target():
    return tiny_lm(seed=0, vocab_size=32, layers=2, hidden=32)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, seed=1, scale=0.1)


class WriteAt(LogitsProcessor):
    """Writes `value` into column `token` (all columns if None) once the prefix reaches `from_length`."""

    def __init__(self, value: float, token: int | None = 3, from_length: int = 0):
        self.value, self.token, self.from_length = value, token, from_length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] < self.from_length:
            return scores
        scores = scores.clone()
        if self.token is None:
            scores[:] = self.value
        else:
            scores[:, self.token] = self.value
        return scores


def generate(model, draft=None, **kwargs):
    extra = dict(draft_model=draft, num_lookahead=3) if draft is not None else {}
    return model.generate(PROMPT, max_new_tokens=8, pad_token_id=PAD, **extra, **kwargs)


@pytest.mark.parametrize(
    "value, token", [(math.inf, 3), (math.nan, 3), (-math.inf, None)], ids=["plus_inf", "nan", "all_minus_inf"]
)
def test_target_nonfinite_scores_raise_like_plain(target, draft, value, token):
    processors = LogitsProcessorList([WriteAt(value, token, from_length=6)])  # from the third new token on
    with pytest.raises(RuntimeError):
        generate(target, do_sample=True, logits_processor=processors)
    with pytest.raises(RuntimeError, match="target's processed next-token scores contain NaN or inf"):
        generate(target, draft, do_sample=True, logits_processor=processors)


def test_nan_draft_raises(target, draft):
    broken = perturbed_copy(draft, seed=2, scale=0.0)
    with torch.no_grad():
        broken.lm_head.weight[0, 0] = math.nan
    with pytest.raises(RuntimeError, match="draft's processed next-token scores contain NaN or inf"):
        generate(target, broken, do_sample=True)


def test_remove_invalid_values_repairs_a_nan_draft(target, draft):
    """The advice in the draft's error works: the processor list (draft and target alike) cleans NaN scores."""
    broken = perturbed_copy(draft, seed=2, scale=0.0)
    with torch.no_grad():
        broken.lm_head.weight[0, 0] = math.nan
    out = generate(target, broken, do_sample=True, remove_invalid_values=True)
    assert out.shape == (1, PROMPT.shape[1] + 8)


def test_a_user_processor_after_remove_invalid_values_raises_in_both(target, draft):
    """transformers runs the caller's processors after its own: inf written there reaches sampling in both."""
    processors = LogitsProcessorList([WriteAt(math.inf, 3, from_length=6)])
    with pytest.raises(RuntimeError):
        generate(target, do_sample=True, logits_processor=processors, remove_invalid_values=True)
    with pytest.raises(RuntimeError, match="target's processed"):
        generate(target, draft, do_sample=True, logits_processor=processors, remove_invalid_values=True)


def test_greedy_with_inf_equals_plain(target, draft):
    """Greedy takes the argmax, which plain greedy does with inf too: same tokens, no error."""
    processors = LogitsProcessorList([WriteAt(math.inf, 3, from_length=6)])
    plain = generate(target, do_sample=False, logits_processor=processors)
    assert generate(target, draft, do_sample=False, logits_processor=processors).tolist() == plain.tolist()


def test_flag_counts_only_the_distributions_a_row_used():
    vocab = 4
    target_probs = torch.full((3, 3, vocab), 0.25)
    draft_probs = torch.full((3, 2, vocab), 0.25)
    target_probs[0, 1] = math.nan  # row 0 accepted 1 draft token: position 1 is where it sampled -> flagged
    target_probs[1, 2] = math.nan  # row 1 stopped at position 0: position 2 was never used -> not flagged
    draft_probs[2, 0] = math.nan  # row 2 accepted 1: the draft distribution at 0 was used -> flagged
    verdict = Verdict(torch.tensor([1, 0, 1]), torch.zeros(3, dtype=torch.long))
    flagged = flag_nonfinite(verdict, draft_probs, target_probs)
    assert flagged.num_accepted.tolist() == [NonFinite.TARGET, 0, NonFinite.DRAFT]


def test_nan_activations_in_the_int8_draft_say_what_to_do(target, draft, int8_steps_faster):
    """The default int8 copy cannot quantize NaN activations: a clear error, and the way out works."""
    from hf_specsample import SpeculativeConfig

    broken = perturbed_copy(draft, seed=2, scale=0.0)
    with torch.no_grad():
        broken.model.norm.weight[0] = math.nan  # NaN hidden states reach the quantized LM head
    with pytest.raises(RuntimeError, match="draft's activations contain NaN or inf.*draft_form='as_given'"):
        generate(target, broken, do_sample=False)
    as_given = SpeculativeConfig(draft_form="as_given")
    plain = generate(target, do_sample=False)
    assert generate(target, broken, do_sample=False, speculative_config=as_given).tolist() == plain.tolist()


def test_an_int8_copy_that_cannot_run_is_not_chosen(target, draft):
    """AUTO times the draft's forms: the dynamic-int8 copy, whose forward fails (it cannot quantize NaN activations),
    loses, and another form runs (exact as always: greedy equals plain)."""
    broken = perturbed_copy(draft, seed=2, scale=0.0)
    with torch.no_grad():
        broken.model.norm.weight[0] = math.nan
    out = generate(target, broken, do_sample=False, return_dict_in_generate=True)
    form = out.speculative_stats.draft_form
    assert "int8 failed" in form and not form.startswith("int8 "), form
    assert out.sequences.tolist() == generate(target, do_sample=False).tolist()
