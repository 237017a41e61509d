"""Draft trees end to end (`SpeculativeConfig(draft_shape="tree")`): exactly the target's output.

- greedy: token for token plain `generate()`'s on every architecture the greedy matrix covers that trees serve, one
  row and a ragged left-padded batch, EOS inside an accepted path, and `scores` / `logits` as plain's;
- sampling: the exact distribution of 3-token continuations (every processor) against 10,000 samples, chi-square,
  and a wrong tree rule fails the same test (power);
- the choice: refusals before any forward where a tree cannot run, what "auto" drafted, the stats.
"""

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from test_architectures import PROMPTS as ARCH_PROMPTS
from test_architectures import batch
from tiny import ARCHITECTURES, PAD, arch_draft, prepared_processors, tiny_arch, tiny_lm

from hf_specsample import SpeculativeConfig, TreeShape
from hf_specsample.core.model_facts import ModelFacts
from hf_specsample.policy.validation import tree_problem
from hf_specsample.verify import rules

TREE = SpeculativeConfig(draft_shape="tree", draft_form="as_given")
SMALL = SpeculativeConfig(draft_shape=TreeShape.from_paths([(0, 0, 0), (1, 0), (2,), (0, 1)]), draft_form="as_given")
VOCAB = 48
NEW_TOKENS = 14


def greedy(model, ids, mask=None, **kwargs):
    return model.generate(
        ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, max_new_tokens=NEW_TOKENS, **kwargs
    )


@pytest.fixture(scope="module")
def target():
    """The sampling tests' 8-token target (its `drafts` and the `greedy_models` are `conftest.py`'s)."""
    return tiny_lm(seed=0)


def assert_greedy_identity_or_refused(name: str, shape: str, *configs: SpeculativeConfig) -> None:
    """On architecture `name` (`tiny_arch`) with a noisy copy as draft: plain greedy's tokens for each of `configs`
    (draft trees of one kind, `shape`), one row and a ragged left-padded batch, where trees serve the architecture;
    refused before any forward (the first config, the message naming `draft_shape='<shape>'`) where they do not."""
    target = tiny_arch(name, seed=0, vocab_size=VOCAB)
    draft = arch_draft(target, seed=1)
    problem = tree_problem(ModelFacts.of(target))
    if problem is not None:
        ids, mask = batch(ARCH_PROMPTS)
        with pytest.raises(ValueError, match=f"draft_shape='{shape}'.*chains there"):
            greedy(target, ids, mask, draft_model=draft, speculative_config=configs[0])
        return
    for config in configs:
        for rows in ([ARCH_PROMPTS[0]], ARCH_PROMPTS):
            ids, mask = batch(rows)
            expected = greedy(target, ids, mask)
            got = greedy(target, ids, mask, draft_model=draft, speculative_config=config)
            assert torch.equal(got, expected), (name, config.draft_shape, len(rows))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_identity_on_every_architecture(name):
    """Plain greedy's tokens on every architecture trees serve; refused before any forward on the others."""
    assert_greedy_identity_or_refused(name, "tree", TREE, SMALL)


def test_greedy_with_eos_inside_the_path_and_scores(greedy_models):
    target, drafts = greedy_models
    prompt = torch.tensor([[1, 17, 42, 5, 9]])
    free_run = greedy(target, prompt)[0, prompt.shape[1] :].tolist()
    eos = free_run[6]
    kwargs = dict(eos_token_id=eos, return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = greedy(target, prompt, **kwargs)
    assert expected.sequences.shape[1] < prompt.shape[1] + NEW_TOKENS, "EOS must end generation early"
    for draft in (drafts["close"], target):
        got = greedy(target, prompt, draft_model=draft, speculative_config=TREE, **kwargs)
        assert torch.equal(got.sequences, expected.sequences)
        for name in ("scores", "logits"):
            assert len(getattr(got, name)) == len(getattr(expected, name))
            for mine, plain in zip(getattr(got, name), getattr(expected, name)):
                torch.testing.assert_close(mine, plain, atol=1e-4, rtol=1e-4)
        stats = got.speculative_stats
        assert stats.shape == TreeShape.default().describe() == "a tree of 15 nodes, depth 8, up to 2 choices a node"
        assert stats.tokens_per_target_pass > 1.0


def test_a_tree_keeps_more_tokens_per_pass_than_a_chain(greedy_models):
    """With the draft's top choices as siblings, a tree of the chain's depth accepts at least as deep a path from
    any prefix, and greedy rounds advance monotonically in the prefix: never fewer tokens per target pass."""
    target, drafts = greedy_models
    prompt = torch.tensor([[1, 17, 42, 5, 9]])
    kwargs = dict(return_dict_in_generate=True, max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    shape = TreeShape.from_paths([(0, 0, 0, 0), (1, 0, 0), (2, 0), (0, 1, 0), (0, 0, 1)])
    tree_config = SpeculativeConfig(draft_shape=shape, draft_form="as_given")
    chain_config = SpeculativeConfig(draft_shape="chain", draft_form="as_given", num_lookahead=4)
    tree = target.generate(prompt, draft_model=drafts["far"], speculative_config=tree_config, **kwargs)
    chain = target.generate(prompt, draft_model=drafts["far"], speculative_config=chain_config, **kwargs)
    assert torch.equal(tree.sequences, chain.sequences)
    assert tree.speculative_stats.tokens_per_target_pass >= chain.speculative_stats.tokens_per_target_pass


# --- sampling: the exact distribution -------------------------------------------------------------------------------

PROMPT = torch.tensor([[1, 5, 2, 5]])
NUM_TOKENS = 3
SAMPLES = 10_000
EOS = 4
ALPHA = 1e-3
SETTINGS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.8),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "no_repeat_ngram": dict(no_repeat_ngram_size=2, temperature=1.3),
    "all_with_eos": dict(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3, eos_token_id=EOS),
}


def exact_for(target, eos_token_ids=(), **settings):
    processors, _ = prepared_processors(target, PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, **settings)
    return exact_distribution(target, PROMPT, processors, NUM_TOKENS, eos_token_ids)


def sample(target, draft, seed, config, **settings):
    sequences = target.generate(
        PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, pad_token_id=PAD, num_return_sequences=SAMPLES,
        draft_model=draft, speculative_config=config, generator=torch.Generator().manual_seed(seed), **settings,
    )  # fmt: skip
    eos = (settings["eos_token_id"],) if "eos_token_id" in settings else ()
    return continuations(sequences, PROMPT.shape[1], eos), eos


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("draft_kind", ["close", "far"])
def test_tree_samples_follow_target(target, drafts, setting, draft_kind):
    settings = SETTINGS[setting]
    samples, eos = sample(target, drafts[draft_kind], 21, TREE, **settings)
    assert chisquare_pvalue(exact_for(target, eos, **settings), samples) > ALPHA


def test_a_wrong_tree_rule_fails_the_same_test(target, drafts, monkeypatch):
    """Power: a rule that, where the target's draw at the root matched no child, emits the draft's second choice
    instead of that draw (a plausible bug: trusting the tree's siblings) must fail the same test."""
    right = rules.tree_accept

    def second_choice_on_rejection(tree, target_probs, draws):
        verdict = right(tree, target_probs, draws)
        rejected = verdict.num_accepted == 0
        next_tokens = torch.where(rejected, tree.tokens[:, 1], verdict.next_tokens)  # node 1: the root's rank 1
        accepted_tokens = verdict.accepted_tokens.clone()
        accepted_tokens[rejected] = next_tokens[rejected, None]  # padded with the next token (`Verdict`)
        return verdict._replace(next_tokens=next_tokens, accepted_tokens=accepted_tokens)

    monkeypatch.setattr("hf_specsample.verify.verifier.tree_accept", second_choice_on_rejection)
    samples, _ = sample(target, drafts["far"], 21, TREE, temperature=0.7)
    assert chisquare_pvalue(exact_for(target, temperature=0.7), samples) < ALPHA


# --- the choice -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["tree", "dynamic"])
def test_trees_are_refused_where_they_cannot_run(target, drafts, shape):
    prompt = torch.tensor([[1, 5, 2, 5]])
    asks = [dict(draft_model=drafts["close"], speculative_config=SpeculativeConfig(draft_shape=shape, compile=True))]
    policy = SpeculativeConfig(draft_shape=shape, lookahead_policy=lambda: None)  # a chain's K, each round
    asks.append(dict(draft_model=drafts["close"], speculative_config=policy))
    for ask in asks:
        ask.setdefault("speculative_config", SpeculativeConfig(draft_shape=shape))
        with pytest.raises(ValueError, match=f"draft_shape='{shape}'.*draft_shape='chain'"):
            target.generate(prompt, max_new_tokens=4, pad_token_id=PAD, **ask)
    with pytest.raises(ValueError, match="drafts trees of its own"):  # prompt lookup shapes its own trees
        target.generate(prompt, max_new_tokens=4, pad_token_id=PAD, draft_model="prompt_lookup",
                        speculative_config=SpeculativeConfig(draft_shape=shape))  # fmt: skip


def test_auto_says_what_it_drafted(target, drafts):
    """Greedy: chains or trees round by round, counted in `shape` (`test_auto_shape.py`); sampling: chains, and why."""
    kwargs = dict(max_new_tokens=6, pad_token_id=PAD, draft_model=drafts["close"], return_dict_in_generate=True)
    greedy_stats = target.generate(PROMPT, do_sample=False, **kwargs).speculative_stats
    assert greedy_stats.shape.startswith("auto: a ")
    sampled = target.generate(PROMPT, do_sample=True, **kwargs).speculative_stats
    assert sampled.shape.startswith("chain (draft_shape='auto' samples with chains")


def test_rows_in_chunks_verify_as_one_chunk(target, drafts, monkeypatch):
    """Many rows: verified row chunk by row chunk, their logits made from the hidden states when read
    (`cache.output_head`): the tokens are those of one chunk, greedy and seeded sampling alike."""
    from hf_specsample.cache.output_head import HeadLogits
    from hf_specsample.sampling import draws

    prompt = PROMPT.expand(12, -1)
    kwargs = dict(max_new_tokens=6, pad_token_id=PAD, draft_model=drafts["far"], speculative_config=TREE)
    sampled = dict(do_sample=True, temperature=1.2, top_p=0.9)
    whole = [
        target.generate(prompt, do_sample=False, **kwargs),
        target.generate(prompt, generator=torch.Generator().manual_seed(3), **sampled, **kwargs),
    ]
    made = []
    read = HeadLogits.__getitem__
    monkeypatch.setattr(HeadLogits, "__getitem__", lambda self, rows: made.append(rows) or read(self, rows))
    nodes = TreeShape.default().truncated(5).num_nodes  # the room of 6 new tokens
    monkeypatch.setattr(draws, "ROW_CHUNK_ELEMENTS", 5 * (nodes + 1) * target.config.vocab_size + 1)
    chunked = [
        target.generate(prompt, do_sample=False, **kwargs),
        target.generate(prompt, generator=torch.Generator().manual_seed(3), **sampled, **kwargs),
    ]
    assert made and any(rows.stop - rows.start < 12 for rows in made)  # chunks of at most 5 rows, made when read
    for one, several in zip(whole, chunked):
        assert torch.equal(one, several)


def test_windows_a_model_builds_into_its_own_mask_are_refused():
    """GPT-Neo's local layers window the mask while its cache keeps every slot: the tree's mask would drop the window
    (greedy tokens then part from plain's), so trees are refused there; its global-only form serves them."""
    import transformers as tf

    def neo(kinds):
        config = tf.GPTNeoConfig(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                                 attention_types=[[kinds, 2 // len(kinds)]], max_position_embeddings=256,
                                 bos_token_id=1, eos_token_id=None, pad_token_id=PAD)  # fmt: skip
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(config).eval()

    prompt = torch.tensor([[1, 5, 9, 13, 7]])
    local = neo(["global", "local"])
    with pytest.raises(ValueError, match="local layers.*draft_shape='chain'"):
        greedy(local, prompt, draft_model=local, speculative_config=TREE)
    full = neo(["global"])
    expected = greedy(full, prompt)
    assert torch.equal(greedy(full, prompt, draft_model=full, speculative_config=TREE), expected)


def test_max_lookahead_cuts_a_tree(target, drafts):
    config = SpeculativeConfig(draft_shape="tree", max_lookahead=2, draft_form="as_given")
    out = target.generate(PROMPT, max_new_tokens=6, pad_token_id=PAD, draft_model=drafts["close"],
                          speculative_config=config, return_dict_in_generate=True)  # fmt: skip
    assert out.speculative_stats.shape == TreeShape.default().truncated(2).describe()
    assert max(out.speculative_stats.nodes_per_round) == TreeShape.default().truncated(2).num_nodes
