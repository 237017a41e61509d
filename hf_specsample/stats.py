"""Acceptance statistics returned to the user (what `assistant_model=` does not report)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class SpeculativeStats:
    """Counters of one speculative `generate()` call, per row of the batch and in total.

    Per-row lists are indexed like the output rows (after `num_return_sequences` expansion).
    """

    rounds: int = 0  # draft-then-verify rounds
    target_forward_passes: int = 0  # target forward calls, the prefill included
    # Of those, forwards that re-fed kept positions to restore a hybrid target's recurrent states after a rejection
    # (`cache.checkpoints`); 0 for attention-only and convolution-only targets.
    target_refeed_passes: int = 0
    draft_forward_passes: int = 0  # draft forward calls
    # Per round, its lookahead K: the draft tokens a row could accept (a chain's length, a tree's depth).
    lookahead_per_round: list[int] = field(default_factory=list)
    # Per round, the draft tokens each row was offered: a chain's K, a tree's nodes.
    nodes_per_round: list[int] = field(default_factory=list)
    # Per round, the mean over its rows of the draft tokens accepted (a tree's accepted depth).
    accepted_depth_per_round: list[float] = field(default_factory=list)
    row_draft_tokens: list[int] = field(default_factory=list)  # draft tokens proposed to each row
    row_accepted_tokens: list[int] = field(default_factory=list)  # of those, accepted by the target
    row_rejections: list[int] = field(default_factory=list)  # rounds that ended with a rejected draft token
    row_new_tokens: list[int] = field(default_factory=list)  # tokens committed to each row (after stopping)
    row_target_passes: list[int] = field(default_factory=list)  # target forwards each row took part in
    draft_form: str = ""  # what drafted: "as_given", "int8_weights", ... with AUTO's step timings; or "prompt_lookup"
    # A draft with another tokenizer: the number of tokens both vocabularies share (all it can propose); else None.
    shared_vocabulary: int | None = None
    # A compiled target forward (`SpeculativeConfig(compile=True)` or `compile_config=`): seconds spent compiling in
    # this call (0.0 when compiled code was reused from an earlier call); None when the target ran eagerly.
    compile_seconds: float | None = None
    # The draft's single-token steps compiled (`SpeculativeConfig(compile_draft=True)`): seconds spent compiling them
    # in this call (0.0 when compiled code was reused from an earlier call); None when they ran eagerly.
    draft_compile_seconds: float | None = None
    # What ran the eager forwards' linear layers (`SpeculativeConfig.linear_kernel`): per model, the small-rows
    # kernel's plan and why (its timing against eager F.linear, or why it is off); "" before a call.
    linear_kernel: str = ""
    # Seconds this call spent making the small-rows kernel ready: compiling it (15-20 s on 2 cores, once per machine,
    # torch and Python: `kernels.build`) or loading a build an earlier process made (a fraction of a second). Only the
    # first call in a process whose plan runs the kernel (a CPU bf16 model, an int8 / int4 weights draft) pays it;
    # 0.0 for every other call, and for every call whose plan runs none (float32 or float16 models and their default
    # draft forms, linear_kernel="off" with a draft form other than int8 / int4 weights).
    kernel_build_seconds: float = 0.0
    # Whether the rounds' forwards ran as graphs (compiled runners, CUDA graphs) or eagerly, and why in plain words
    # (`graph_choice.choose_graphs`: the device, then whether compile=True asks for them).
    graphs: str = ""
    # What a round drafted (`SpeculativeConfig.draft_shape`): "chain", or the tree's size and depth; and why a tree
    # asked for or considered did not run; under "auto" in a greedy call, how many rounds drafted trees and chains.
    shape: str = ""
    # Per round, "tree" or "chain" (`options.DraftShape`'s words): what it drafted (its size: `nodes_per_round`).
    shape_per_round: list[str] = field(default_factory=list)
    # A draft with a learned position table (GPT-2's `n_positions`) shorter than the text: the longest row's length
    # (prompt included) when the table ended the draft's rounds, after which the target finished alone; else None.
    draft_positions_ended: int | None = None
    # The logits processors' host seconds in this call, at the draft's positions and the target's, and the positions
    # they processed (rows x positions: plain decoding processes one per row and new token); 0 without processors.
    processing_seconds: float = 0.0
    processed_positions: int = 0
    # Accepted draft tokens that a grammar forced (the only token it allowed there, in every row: proposed without a
    # draft forward, `ChainGrowth.take_forced`), also counted in the accepted tokens; 0 without a grammar processor.
    grammar_forced_tokens: int = 0
    # Host seconds a grammar processor's own work took (matchers moved along prefixes, masks made and applied, forced
    # tokens found), within `processing_seconds`; what plain decoding's processor takes is its calls' time.
    grammar_seconds: float = 0.0
    # A suffix drafter's accepted draft tokens by where its round's occurrences came from ("call": the rows' own
    # prompts and text; "store": earlier calls' outputs, a `SuffixDraft`); empty for other drafters.
    suffix_accepted_tokens: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_batch(cls, batch_size: int) -> "SpeculativeStats":
        zeros = [0] * batch_size
        return cls(
            row_draft_tokens=list(zeros),
            row_accepted_tokens=list(zeros),
            row_rejections=list(zeros),
            row_new_tokens=list(zeros),
            row_target_passes=list(zeros),
        )

    def record_round(
        self,
        callers: Sequence[int],
        lookahead: int,
        num_accepted: Sequence[int],
        counts: Sequence[int],
        nodes: int | None = None,
        tree: bool = False,
        forced_levels: Sequence[int] = (),
    ) -> None:
        """Count one round.

        Args:
            callers: per row active in the round, its caller row (`RowBook.callers`).
            lookahead: the most draft tokens a row could accept (a chain's K, a tree's depth): fewer is a rejection.
            num_accepted: per active row, draft tokens accepted.
            counts: per active row, tokens committed (after stopping).
            nodes: draft tokens proposed to every row (a tree's nodes; None: a chain's `lookahead`).
            tree: the round drafted a tree (else a chain).
            forced_levels: a chain's levels a grammar forced (`Proposal.forced_levels`).
        """
        nodes = lookahead if nodes is None else nodes
        self.rounds += 1
        self.lookahead_per_round.append(lookahead)
        self.nodes_per_round.append(nodes)
        self.shape_per_round.append("tree" if tree else "chain")
        self.accepted_depth_per_round.append(sum(num_accepted) / len(num_accepted) if num_accepted else 0.0)
        self.grammar_forced_tokens += sum(level < accepted for accepted in num_accepted for level in forced_levels)
        for row, accepted, count in zip(callers, num_accepted, counts, strict=True):
            self.row_draft_tokens[row] += nodes
            self.row_accepted_tokens[row] += accepted
            self.row_rejections[row] += int(accepted < lookahead)
            self.row_new_tokens[row] += count
            self.row_target_passes[row] += 1

    def describe_auto_shapes(self) -> str:
        """`draft_shape="auto"`'s rounds in words: how many drafted trees and chains, and their most frequent size,
        e.g. "auto: a tree in 40 of 52 rounds (most often 11 nodes), a chain in 12 (most often K = 6)"."""
        parts: list[str] = []
        for shape, size in (("tree", "{} nodes"), ("chain", "K = {}")):
            sizes = [n for kind, n in zip(self.shape_per_round, self.nodes_per_round) if kind == shape]
            if sizes:
                common = max(sorted(set(sizes)), key=sizes.count)
                of = f" of {self.rounds} rounds" if not parts else ""
                parts.append(f"a {shape} in {len(sizes)}{of} (most often {size.format(common)})")
        return "auto: " + ", ".join(parts) if parts else "auto: no round"

    @property
    def draft_tokens(self) -> int:
        """Draft tokens proposed, all rows."""
        return sum(self.row_draft_tokens)

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens accepted, all rows."""
        return sum(self.row_accepted_tokens)

    @property
    def new_tokens(self) -> int:
        """Tokens generated, all rows."""
        return sum(self.row_new_tokens)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of proposed draft tokens that were accepted (0.0 when nothing was proposed)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def alpha(self) -> float:
        """Leviathan et al.'s alpha: the probability that a draft token which gets tested is accepted.

        Estimated as accepted / (accepted + rejections): draft tokens after a rejection are never tested, so
        `acceptance_rate` (accepted / proposed) is lower than alpha whenever K > 1.
        """
        tested = self.accepted_tokens + sum(self.row_rejections)
        return self.accepted_tokens / tested if tested else 0.0

    @property
    def mean_lookahead(self) -> float:
        """Mean lookahead K per round (a tree's depth; its nodes are `nodes_per_round`)."""
        return sum(self.lookahead_per_round) / len(self.lookahead_per_round) if self.lookahead_per_round else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        """Mean tokens a row gains per target forward pass it takes part in (1.0 for plain decoding)."""
        passes = sum(self.row_target_passes)
        return self.new_tokens / passes if passes else 0.0

    @property
    def processing_seconds_per_position(self) -> float:
        """The logits processors' seconds per position processed (0.0 where none was), what the policy weighs
        drafting against (`round_costs.ProcessingCost`)."""
        return self.processing_seconds / self.processed_positions if self.processed_positions else 0.0

    def to_dict(self) -> dict:
        """Plain dict of every counter and the derived rates (for JSON)."""
        out = asdict(self)
        out.update(
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            new_tokens=self.new_tokens,
            acceptance_rate=self.acceptance_rate,
            alpha=self.alpha,
            mean_lookahead=self.mean_lookahead,
            tokens_per_target_pass=self.tokens_per_target_pass,
            processing_seconds_per_position=self.processing_seconds_per_position,
        )
        return out

    def __str__(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.target_forward_passes} target passes "
            f"({self.tokens_per_target_pass:.2f} per {'row and ' if len(self.row_target_passes) > 1 else ''}pass), "
            f"acceptance {self.acceptance_rate:.1%} "
            f"of {self.draft_tokens} draft tokens, {self.draft_forward_passes} draft passes"
            + (f", draft {self.draft_form}" if self.draft_form else "")
            + (f", {self.shape}" if self.shape else "")
            + (f", another tokenizer sharing {self.shared_vocabulary} tokens" if self.shared_vocabulary else "")
            + (f", {self.kernel_build_seconds:.1f} s readying the kernel" if self.kernel_build_seconds else "")
            + (
                f", the draft's position table ended its drafting at {self.draft_positions_ended} tokens"
                if self.draft_positions_ended is not None
                else ""
            )
            + (
                f", compiled target ({self.compile_seconds:.1f} s compiling)"
                if self.compile_seconds is not None
                else ""
            )
            + (
                f", compiled draft steps ({self.draft_compile_seconds:.1f} s compiling)"
                if self.draft_compile_seconds is not None
                else ""
            )
            + (
                f", logits processors {1e3 * self.processing_seconds_per_position:.2f} ms per position "
                f"({self.processed_positions} positions)"
                if self.processed_positions
                else ""
            )
        )
