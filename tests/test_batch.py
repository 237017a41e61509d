"""Batches: left-padded prompts of different lengths, ragged acceptance, rows finishing at different times."""

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from tiny import PAD, perturbed_copy, prepared_processors, tiny_lm
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

VOCAB = 64
# Three prompts of lengths 3, 6 and 5, left-padded to 6 (PAD is also a real token, so the mask matters).
PROMPTS = [[1, 17, 42], [1, 5, 9, 11, 3, 4], [1, 2, 3, 4, 5]]


def left_padded(prompts):
    width = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def greedy(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **kwargs)


@pytest.mark.parametrize("lookahead", [1, 3, 6])
def test_greedy_rows_equal_batched_plain_greedy(target, draft, lookahead):
    ids, mask = left_padded(PROMPTS)
    free_run = greedy(target, ids, mask, max_new_tokens=30)
    # An EOS the middle row emits early, so rows finish at different times and get padded.
    eos = free_run[1, ids.shape[1] + 6].item()
    for eos_token_id in (None, eos):
        expected = greedy(target, ids, mask, max_new_tokens=30, eos_token_id=eos_token_id)
        got = greedy(
            target, ids, mask, max_new_tokens=30, eos_token_id=eos_token_id, draft_model=draft,
            num_lookahead=lookahead,
        )  # fmt: skip
        assert torch.equal(got, expected)
    assert (expected == PAD).any(), "no row finished early: the padding path is untested"


def test_greedy_with_row_indexed_processors(target, draft):
    """A padded batch gives the repetition penalty one prompt-padding length per row."""
    ids, mask = left_padded(PROMPTS)
    settings = dict(repetition_penalty=1.5, no_repeat_ngram_size=3, max_new_tokens=25)
    expected = greedy(target, ids, mask, **settings)
    assert torch.equal(greedy(target, ids, mask, draft_model=draft, num_lookahead=4, **settings), expected)


def test_rows_finishing_at_different_times_are_padded_like_generate(target, draft):
    ids, mask = left_padded(PROMPTS)
    eos = greedy(target, ids, mask, max_new_tokens=30)[1, ids.shape[1] + 4].item()
    out = greedy(
        target, ids, mask, max_new_tokens=30, eos_token_id=eos, draft_model=draft, return_dict_in_generate=True
    )
    stats = out.speculative_stats
    for row, new_tokens in enumerate(stats.row_new_tokens):
        generated = out.sequences[row, ids.shape[1] :].tolist()
        assert generated[new_tokens:] == [PAD] * (len(generated) - new_tokens)
        assert new_tokens == 30 or generated[new_tokens - 1] == eos
    assert len(set(stats.row_new_tokens)) > 1
    # finished rows leave the batch: they take part in fewer target passes
    assert min(stats.row_target_passes) < max(stats.row_target_passes) == stats.target_forward_passes


def test_num_return_sequences(target, draft):
    ids, mask = left_padded(PROMPTS[:2])
    generator = torch.Generator().manual_seed(0)
    out = target.generate(
        ids, attention_mask=mask, do_sample=True, num_return_sequences=3, max_new_tokens=12, pad_token_id=PAD,
        draft_model=draft, generator=generator, return_dict_in_generate=True,
    )  # fmt: skip
    assert out.sequences.shape == (6, ids.shape[1] + 12)
    assert torch.equal(out.sequences[:3, : ids.shape[1]], ids[:1].expand(3, -1))
    assert len(out.speculative_stats.row_new_tokens) == 6


def test_prefix_allowed_tokens_fn_sees_each_rows_batch_id(target, draft):
    ids, mask = left_padded(PROMPTS)
    seen = set()

    def allowed(batch_id, sent):  # row b may only use tokens congruent to b mod 3
        seen.add(batch_id)
        return [token for token in range(VOCAB) if token % 3 == batch_id]

    expected = greedy(target, ids, mask, max_new_tokens=15, prefix_allowed_tokens_fn=allowed)
    got = greedy(target, ids, mask, max_new_tokens=15, prefix_allowed_tokens_fn=allowed, draft_model=draft)
    assert torch.equal(got, expected) and seen == {0, 1, 2}


def test_batch_statistics(target, draft):
    ids, mask = left_padded(PROMPTS)
    out = target.generate(
        ids, attention_mask=mask, do_sample=True, max_new_tokens=20, pad_token_id=PAD, draft_model=draft,
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    stats = out.speculative_stats
    assert stats.row_new_tokens == [20, 20, 20]
    assert stats.new_tokens == 60
    assert all(0 <= a <= d for a, d in zip(stats.row_accepted_tokens, stats.row_draft_tokens))
    assert len(out.scores) == 20 and out.scores[0].shape == (3, VOCAB)
    # the summary's rate is per row and pass (60 tokens over the rows' passes), and says so
    assert f"({60 / sum(stats.row_target_passes):.2f} per row and pass)" in str(stats)


def test_streamer_with_a_batch_is_refused(target, draft):
    ids, mask = left_padded(PROMPTS)
    with pytest.raises(ValueError, match="streamer= takes one row"):
        greedy(target, ids, mask, max_new_tokens=5, draft_model=draft, streamer=BaseStreamer())


# --- exactness per row ---------------------------------------------------------------------------------------------

NUM_TOKENS, ROWS = 3, 3000


@pytest.fixture(scope="module")
def small_pair():
    small_target = tiny_lm(seed=0)  # 8-token vocabulary: every continuation can be enumerated
    return small_target, perturbed_copy(small_target, seed=1, scale=0.3)


class NeverStops:
    """A user's stopping criterion that never fires: in a batch it makes the rows commit in lockstep."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("lockstep", [False, True])
def test_each_row_follows_its_own_prompts_distribution(small_pair, lockstep):
    """Two prompts of different lengths, left-padded, ROWS rows each, in one call; with a user's criterion the rows
    commit in lockstep (each round the fewest tokens any row accepted), which must sample the same."""
    from transformers import StoppingCriteriaList

    small_target, small_draft = small_pair
    prompts = [[1, 5, 2, 5], [1, 3]]
    ids, mask = left_padded(prompts)
    settings = dict(temperature=0.9, top_k=6, repetition_penalty=1.4)
    extra = dict(stopping_criteria=StoppingCriteriaList([NeverStops()]), eos_token_id=VOCAB + 5) if lockstep else {}
    out = small_target.generate(
        ids, attention_mask=mask, do_sample=True, num_return_sequences=ROWS, max_new_tokens=NUM_TOKENS,
        pad_token_id=PAD, draft_model=small_draft, num_lookahead=2, generator=torch.Generator().manual_seed(21),
        **settings, **extra,
    )  # fmt: skip
    samples = continuations(out, ids.shape[1])
    for index, prompt in enumerate(prompts):
        prompt_ids = torch.tensor([prompt])
        processors, _ = prepared_processors(
            small_target, prompt_ids, do_sample=True, max_new_tokens=NUM_TOKENS, **settings
        )
        exact = exact_distribution(small_target, prompt_ids, processors, NUM_TOKENS)
        rows = samples[index * ROWS : (index + 1) * ROWS]
        assert chisquare_pvalue(exact, rows) > 1e-3


ROW_INDEXED_SETTINGS = {  # processors plain generate() calls with the whole batch and that look rows up by index
    "encoder_repetition_penalty": dict(encoder_repetition_penalty=0.3),
    "encoder_no_repeat_ngram_size": dict(encoder_no_repeat_ngram_size=1),
}


@pytest.mark.parametrize("name", list(ROW_INDEXED_SETTINGS))
def test_row_indexed_processors_sample_each_rows_distribution(small_pair, name):
    """Two ragged prompts in one call (rows finish in another order than they started): each row's samples follow
    plain sampling from its own padded prompt, whose prompt the processor looks up by the row's index. Calling
    the processor on groups of rows crashed or penalised another row's prompt (p = 2.7e-3 in the review)."""
    small_target, small_draft = small_pair
    prompts = [[1, 5, 2, 5], [1, 3]]
    ids, mask = left_padded(prompts)
    settings = dict(temperature=0.9, **ROW_INDEXED_SETTINGS[name])
    common = dict(
        attention_mask=mask, do_sample=True, num_return_sequences=ROWS, max_new_tokens=NUM_TOKENS, pad_token_id=PAD,
        **settings,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = small_target.generate(ids, **common)
    out = small_target.generate(
        ids, draft_model=small_draft, num_lookahead=2, generator=torch.Generator().manual_seed(22), **common
    )
    for index in range(len(prompts)):
        prompt, prompt_mask = ids[index : index + 1], mask[index : index + 1]
        processors, _ = prepared_processors(
            small_target, prompt, attention_mask=prompt_mask, do_sample=True, max_new_tokens=NUM_TOKENS, **settings
        )
        exact = exact_distribution(small_target, prompt, processors, NUM_TOKENS, attention_mask=prompt_mask)
        rows = slice(index * ROWS, (index + 1) * ROWS)
        assert chisquare_pvalue(exact, continuations(plain[rows], ids.shape[1])) > 1e-3  # the reference is plain's
        assert chisquare_pvalue(exact, continuations(out[rows], ids.shape[1])) > 1e-3


class PerRowVocabulary(LogitsProcessor):
    """A user processor constraining rows by their index (row i emits only ids congruent to i mod 3)."""

    def __call__(self, input_ids, scores):
        allowed = (torch.arange(scores.shape[1])[None, :] % 3) == torch.arange(scores.shape[0])[:, None] % 3
        return scores.masked_fill(~allowed, -float("inf"))


@pytest.mark.parametrize(
    "settings",
    [
        dict(encoder_repetition_penalty=0.3),
        dict(encoder_no_repeat_ngram_size=2),
        dict(logits_processor=LogitsProcessorList([PerRowVocabulary()])),
    ],
    ids=["encoder_repetition_penalty", "encoder_no_repeat_ngram_size", "user_per_row_processor"],
)
def test_greedy_with_row_indexed_processors_equals_plain(target, draft, settings):
    ids, mask = left_padded(PROMPTS)
    expected = greedy(target, ids, mask, max_new_tokens=20, **settings)
    for lookahead in (1, 3):
        got = greedy(target, ids, mask, max_new_tokens=20, draft_model=draft, num_lookahead=lookahead, **settings)
        assert torch.equal(got, expected)


def test_custom_criterion_with_eos_pads_stopped_rows_like_plain(target, draft):
    """With an EOS id, plain pads rows once any criterion stops them: so does the speculative batch."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    ids, mask = left_padded(PROMPTS)
    free = greedy(target, ids, mask, max_new_tokens=12)[:, ids.shape[1] :]
    stop_token = int(free[0, 3])

    class StopOn(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop_token

    kwargs = dict(max_new_tokens=12, eos_token_id=VOCAB - 1, stopping_criteria=StoppingCriteriaList([StopOn()]))
    plain = greedy(target, ids, mask, **kwargs)
    assert (plain[0, ids.shape[1] + 4 :] == PAD).all(), "row 0 stops on the criterion and is padded"
    assert greedy(target, ids, mask, draft_model=draft, num_lookahead=3, **kwargs).tolist() == plain.tolist()


def test_custom_criteria_see_the_whole_batch_in_the_callers_row_order(target, draft):
    """`generate()` calls stopping criteria with every row, finished ones padded, row `b` at index `b`: a criterion
    that stops one row by its index stops that row only, whichever rows share a prefix length or have finished."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    ids, mask = left_padded(PROMPTS)
    free = greedy(target, ids, mask, max_new_tokens=16)[:, ids.shape[1] :]
    # row 1 finishes early on an EOS id rows 0 and 2 never emit
    eos = next(int(t) for t in free[1, 2:] if int(t) not in free[0].tolist() + free[2].tolist())
    seen = []

    class StopRowTwo(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append((input_ids.shape[0], input_ids[1].clone()))
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            done[2] = input_ids.shape[1] >= ids.shape[1] + 9
            return done

    kwargs = dict(max_new_tokens=16, eos_token_id=eos, stopping_criteria=StoppingCriteriaList([StopRowTwo()]))
    plain = greedy(target, ids, mask, **kwargs)
    assert (plain[1, -3:] == PAD).all() and (plain[2, ids.shape[1] + 9 :] == PAD).all()
    assert plain[0, ids.shape[1] :].tolist() == free[0].tolist(), "row 0 runs to max_new_tokens"
    plain_seen, seen[:] = list(seen), []
    for lookahead in (2, 5):
        got = greedy(target, ids, mask, draft_model=draft, num_lookahead=lookahead, **kwargs)
        assert got.tolist() == plain.tolist()
        assert {rows for rows, _ in seen} == {3}
        # the finished row 1 is shown as plain shows it: its tokens, then padding
        late = [row for rows, row in seen if row.shape[0] == plain.shape[1]]
        assert late and all(row.tolist() == plain[1].tolist() for row in late)
        seen.clear()
    assert plain_seen


def test_custom_criteria_read_the_scores_so_far_as_plain_passes_them(target, draft):
    """With `output_scores=True` plain passes its processed scores so far (a tuple of `(batch, vocab)`); a criterion
    that reads them stops where plain's does, and one called without them gets None as from plain."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    ids, mask = left_padded(PROMPTS)
    free = greedy(target, ids, mask, max_new_tokens=12, return_dict_in_generate=True, output_scores=True)
    # a threshold between the rows' top scores at some step: rows stop at different steps
    tops = torch.stack(free.scores).max(-1).values  # (steps, batch)
    threshold = float(tops[3:].median())
    calls = []

    class Confident(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            calls.append(scores is None or (len(scores) == input_ids.shape[1] - ids.shape[1]))
            if scores is None:
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)
            return scores[-1].max(-1).values > threshold

    for scored in (True, False):
        kwargs = dict(
            max_new_tokens=12, eos_token_id=VOCAB - 1, stopping_criteria=StoppingCriteriaList([Confident()]),
            return_dict_in_generate=scored, output_scores=scored,
        )  # fmt: skip
        plain = greedy(target, ids, mask, **kwargs)
        got = greedy(target, ids, mask, draft_model=draft, num_lookahead=3, **kwargs)
        plain_ids, got_ids = (plain.sequences, got.sequences) if scored else (plain, got)
        assert got_ids.tolist() == plain_ids.tolist()
        if scored:
            assert (plain_ids[:, -1] == PAD).any(), "no row stopped on its scores: the test has no power"
            assert len(got.scores) == len(plain.scores)
    assert calls and all(calls)


def test_the_criteria_view_of_the_scores_reads_the_recorder_and_never_edits_it():
    """`OutputRecorder.scores_so_far` shows a row stopped earlier in the round blanked past its stop in copies; the
    recorder changes only when `keep` drops what the round's stops leave out, and then holds what was shown."""
    from transformers import GenerationConfig

    from hf_specsample.outputs import OutputRecorder

    config = GenerationConfig(return_dict_in_generate=True, output_scores=True, output_logits=True)
    recorder = OutputRecorder(config, batch_size=2)
    scores = torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(0))  # (rows, positions, vocab)
    recorder.record([0, 1], [3, 3], scores, scores * 2)
    before = [step.clone() for step in recorder.scores + recorder.logits]
    shown = recorder.scores_so_far(3, {0: 1})  # row 0 stopped after its first new token
    assert all(torch.equal(a, b) for a, b in zip(before, recorder.scores + recorder.logits)), "the view edited it"
    assert torch.equal(shown[0], recorder.scores[0]) and torch.isneginf(shown[1][0]).all()
    assert torch.isneginf(shown[2][0]).all() and torch.equal(shown[2][1], recorder.scores[2][1])
    recorder.keep([0, 1], [3, 3], [1, 3])
    assert all(torch.equal(a, b) for a, b in zip(shown, recorder.scores))
    assert torch.isneginf(recorder.logits[1][0]).all() and torch.equal(recorder.logits[1][1], before[4][1])


def test_stateful_and_cross_row_criteria_see_every_length_once_in_order(target, draft):
    """Plain decoding calls a batch's criteria once per length, in order, with every running row at that length: a
    criterion may keep state (count a token as it appears) or read other rows (stop all once any row says X). With
    such a user's criterion the batch commits in lockstep, so both stop where plain's do; a row stopped earlier in a
    round shows padded, and no scores a criterion was handed change after the call."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    ids, mask = left_padded(PROMPTS)
    width = ids.shape[1]
    free = greedy(target, ids, mask, max_new_tokens=24)[:, width:]

    class CountToken(StoppingCriteria):  # stops a row at the token's second appearance
        def __init__(self, token):
            self.token, self.count, self.calls = token, None, []

        def __call__(self, input_ids, scores, **kwargs):
            self.calls.append((input_ids.clone(), None if scores is None else scores[-1], None if scores is None
                               else scores[-1].clone()))  # fmt: skip
            if self.count is None:
                self.count = torch.zeros(input_ids.shape[0], dtype=torch.long)
            self.count += (input_ids[:, -1] == self.token).long()
            return self.count >= 2

    class AnyRowSaid(StoppingCriteria):  # stops every row once any row's newest token is the token
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids[:, -1] == self.token).any().expand(input_ids.shape[0])

    tokens = sorted(set(free.flatten().tolist()))[:8]
    differing = 0
    for token in tokens:
        for make in (CountToken, AnyRowSaid):
            for lookahead in (2, 4):
                runs = []
                for extra in ({}, dict(draft_model=draft, num_lookahead=lookahead)):
                    criterion = make(token)
                    out = greedy(
                        target, ids, mask, max_new_tokens=24, eos_token_id=VOCAB - 1, return_dict_in_generate=True,
                        output_scores=True, stopping_criteria=StoppingCriteriaList([criterion]), **extra,
                    )  # fmt: skip
                    runs.append((out.sequences, criterion))
                (plain, plain_criterion), (got, got_criterion) = runs
                assert got.tolist() == plain.tolist(), (make.__name__, token, lookahead)
                differing += not torch.equal(plain, greedy(target, ids, mask, max_new_tokens=24)[:, : plain.shape[1]])
                if make is CountToken:
                    # once per length, in order, every row at that length, as plain calls it (finished rows padded)
                    lengths = [[call[0].shape[1] for call in c.calls] for c in (got_criterion, plain_criterion)]
                    assert lengths[0] == lengths[1]
                    for (got_ids, kept, copy), (plain_ids, _, _) in zip(got_criterion.calls, plain_criterion.calls):
                        assert got_ids.tolist() == plain_ids.tolist()
                        assert torch.equal(kept, copy), "scores handed to a criterion changed after the call"
    assert differing, "no criterion stopped any row: the test has no power"
