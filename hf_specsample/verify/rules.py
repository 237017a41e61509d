"""The verification rules, as pure tensor functions: a sampled chain's modified rejection sampling (token and block
rules on the draft's distributions) and the walk of a tree with deterministic children (greedy, and sampled with the
round's draws); a greedy chain is the walk's special case.

No model code lives here: every function takes probabilities or token ids and returns tokens.

Glossary (one place, one naming):

- ``draft_probs`` -- the draft model's *processed* next-token distribution at each drafted position, the one the
  draft tokens were really sampled from (the paper's ``p`` in Leviathan et al., ``q`` in Chen et al.: we never use
  the single letters in code).
- ``target_probs`` -- the target model's processed next-token distribution at the same positions plus one.
- **accepted** token: a draft token kept by the test ``u < target_prob / draft_prob`` (probability
  ``min(1, target/draft)``). Only a leading run of accepted tokens counts; the first rejection ends the run.
- **recovered** token: the token sampled at the first rejected position from the residual
  ``normalise(max(0, target_probs - draft_probs))``.
- **bonus** token: sampled from the target's distribution after the last draft token when every draft token was
  accepted.
- **point mass**: a draft token proposed with certainty (a prompt-lookup continuation, an n-gram token forced into a
  model's proposal, a greedy draft). Its distribution is never materialised as a one-hot row: ``draft_probs=None``
  says every position is one, a `(batch, lookahead)` bool ``point_mass`` mask says which are among dense ones.
  Its draft probability is 1, so it is accepted with probability ``target_prob``, and the residual at a rejected
  point mass is ``max(0, target_probs - onehot(token))``: the target with that token zeroed.

Every round therefore commits ``num_accepted + 1`` tokens: the accepted ones and one recovered or bonus token.

A tree's words are `draft_tree`'s (root, node, depth, path). The tree rule (SGLang's
``tree_speculative_sampling_target_only`` with its thresholds at 1, EAGLE-2's ``evaluate_posterior``): start at the
root; draw a token from the target's processed distribution there; if it is one of the current node's children, accept
that child and descend into it; otherwise emit the drawn token and end the round. At a leaf every draw ends the round:
the drawn token is the bonus token. Every emitted token is then the target's own draw given its prefix, whatever the
tree (its children chosen without looking at the draws, siblings distinct). Greedy is the same walk with the target's
argmax as the draw.

Positions: the target scores N + 1 positions of a tree of N nodes, index 0 the root (the distribution of the first
new token) and index i + 1 node i (the distribution after node i's token, given its path).

The draws: one uniform per depth level per row, `(rows, max_depth + 1, 1)` float64 (`draws.sample_uniform`),
level d's draw made at the node where the walk stands after d accepted nodes, by `draws.sample_from_weights`
(inverse CDF). The walk runs over the levels on the device, vectorised over rows, with no host read.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..core.draft_tree import DraftTree
from ..sampling.draws import sample_from_weights, uniform_like


class Verdict(NamedTuple):
    """Outcome of one verification round for every row, whatever the draft's shape (a chain is the tree whose node
    k's parent is node k - 1: its accepted path is its first `num_accepted` tokens).

    Attributes:
        num_accepted: `(rows,)` long, the draft tokens accepted (a tree's accepted depth), in ``[0, lookahead]``;
            `NonFinite` codes where `flag_nonfinite` found a NaN/inf distribution a row drew from.
        next_tokens: `(rows,)` long, the target's draw where the walk ended: the recovered token (a rejection
            happened) or the bonus token (all accepted).
        path: a tree's `(rows, max_depth)` long accepted nodes from depth 1 down, -1 after the last; None for a
            chain (its first `num_accepted` nodes).
        accepted_tokens: `(rows, max_depth)` long, the drafted path's tokens: a tree's accepted path padded with the
            row's next token after the last accepted one, a chain's tokens (``cat([accepted_tokens,
            next_tokens[:, None]], 1)[:, : num_accepted + 1]`` are the round's committed tokens); None until the
            verifier sets a chain's (a rule returns none).
    """

    num_accepted: torch.Tensor
    next_tokens: torch.Tensor
    path: torch.Tensor | None = None
    accepted_tokens: torch.Tensor | None = None


def speculative_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
    point_mass: torch.Tensor | None = None,
    sample_draws: torch.Tensor | None = None,
) -> Verdict:
    """Accept or reject each row's draft tokens so that the committed tokens follow `target_probs` exactly.

    Algorithm 2 of Chen et al. (2023) / Algorithm 1 of Leviathan et al. (2022), batched over rows.

    Args:
        draft_tokens: `(batch, lookahead)` long, the tokens the draft sampled.
        draft_probs: `(batch, lookahead, vocab)` float, the distributions `draft_tokens` were sampled from; None:
            every draft token is a point mass.
        target_probs: `(batch, lookahead + 1, vocab)` float, the target's distribution at each drafted position and
            at the position after the last draft token.
        generator: optional generator for the acceptance draws and the recovered/bonus sample.
        uniform: optional `(batch, lookahead)` acceptance draws in [0, 1) (tests); drawn with `generator` if None.
        point_mass: optional `(batch, lookahead)` bool, True where the draft token is a point mass (its row of
            `draft_probs` is then ignored); None: none is, unless `draft_probs` is None.
        sample_draws: optional `(batch, 1)` float64 uniforms of the recovered/bonus sample (`sample_uniform`); drawn
            with `generator` after `uniform` if None. (`verify.verifier.Verifier` draws both for all rows
            at once, then applies the rule row chunk by row chunk.)

    Returns:
        A :class:`Verdict`. A zero draft probability rejects (never divides); an all-zero residual falls back to the
        target's distribution at that position.
    """
    batch, lookahead = draft_tokens.shape
    _check_draft(draft_tokens, draft_probs, point_mass)
    assert target_probs.shape[:2] == (batch, lookahead + 1), f"target_probs {tuple(target_probs.shape)}"
    if uniform is None:
        uniform = uniform_like((batch, lookahead), target_probs.device, generator)

    index = draft_tokens.unsqueeze(-1)
    draft_p = draft_token_probs(draft_tokens, draft_probs, point_mass)  # (batch, lookahead)
    target_p = target_probs[:, :lookahead].gather(-1, index).squeeze(-1)  # (batch, lookahead)
    # u < target_p / draft_p, written without the division; draft_p == 0 rejects.
    accepted = (draft_p > 0) & (uniform * draft_p < target_p)  # (batch, lookahead)
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # (batch,)

    rows = torch.arange(batch, device=target_probs.device)
    target_next = target_probs[rows, num_accepted]  # (batch, vocab)
    if lookahead == 0:
        return Verdict(num_accepted, sample_from_weights(target_next, generator, sample_draws))
    # The draft distribution at the first rejected position is subtracted; nothing for rows that accepted everything
    # (bonus token).
    rejected_somewhere = num_accepted < lookahead  # (batch,)
    at = num_accepted.clamp(max=lookahead - 1)  # (batch,)
    residual = residual_weights(
        target_next,
        draft_tokens[rows, at],
        None if draft_probs is None else draft_probs[rows, at],
        None if point_mass is None else point_mass[rows, at],
        rejected_somewhere,
    )  # (batch, vocab)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_next)
    return Verdict(num_accepted, sample_from_weights(residual, generator, sample_draws))


def block_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
    point_mass: torch.Tensor | None = None,
    sample_draws: torch.Tensor | None = None,
) -> Verdict:
    """Block verification (Sun et al. 2024, arXiv 2403.10444): the draft block is verified jointly.

    Same contract as `speculative_accept` (the committed tokens follow `target_probs` exactly), and never fewer
    accepted tokens in expectation. Per row, with ``ratio_i = target(X_i) / draft(X_i)`` at draft position i:

    - ``weight_0 = 1``, ``weight_i = min(1, weight_{i-1} * ratio_i)``: how much of the block up to i the target
      would still have produced;
    - ``residual_i(x) = max(0, weight_i * target_{i+1}(x) - draft_{i+1}(x))`` (0-based: the distributions at the
      position after i tokens), of mass ``mass_i``;
    - keep-probability ``h_i = mass_i / (mass_i + 1 - weight_i)`` for i < K, and ``h_K = weight_K``;
    - with ``u_i ~ U(0, 1)``, the number accepted is the *last* i in 1..K with ``u_i < h_i`` (0 if none), and the
      next token is drawn from ``residual_i`` (i < K) or from the target after the last draft token (i = K).

    Token verification's test differs only in stopping at the first failure and using ``weight_{i-1} = 1``.

    Args:
        draft_tokens: `(batch, lookahead)` long.
        draft_probs: `(batch, lookahead, vocab)` float, the distributions `draft_tokens` were sampled from; None:
            every draft token is a point mass.
        target_probs: `(batch, lookahead + 1, vocab)` float.
        generator: optional generator for the draws.
        uniform: optional `(batch, lookahead)` draws in [0, 1) (tests); drawn with `generator` if None.
        point_mass: optional `(batch, lookahead)` bool, True where the draft token is a point mass (see
            `speculative_accept`).
        sample_draws: optional `(batch, 1)` float64 uniforms of the next token's sample (see `speculative_accept`).

    Returns:
        A :class:`Verdict`. A zero draft probability gives weight 0 (never divides); an all-zero residual falls back
        to the target's distribution at that position (a case of probability zero).
    """
    batch, lookahead = draft_tokens.shape
    _check_draft(draft_tokens, draft_probs, point_mass)
    assert target_probs.shape[:2] == (batch, lookahead + 1), f"target_probs {tuple(target_probs.shape)}"
    rows = torch.arange(batch, device=target_probs.device)
    if lookahead == 0:
        return Verdict(rows * 0, sample_from_weights(target_probs[:, 0], generator, sample_draws))
    if uniform is None:
        uniform = uniform_like((batch, lookahead), target_probs.device, generator)

    index = draft_tokens.unsqueeze(-1)
    draft_p = draft_token_probs(draft_tokens, draft_probs, point_mass).double()  # (batch, K)
    target_p = target_probs[:, :lookahead].gather(-1, index).squeeze(-1).double()  # (batch, K)
    ratio = torch.where(draft_p > 0, target_p / draft_p.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    # weight_i = min(1, weight_{i-1} ratio_i) without a loop over positions: in logs, with S_i the running sum of
    # log ratio_j (S_0 = 0), log weight_i = S_i - max_{j <= i} S_j (induction: min(0, S_i - M_{i-1}) = S_i - M_i);
    # a ratio of 0 gives S = -inf from there on, so weight 0.
    running = torch.cat([ratio.new_zeros((batch, 1)), ratio.log().cumsum(dim=-1)], dim=1)  # (batch, K + 1)
    weight = (running - running.cummax(dim=-1).values).exp()  # (batch, K + 1): weight_0 .. weight_K
    # residual_i for i = 0 .. K-1: after i accepted tokens, against the draft's distribution at that position.
    scale = weight[:, :lookahead, None].to(target_probs.dtype)
    residual = residual_weights(scale * target_probs[:, :lookahead], draft_tokens, draft_probs, point_mass)
    mass = residual.sum(dim=-1).double()  # (batch, K)
    denominator = mass + 1 - weight[:, :lookahead]
    keep = torch.where(denominator > 0, mass / denominator.clamp_min(torch.finfo(torch.float64).tiny), 1.0)
    keep = torch.cat([keep[:, 1:], weight[:, lookahead:]], dim=1)  # h_1 .. h_K, (batch, K)
    passed = uniform.double() < keep  # (batch, K); `<`: probability h_i for u in [0, 1), never when h_i = 0
    positions = torch.arange(1, lookahead + 1, device=target_probs.device)
    num_accepted = (passed * positions).amax(dim=-1)  # (batch,) the last i that passed, 0 if none

    target_next = target_probs[rows, num_accepted]  # (batch, vocab)
    last = num_accepted.clamp(max=lookahead - 1)
    chosen = residual[rows, last]  # (batch, vocab)
    bonus = (num_accepted == lookahead).unsqueeze(-1)
    weights_next = torch.where(bonus | (chosen.sum(-1, keepdim=True) <= 0), target_next, chosen)
    return Verdict(num_accepted, sample_from_weights(weights_next, generator, sample_draws))


class NonFinite(enum.IntEnum):
    """Codes replacing `Verdict.num_accepted` for a row whose distributions hold NaN or inf (see `flag_nonfinite`)."""

    TARGET = -1
    DRAFT = -2


def raise_if_nonfinite(num_accepted: list[int]) -> None:
    """Raise where plain sampling raises: a distribution sampled from holds NaN or inf (`num_accepted` as read on the
    host, with its `NonFinite` codes; see `flag_nonfinite`)."""
    codes = {code for code in num_accepted if code < 0}
    if not codes:
        return
    if NonFinite.TARGET in codes:
        raise RuntimeError(
            "The target's processed next-token scores contain NaN or inf, so they are no distribution to sample "
            "from (plain generate() fails here too: 'probability tensor contains either inf, nan or element < 0'). "
            "Usual causes: float16 overflow (load the model in bfloat16 or float32), a broken checkpoint, or a logits "
            "processor that writes inf. `remove_invalid_values=True` replaces them, as in plain generate()."
        )
    raise RuntimeError(
        "The draft's processed next-token scores contain NaN or inf, so its proposals have no distribution to "
        "verify against. Usual causes: float16 overflow (load the draft in bfloat16 or float32) or a broken "
        "checkpoint; use another draft, or pass `remove_invalid_values=True`."
    )


def flag_nonfinite(
    verdict: Verdict,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    point_mass: torch.Tensor | None = None,
) -> Verdict:
    """Mark rows that sampled from a NaN/inf distribution, where plain sampling would have raised, without a sync.

    Only the distributions a row really used count: the target's at the root and at each accepted node (a chain's
    positions ``0 .. num_accepted``, a tree's along `Verdict.path`), and a chain's draft distributions before that.
    (A NaN target or draft probability never passes the acceptance test, so the first such position is always at or
    after ``num_accepted``.) A point mass is always finite. The codes travel with `num_accepted` to the round's one
    host synchronisation, where the caller raises.

    Args:
        verdict: the round's verdict.
        draft_probs: a chain's `(rows, lookahead, vocab)`, or None (every draft token a point mass, or a tree).
        target_probs: `(rows, positions, vocab)`: a chain's lookahead + 1 positions, a tree's N + 1.
        point_mass: optional `(rows, lookahead)` bool, True where the draft token is a point mass.

    Returns:
        The verdict with `num_accepted` replaced by `NonFinite.TARGET` / `NonFinite.DRAFT` in the rows concerned.
    """
    rows, positions = target_probs.shape[:2]
    # A row's sum is finite exactly when all of its entries are (probabilities: no sum overflows): one pass less.
    nonfinite = ~torch.isfinite(target_probs.sum(dim=-1))  # (rows, positions)
    if verdict.path is None:  # a chain: positions 0 .. num_accepted
        used = torch.arange(positions, device=target_probs.device) <= verdict.num_accepted[:, None]
    else:  # a tree: the root, then each accepted node i at position i + 1
        at = torch.cat([torch.zeros_like(verdict.path[:, :1]), verdict.path + 1], dim=1).clamp(max=positions - 1)
        used = torch.cat([torch.ones_like(verdict.path[:, :1], dtype=torch.bool), verdict.path >= 0], dim=1)
        nonfinite = nonfinite.gather(1, at)  # (rows, max_depth + 1)
    target_bad = (nonfinite & used).any(dim=-1)  # (rows,)
    codes = verdict.num_accepted
    if draft_probs is not None:
        lookahead = draft_probs.shape[1]
        draft_nonfinite = ~torch.isfinite(draft_probs.sum(dim=-1))  # (rows, K)
        if point_mass is not None:
            draft_nonfinite &= ~point_mass
        draft_bad = (draft_nonfinite & used[:, :lookahead]).any(dim=-1)  # (rows,)
        codes = torch.where(draft_bad, int(NonFinite.DRAFT), codes)
    codes = torch.where(target_bad, int(NonFinite.TARGET), codes)
    return verdict._replace(num_accepted=codes)


def draft_token_probs(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, point_mass: torch.Tensor | None
) -> torch.Tensor:
    """The draft's probability of each of its tokens: gathered from `draft_probs`, 1 at a point mass.

    Args:
        draft_tokens: `(..., lookahead)` long.
        draft_probs: `(..., lookahead, vocab)` float, or None (every token a point mass).
        point_mass: optional `(..., lookahead)` bool, True where the token is a point mass.

    Returns:
        `(..., lookahead)` float32 (or `draft_probs`' dtype).
    """
    if draft_probs is None:
        return torch.ones(draft_tokens.shape, dtype=torch.float32, device=draft_tokens.device)
    probs = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (..., lookahead)
    return probs if point_mass is None else torch.where(point_mass, 1.0, probs)


def residual_weights(
    weights: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    point_mass: torch.Tensor | None,
    subtract: torch.Tensor | None = None,
) -> torch.Tensor:
    """``max(0, weights - draft)`` where `subtract`, ``max(0, weights)`` elsewhere, without a one-hot tensor.

    A dense draft distribution is subtracted as it is; a point mass as 1 at its token (the target with that token
    zeroed, since no probability exceeds 1). Bit for bit what subtracting a dense one-hot row would give.

    Args:
        weights: `(..., vocab)` float, e.g. the target's distribution at the positions concerned.
        draft_tokens: `(...)` long, the draft token at each position.
        draft_probs: `(..., vocab)` float, the draft's distribution at each position, or None (all point masses).
        point_mass: optional `(...)` bool, True where the draft token is a point mass.
        subtract: optional `(...)` bool, False where nothing is subtracted (a row that accepted everything); None:
            everywhere.

    Returns:
        `(..., vocab)` non-negative float.
    """
    dense = None if point_mass is None else ~point_mass  # (...) where a dense row is subtracted; None: everywhere
    if subtract is not None:
        dense = subtract if dense is None else dense & subtract
    if draft_probs is not None:
        subtracted = draft_probs if dense is None else torch.where(dense.unsqueeze(-1), draft_probs, 0.0)
        weights = weights - subtracted  # (..., vocab)
    if draft_probs is None or point_mass is not None:
        point = torch.ones_like(draft_tokens, dtype=torch.bool) if draft_probs is None else point_mass  # (...)
        assert point is not None  # draft_probs given: this branch runs for a point_mass mask only
        if subtract is not None:
            point = point & subtract
        mass = point.to(weights.dtype).unsqueeze(-1)  # (..., 1): 1 where a point mass is subtracted
        weights = weights.scatter_add(-1, draft_tokens.unsqueeze(-1), -mass)  # (..., vocab)
    return weights.clamp_min(0.0)


def _check_draft(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, point_mass: torch.Tensor | None) -> None:
    """Assert the draft's shapes: `draft_probs` `(batch, K, vocab)` or None, `point_mass` `(batch, K)` or None."""
    if draft_probs is not None:
        assert draft_probs.shape[:2] == draft_tokens.shape, f"draft_probs {tuple(draft_probs.shape)}"
    if point_mass is not None:
        assert point_mass.shape == draft_tokens.shape, f"point_mass {tuple(point_mass.shape)}"
        assert point_mass.dtype == torch.bool, f"point_mass {point_mass.dtype}"


Draw = Callable[[int, torch.Tensor], torch.Tensor]  # (level, position index (rows,)) -> drawn token (rows,)


def walk(tree: DraftTree, draw: Draw, max_depth: int) -> Verdict:
    """The rule's walk down each row's tree, from a draw at each level (module docstring).

    Args:
        tree: the round's tree, tokens and parents `(rows, N)`, siblings distinct.
        draw: called once per level ``0 .. max_depth`` with the level and the `(rows,)` long position index where
            each row stands (0: the root, i + 1: node i; a row that has ended stands where it ended), returns the
            `(rows,)` long token drawn there (only the rows still walking use it).
        max_depth: the deepest node's depth (a node deeper is never reached).

    Returns:
        The `Verdict` with the accepted path and its tokens (`num_accepted` without `NonFinite` codes).
    """
    rows, nodes = tree.tokens.shape
    device = tree.tokens.device
    current = torch.full((rows,), -1, dtype=torch.long, device=device)  # node where each row stands, -1: the root
    walking = torch.ones((rows,), dtype=torch.bool, device=device)
    path = torch.full((rows, max_depth), -1, dtype=torch.long, device=device)
    next_tokens = torch.zeros((rows,), dtype=torch.long, device=device)
    for level in range(max_depth + 1):
        drawn = draw(level, current + 1)  # (rows,)
        if level < max_depth and nodes > 0:
            # the current node's child carrying the drawn token; siblings are distinct, so at most one
            match = (tree.parents == current[:, None]) & (tree.tokens == drawn[:, None])  # (rows, N)
            descend = match.any(dim=-1) & walking  # (rows,)
            child = match.long().argmax(dim=-1)  # (rows,) the first match (any index where none)
            path[:, level] = torch.where(descend, child, -1)
        else:  # a leaf's draw always ends the walk (the bonus token)
            descend = torch.zeros_like(walking)
            child = current
        next_tokens = torch.where(walking & ~descend, drawn, next_tokens)
        current = torch.where(descend, child, current)
        walking = descend
    num_accepted = (path >= 0).sum(dim=-1)  # (rows,)
    on_path = tree.tokens.gather(1, path.clamp(min=0)) if nodes > 0 else path * 0  # (rows, max_depth)
    accepted_tokens = torch.where(path >= 0, on_path, next_tokens[:, None])
    return Verdict(num_accepted, next_tokens, path, accepted_tokens)


def tree_accept(tree: DraftTree, target_probs: torch.Tensor, draws: torch.Tensor) -> Verdict:
    """Verify each row's tree so that the committed tokens follow `target_probs` exactly (module docstring).

    Args:
        tree: the round's tree, tokens and parents `(rows, N)`.
        target_probs: `(rows, N + 1, vocab)` the target's processed probabilities (index 0: the root, i + 1: node i).
        draws: `(rows, max_depth + 1, 1)` float64 uniforms in [0, 1) (`draws.sample_uniform`), one per level;
            their count sets the walk's depth, `max_depth`, which must reach the tree's deepest node.

    Returns:
        The `Verdict`; the caller flags NaN/inf distributions with `rules.flag_nonfinite`.
    """
    rows, nodes = tree.tokens.shape
    assert target_probs.shape[:2] == (rows, nodes + 1), f"target_probs {tuple(target_probs.shape)}, {nodes} nodes"
    assert draws.dim() == 3 and draws.shape[0] == rows and draws.shape[2] == 1, f"draws {tuple(draws.shape)}"
    index = torch.arange(rows, device=target_probs.device)

    def draw(level: int, position: torch.Tensor) -> torch.Tensor:
        return sample_from_weights(target_probs[index, position], uniform=draws[:, level])

    return walk(tree, draw, draws.shape[1] - 1)


def greedy_accept(tree: DraftTree, target_tokens: torch.Tensor, max_depth: int | None = None) -> Verdict:
    """Greedy verification: descend while the target's argmax is a child, then take the target's argmax, so the
    committed tokens are exactly the target's greedy continuation.

    Args:
        tree: the round's tree, tokens `(rows, N)`; a chain (`DraftTree.chain`) keeps its leading run of tokens equal
            to the target's argmax, the walk's result without the walk's loop over levels.
        target_tokens: `(rows, N + 1)` long, the target's argmax at each position (`draws.first_argmax`: ties go to
            the first id).
        max_depth: a tree's deepest node's depth (None: a chain's N).

    Returns:
        The `Verdict` (a tree's with its path and path tokens).
    """
    rows, nodes = tree.tokens.shape
    assert target_tokens.shape == (rows, nodes + 1), f"target_tokens {tuple(target_tokens.shape)}, {nodes} nodes"
    if tree.parents is None:
        matches = tree.tokens == target_tokens[:, :nodes]  # (rows, N)
        num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # (rows,)
        return Verdict(num_accepted, target_tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1))
    depth = nodes if max_depth is None else max_depth
    return walk(tree, lambda level, position: target_tokens.gather(1, position[:, None])[:, 0], depth)
