"""The call's options, and every enum a user passes: values only, the bottom layer (imports nothing of the library's).

- `SpeculativeConfig`: the options of `speculative_config=`, validated on construction.
- `NamedDraft`: the drafts `draft_model=` accepts by name (`"auto"`, `"prompt_lookup"`, `"suffix"`).
- `DraftForm`: the form a draft model runs in (`draft_form=`, `prepare_draft(form=)`).
- `Verification`: how a draft block is verified (`verification=`).
- `DraftShape`: whether a round drafts one chain or a tree of candidates (`draft_shape=`); `TreeShape`, an explicit
  tree (its nodes' parents and ranks; the words of trees are in `draft_tree`); `DynamicTree`, a tree each row grows
  per round from the draft's probabilities (EAGLE-2).

All enums are `str` enums: the plain strings compare equal, and an invalid one is refused with the choices.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, TypeVar

import torch

DEFAULT_MAX_LOOKAHEAD = 8  # adaptive K never exceeds this; larger K rarely pays on CPU


EnumT = TypeVar("EnumT", bound=enum.Enum)


def parse_choice(kind: type[EnumT], value: object, name: str) -> EnumT:
    """`kind(value)`, or a ValueError naming the option and its choices."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(dict.fromkeys(repr(member.value) for member in kind))
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.") from None


class NamedDraft(str, enum.Enum):
    """`draft_model="auto"` / `"prompt_lookup"` / `"suffix"` (a `str` enum: the plain strings compare equal)."""

    AUTO = "auto"  # a draft made from the target: an int8 copy on the CPU, a layer-skipping view elsewhere
    PROMPT_LOOKUP = "prompt_lookup"  # n-gram continuations from the prompt and the text so far; no model runs
    SUFFIX = "suffix"  # trees of what followed the rows' last tokens in the call's text (a one-call `SuffixDraft`)

    def __str__(self) -> str:
        return self.value


class DraftForm(str, enum.Enum):
    """The form a draft model runs in (`SpeculativeConfig(draft_form=)`, `prepare_draft(form=)`)."""

    AUTO = "auto"  # a float draft on the CPU: whichever form below steps fastest here (timed); otherwise as given
    AS_GIVEN = "as_given"  # the draft as given (a CPU bf16 draft's linears run on the small-rows kernel where it pays)
    DYNAMIC_INT8 = "dynamic_int8"  # torch's dynamic int8 (fbgemm), activations quantized per step too (CPU only)
    INT8_WEIGHTS = "int8_weights"  # int8 weights (a scale per row), bf16 activations, on the small-rows kernel (CPU)
    # int4 weights (a scale per 128 inputs; the LM head int8) on the small-rows kernel, CPUs with AVX-512 VNNI/BF16;
    # drafts worse: AUTO weighs its measured acceptance against its step time, given calibration text
    INT4_WEIGHTS = "int4_weights"

    def __str__(self) -> str:
        return self.value


class Verification(str, enum.Enum):
    """How a row's draft block is verified; both are exact."""

    TOKEN = "token"  # token by token, stopping at the first rejection (`verify.rules.speculative_accept`)
    BLOCK = "block"  # jointly (`verify.rules.block_accept`): never fewer accepted tokens in expectation

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TreeShape:
    """A static tree: node i's parent (-1: the root) and its rank among the parent's children.

    Attributes:
        parents: per node, the parent node's index (-1: the root), in level order (a parent before its children).
        ranks: per node, which of the draft's choices at the parent it takes (0: the most likely); distinct among
            siblings.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.ranks) or not self.parents:
            raise ValueError("a tree shape needs one parent and one rank per node, and at least one node")
        seen: set[tuple[int, int]] = set()
        for node, (parent, rank) in enumerate(zip(self.parents, self.ranks)):
            if not -1 <= parent < node:
                raise ValueError(f"node {node}'s parent {parent} must be -1 (the root) or an earlier node")
            if rank < 0 or (parent, rank) in seen:
                raise ValueError(f"node {node}: rank {rank} under parent {parent} is negative or taken twice")
            seen.add((parent, rank))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> TreeShape:
        """The shape holding each path of ranks from the root (`(0, 1)`: the first choice's second choice), and
        every prefix of one; nodes sorted by depth, then by path."""
        paths = [tuple(path) for path in paths]  # lists of ranks too
        nodes = sorted({path[:depth] for path in paths for depth in range(1, len(path) + 1)}, key=lambda p: (len(p), p))
        index = {path: node for node, path in enumerate(nodes)}
        return cls(tuple(index[path[:-1]] if len(path) > 1 else -1 for path in nodes), tuple(p[-1] for p in nodes))

    @classmethod
    def chain(cls, lookahead: int) -> TreeShape:
        """`lookahead` tokens in one chain: the draft's first choice at each depth."""
        return cls(tuple(range(-1, lookahead - 1)), (0,) * lookahead)

    @classmethod
    def default(cls) -> TreeShape:
        """15 nodes (16 positions with the root, what the CPU kernel serves in one pass): the draft's first choices
        to depth 8, and its second choice beside each of them but the last."""
        spine = (0,) * 8
        return cls.from_paths([spine] + [spine[:depth] + (1,) for depth in range(7)])

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def max_rank(self) -> int:
        """The most choices any node takes at its parent, less one (top-(max_rank + 1) is drafted)."""
        return max(self.ranks)

    @property
    def is_chain(self) -> bool:
        return self == TreeShape.chain(self.num_nodes)

    def truncated(self, depth: int) -> TreeShape:
        """The nodes at depth <= `depth` (>= 1), renumbered in the same order."""
        kept = [node for node, node_depth in enumerate(self.depths) if node_depth <= depth]
        if len(kept) == self.num_nodes:
            return self
        index = {node: new for new, node in enumerate(kept)}
        return TreeShape(tuple(index.get(self.parents[node], -1) for node in kept), tuple(self.ranks[n] for n in kept))

    def describe(self) -> str:
        """In words, for `SpeculativeStats.shape`."""
        if self.is_chain:
            return f"a chain of {self.num_nodes}"
        return f"a tree of {self.num_nodes} nodes, depth {self.max_depth}, up to {self.max_rank + 1} choices a node"

    def levels(self) -> list[list[int]]:
        """The nodes at each depth, depth 1 first."""
        depths = self.depths
        return [[node for node, depth in enumerate(depths) if depth == level] for level in range(1, self.max_depth + 1)]


@dataclass(frozen=True)
class DynamicTree:
    """A tree each row grows per round from its draft's probabilities (EAGLE-2, arXiv 2406.16858).

    A node's value is its cumulative draft log-probability: the sum, along its path, of the log-softmax of the
    draft's processed scores at each parent. Level 1 is the draft's top-`expand` tokens at the root; each later level
    is one draft forward over the `expand` best nodes of the level before (the frontier), each expanded into its
    top-`expand` children. After `depth` levels (as many draft forwards as a chain of K = `depth`) the best `nodes`
    of everything drafted are kept and verified. Which nodes are kept reads the draft only, so the tree rule stays
    exact.

    Attributes:
        nodes: the nodes verified (15: 16 target positions with the root, what the CPU kernel serves in one pass).
        depth: the levels drafted (8, as the static default's; `num_lookahead`, else `max_lookahead`, cuts it).
        expand: the frontier's width, and the children drafted at each frontier node (4: EAGLE-2's top-k on
            chat models with ~60 nodes; fewer nodes are better served by a narrow frontier).
    """

    nodes: int = 15
    depth: int = 8
    expand: int = 4

    def __post_init__(self) -> None:
        for name in ("nodes", "depth", "expand"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicTree's {name} must be a positive int, got {value!r}.")

    @property
    def drafted(self) -> int:
        """The nodes drafted per row: `expand` at the root, `expand` ** 2 at each later level."""
        return self.expand + (self.depth - 1) * self.expand**2

    @property
    def num_nodes(self) -> int:
        """The nodes kept (no more than were drafted)."""
        return min(self.nodes, self.drafted)

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_rank(self) -> int:
        """The most choices a node takes at its parent, less one (as `TreeShape.max_rank`)."""
        return self.expand - 1

    def truncated(self, depth: int) -> DynamicTree:
        """At most `depth` (>= 1) levels."""
        return self if depth >= self.depth else replace(self, depth=depth)

    def describe(self) -> str:
        """In words, for `SpeculativeStats.shape`."""
        return f"dynamic tree: {self.num_nodes} nodes, depth {self.depth}, expand {self.expand}"


class DraftShape(str, enum.Enum):
    """What a round drafts (`SpeculativeConfig(draft_shape=)`); a `TreeShape` names an explicit tree."""

    # greedy: a chain or a tree each round, from measured acceptance and costs (`shapes`); sampling: chains
    AUTO = "auto"
    CHAIN = "chain"  # K tokens in one chain, each the draft's sample (or choice); K chosen per round
    TREE = "tree"  # `TreeShape.default()`: 15 candidates, the draft's top choices; refused where trees cannot run
    DYNAMIC = "dynamic"  # `DynamicTree()`: 15 candidates each row chooses per round; refused where trees cannot run

    def __str__(self) -> str:
        return self.value


def _check_lookahead(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (draft tokens per round), got {value!r}.")
    if value < 1:
        raise ValueError(
            f"{name} must be >= 1 (draft tokens proposed per round), got {value}. To generate without drafting, "
            "call generate() without `draft_model=`; to let hf_specsample choose K each round, leave it unset."
        )


class LinearKernel(str, enum.Enum):
    """Whether forwards of a few positions on a CPU bf16 model use hf_specsample's small-rows linear kernel
    (`kernels/small_rows.py`: each weight loaded once for every row, so K+1 positions cost about one step)."""

    AUTO = "auto"  # where it builds and a timing on the model's own weight shows it faster than eager F.linear
    ON = "on"  # always for CPU bf16 models; refused before any work where it cannot run
    OFF = "off"  # never: eager PyTorch, and draft_form="auto" leaves out the kernel's forms (nothing builds it)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Options of speculative sampling; `SpeculativeConfig()` is the recommended default.

    Attributes:
        num_lookahead: draft tokens per round (K). None (default): chosen before every round by Leviathan et al.'s
            Theorem 3.8 from the acceptance rate and round costs measured while generating, between 0 (plain
            decoding, when drafting does not pay) and `max_lookahead`.
        max_lookahead: upper bound of the adaptive K.
        lookahead_policy: advanced: a factory of `LookaheadPolicy` objects (one per generate() call) replacing the
            built-in choice of K; exactness holds for any policy that decides K before drafting.
        draft_form: "auto" (default: for a float draft that runs on the CPU, the form with the best expected
            speedup here, timed at first use: as given, a dynamic-int8 copy and, for a bf16 draft under a
            `linear_kernel` other than "off", an int8-weights copy on the small-rows kernel and, with a prompt of 16
            tokens or more to measure acceptance on, an int4-weights copy (a float32 or float16 draft builds no
            kernel for them); kept while the draft model lives and its weights do not change. A clock-free call
            (`generator=`, a tensor-parallel target) chooses from the weights alone: `int8_weights` where it is
            weighed and the kernel builds, else `dynamic_int8`, else as given), "as_given", "dynamic_int8",
            "int8_weights" or "int4_weights" (`DraftForm`). See `prepare_draft`; with a `PreparedDraft` as
            `draft_model=`, set it there instead.
        draft_vocabulary: FR-Spec: the token ids the draft may propose, e.g. `hf_specsample.frequent_tokens(
            tokenizer, 32000)`; an int N means the N lowest ids (BPE merge order) plus the EOS, padding and BOS ids.
            None (default): the whole vocabulary. With a `PreparedDraft`, set it in `prepare_draft` instead.
        fast_processors: apply top-p and typical sampling without sorting the vocabulary
            (`sampling/fast_processors.py`): the kept tokens are exactly transformers' (rows the first candidates
            cannot settle go to transformers' own warper), at a quarter of the cost or less per position on a 152k
            vocabulary. True (default); False runs every processor as given.
        verification: "block" (default: Sun et al. 2024's block verification, which never accepts fewer draft
            tokens in expectation) or "token" (token by token, Leviathan et al. / Chen et al.). Both are exact;
            greedy decoding verifies by argmax either way.
        compile: compile the target's verification forward, on a static cache, with the settings that make a
            forward over K+1 positions cheap (`cache.compiled.CompileSettings.for_device`: on CPU frozen weights and
            inductor's C++ GEMM with a dynamic query length, two compilations of minutes for a 1.5B model, kept
            while the model lives and reused from inductor's disk cache by later processes; on CUDA, CUDA graphs).
            On CPU, the linears of round sizes (at most 16 kernel rows) are the small-rows kernel's instead, inside the
            compiled forward, under `linear_kernel="on"` and under "auto" where the kernel's plan serves every
            round size of the call's batch ("off": inductor's GEMM); no frozen copy of the weights, and inductor
            fuses the rest (norms, rotary, attention's reshapes, residuals), rounding its intermediates as eager
            bf16 does (`emulate_precision_casts`): code editing with prompt lookup on a 2-core Xeon ran at
            1.19-1.28x transformers' `prompt_lookup_num_tokens=` against 1.09-1.13x eagerly on the kernel (58-81 s
            compiling a 1.5B target). False (default): eager, or what `cache_implementation="static"` with
            `compile_config=` asks for, as plain `generate()` does it. Output stays exact either way (compiled
            logits differ by rounding only).
        compile_draft: run the draft's single-token steps as one compiled forward (`torch.compile`, inductor, on
            the draft's dynamic cache; `cache.compiled.CompileSettings.for_draft_steps`). A quantized draft's step
            streams a few hundred MB and then spends about a third of its time in hundreds of small eager operators
            (norms, rotary, attention's reshapes): compiled, they fuse (Qwen2.5-0.5B int8 weights on a 2-core Xeon:
            35.2 -> 27.1 ms a step). The first call compiles, before its first round (44-78 s on 2 cores for a 0.5B
            draft; `SpeculativeStats.draft_compile_seconds`); later calls with the same prepared draft reuse it.
            False (default): eager. What is sampled does not change (compiled logits differ by rounding, which moves
            only how often proposals are accepted). Refused, before any forward, for drafts that cannot compile
            (hybrid models; offloaded, tensor-parallel or non-compileable quantized drafts). torch's dynamic int8
            form drafts eagerly (its linears break compiled graphs), and `SpeculativeStats.draft_form` says so.
        linear_kernel: "auto" (default), "on" or "off": eager forwards of at most 16 positions (times rows) of a CPU
            model with bf16 weights run their linear layers on hf_specsample's small-rows kernel
            (`kernels/small_rows.py`), which reads each weight once for all rows. "auto" builds it where a call
            first runs it (about 15 s with a C++ compiler, once per machine, torch and Python: cached on disk;
            `SpeculativeStats.kernel_build_seconds`), times it against eager `F.linear` on the model's own
            largest weight (once per model) and uses it where it is faster; `SpeculativeStats.linear_kernel` says
            what was decided. Logits differ from eager ones by rounding only; a row's logits never depend on the
            other rows. Compiled forwards (`compile=True`) use it inside the compiled graph under "on", and under
            "auto" where its plan serves every round size of the call's batch (else inductor's GEMM). "off" builds
            no kernel (a draft_form named "int8_weights" or "int4_weights" still runs on it).
        draft_shape: "auto" (default: in greedy calls, a chain or the best tree each round, from the acceptance by
            the draft's rank and the costs by width measured in the call; chains when sampling or where trees cannot
            run, `SpeculativeStats.shape` says why), "chain", "tree", "dynamic", a `TreeShape` or a `DynamicTree`:
            whether a round drafts
            one chain of K tokens or a tree of candidates (a node's children are the draft's top distinct choices
            at it; `TreeShape.default()` for "tree": 15 nodes, a first-choice spine of depth 8 and the second
            choice beside each spine node but the last) verified in one target forward over every node. Exact either
            way: at each node the target draws its token and the round descends while the draw is one of the node's
            children. `num_lookahead` (else `max_lookahead`) cuts a tree at that depth. "dynamic"
            (`DynamicTree()`) grows each row's tree per round: the 15 nodes of highest cumulative draft probability
            among those drafted by expanding the 4 best nodes of each level, 8 levels deep (EAGLE-2).
            A tree is refused, before any forward, where it cannot run (recurrent or convolution layers, attention
            without a 4D mask, static caches and `compile=True`, lookup drafts and drafts with another tokenizer);
            `SpeculativeStats.shape` says which ran.
        stateful_processors: logits processor classes whose instances keep a state across calls (a counter, a
            matcher advanced by the last token): each is replayed as plain decoding calls it, from a copy of its
            state after the prefix one token shorter (`sampling.stateful.ReplayedProcessor`): exact, one row per
            call, at the cost of a copy per processed position. () (default): every processor not known to keep
            state is taken to be a function of its prefix (docs/structured_output.md).
    """

    num_lookahead: int | None = None
    max_lookahead: int = DEFAULT_MAX_LOOKAHEAD
    lookahead_policy: Callable[[], Any] | None = None  # makes a `lookahead.LookaheadPolicy`
    draft_form: DraftForm | str = DraftForm.AUTO
    draft_vocabulary: torch.Tensor | int | None = None
    fast_processors: bool = True
    verification: Verification | str = Verification.BLOCK
    compile: bool = False
    compile_draft: bool = False
    linear_kernel: LinearKernel | str = LinearKernel.AUTO
    draft_shape: DraftShape | str | TreeShape | DynamicTree = DraftShape.AUTO
    stateful_processors: tuple[type, ...] = ()

    def __post_init__(self) -> None:
        _check_lookahead("num_lookahead", self.num_lookahead)
        _check_lookahead("max_lookahead", self.max_lookahead)
        object.__setattr__(self, "draft_form", parse_choice(DraftForm, self.draft_form, "draft_form"))
        object.__setattr__(self, "verification", parse_choice(Verification, self.verification, "verification"))
        object.__setattr__(self, "linear_kernel", parse_choice(LinearKernel, self.linear_kernel, "linear_kernel"))
        if not isinstance(self.draft_shape, (TreeShape, DynamicTree)):
            if not isinstance(self.draft_shape, str):
                raise TypeError(
                    "draft_shape must be 'auto', 'chain', 'tree', 'dynamic', a TreeShape (e.g. TreeShape.from_paths("
                    "paths of ranks)) or a DynamicTree (e.g. DynamicTree(nodes=15, expand=4)), "
                    f"got {self.draft_shape!r}."
                )
            object.__setattr__(self, "draft_shape", parse_choice(DraftShape, self.draft_shape, "draft_shape"))
        stateful = self.stateful_processors
        if not isinstance(stateful, (tuple, list)) or not all(isinstance(kind, type) for kind in stateful):
            raise TypeError(
                "stateful_processors must be a tuple of logits processor classes (e.g. (MyProcessor,)), got "
                f"{stateful!r}."
            )
        object.__setattr__(self, "stateful_processors", tuple(stateful))
        for name in ("fast_processors", "compile", "compile_draft"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        vocabulary = self.draft_vocabulary
        if isinstance(vocabulary, bool) or not (vocabulary is None or isinstance(vocabulary, (int, torch.Tensor))):
            raise TypeError(f"draft_vocabulary must be None, an int or a tensor of token ids, got {vocabulary!r}.")
        if isinstance(vocabulary, int) and vocabulary < 1:
            raise ValueError(f"draft_vocabulary must be a positive number of tokens, got {vocabulary}.")
        if isinstance(vocabulary, torch.Tensor) and (
            vocabulary.is_floating_point() or vocabulary.is_complex() or vocabulary.dtype is torch.bool
        ):
            raise TypeError(f"draft_vocabulary's token ids must be integers, got a {vocabulary.dtype} tensor.")

    @classmethod
    def resolve(cls, config: "SpeculativeConfig | None", num_lookahead: int | None) -> "SpeculativeConfig":
        """Merge the `speculative_config=` object with the `num_lookahead=` shortcut (the shortcut wins)."""
        if config is not None and not isinstance(config, SpeculativeConfig):
            raise TypeError(f"speculative_config must be a SpeculativeConfig, got {type(config).__name__}.")
        config = config if config is not None else cls()
        return replace(config, num_lookahead=num_lookahead) if num_lookahead is not None else config
