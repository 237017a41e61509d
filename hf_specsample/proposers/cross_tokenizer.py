"""Drafts with another tokenizer: the tokens both vocabularies share, and the draft's own token ids for every row.

A draft whose tokenizer differs from the target's (SmolLM2 drafting for Qwen2.5-Coder) can still be exact, by
token-level intersection (Timor et al. 2025, "Accelerating LLM Inference with Lossless Speculative Decoding
Algorithms for Heterogeneous Vocabularies"): the draft proposes only tokens that exist in both vocabularies, so every
proposal is a target id, and its distribution over target ids is known exactly.

- `shared_vocabulary` pairs the draft's logit columns with the target ids of the same content: `SharedVocabulary`.
  `DraftModelProposer` gathers those columns, places them at their target ids (-inf elsewhere, or on the subset when
  the processors are vocabulary-free), applies the caller's processors with the target-id prefix, and samples a
  target id. The verifier sees a draft distribution over target ids, as for a same-tokenizer draft.
- `DraftIdBuffer` keeps what the draft *reads*: each row's text in draft ids. The prompt is decoded with the target's
  tokenizer and encoded with the draft's; after each round the committed target tokens are appended in draft ids
  (a shared token by the map, any other by decoding and encoding it). This only steers what the draft proposes
  (its acceptance), never the output distribution.

Token content is compared as bytes: a byte-level BPE token (GPT-2 style, "Ġ" for a space) is mapped back to its
bytes, a sentencepiece token's "▁" becomes a space and "<0x0A>" the byte 0x0A, anything else (and every added or
special token) is its text in UTF-8. So "Ġhello" and "▁hello" are the same token, and "<|im_end|>" matches
"<|im_end|>".
"""

from __future__ import annotations

import enum
import functools
import json
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.sequences import Sequences

ABSENT = -1  # a lookup's value for an id the other vocabulary lacks
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece's raw-byte tokens
_METASPACE = "\u2581"  # "▁", sentencepiece's space


class TokenForm(enum.Enum):
    """How a tokenizer writes a token's bytes as its vocabulary string."""

    BYTE_LEVEL = "byte_level"  # GPT-2 byte-level BPE: every byte is one printable character ("Ġ" is a space)
    METASPACE = "metaspace"  # sentencepiece: "▁" is a space, "<0xNN>" a raw byte
    PLAIN = "plain"  # the string is the text


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> dict[int, int]:
    """`str.translate` table of GPT-2's byte-level alphabet, character -> the byte it stands for: printable bytes
    stand for themselves, the other 68 bytes for the characters 256, 257, ... in byte order (so a space, 0x20, is
    "Ġ", U+0120). A constant table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: byte for byte in printable}
    shifted = [byte for byte in range(256) if byte not in table]
    table.update({256 + index: byte for index, byte in enumerate(shifted)})
    return table


def token_form(tokenizer: Any) -> TokenForm:
    """The form of `tokenizer`'s vocabulary strings, read from its decoder (fast tokenizers); PLAIN when unknown."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return TokenForm.PLAIN
    state = json.loads(decoder.__getstate__())
    parts = state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]
    kinds = {part.get("type") for part in parts}
    if "ByteLevel" in kinds:
        return TokenForm.BYTE_LEVEL
    replaces_metaspace = any(
        part.get("type") == "Replace" and part.get("pattern", {}).get("String") == _METASPACE for part in parts
    )
    if "Metaspace" in kinds or replaces_metaspace:
        return TokenForm.METASPACE
    return TokenForm.PLAIN


def token_bytes(token: str, form: TokenForm) -> bytes:
    """The bytes a (non-added) vocabulary string stands for in a tokenizer of this form."""
    if form is TokenForm.BYTE_LEVEL:
        try:  # every character of the alphabet becomes one byte (a latin-1 character); any other one fails here
            return token.translate(_byte_level_table()).encode("latin-1")
        except UnicodeEncodeError:
            return token.encode()
    if form is TokenForm.METASPACE:
        raw = _BYTE_FALLBACK.match(token)
        if raw:
            return bytes([int(raw.group(1), 16)])
        return token.replace(_METASPACE, " ").encode()
    return token.encode()


def token_contents(tokenizer: Any, as_bytes: bool = True) -> dict[str | bytes, int]:
    """Content -> id over the tokenizer's whole vocabulary; where several ids have one content, the lowest id.

    Args:
        as_bytes: the bytes a token stands for (added and special tokens: their text, other tokens read as
            `token_form` says; empty contents left out). False: the strings as the tokenizer stores them, which two
            tokenizers of one `token_form` can compare directly (5x faster on a 152k vocabulary).
    """
    vocabulary = tokenizer.get_vocab()
    if not as_bytes:
        return vocabulary
    form = token_form(tokenizer)
    added = set(tokenizer.get_added_vocab()) if hasattr(tokenizer, "get_added_vocab") else set()
    contents: dict[str | bytes, int] = {}
    for token, token_id in sorted(vocabulary.items(), key=lambda item: item[1]):
        key = token.encode() if token in added else token_bytes(token, form)
        if key:
            contents.setdefault(key, token_id)
    return contents


@dataclass(frozen=True)
class SharedVocabulary:
    """The tokens two vocabularies share: pairs (draft column, target id) of the same content.

    The pairing is one-to-one (each draft column and each target id appears at most once), sorted by target id.

    Attributes:
        draft_columns: `(n,)` long, the draft's logit columns (= its token ids).
        target_ids: `(n,)` long, ascending: the target id of each column's token.
        draft_to_target: `(draft_width,)` long, the target id of each draft id, `ABSENT` (-1) where it has none.
        target_to_draft: `(target_width,)` long, the draft id of each target id, `ABSENT` (-1) where it has none.
    """

    draft_columns: torch.Tensor
    target_ids: torch.Tensor
    draft_to_target: torch.Tensor
    target_to_draft: torch.Tensor

    @property
    def size(self) -> int:
        """Number of shared tokens."""
        return int(self.target_ids.numel())

    @classmethod
    def from_pairs(
        cls, draft_columns: torch.Tensor, target_ids: torch.Tensor, draft_width: int, target_width: int
    ) -> SharedVocabulary:
        """Build the lookups from `(n,)` paired ids, sorted by target id (each id once, within the widths)."""
        assert bool((target_ids[1:] > target_ids[:-1]).all()), "pairs must be sorted by target id, each id once"
        draft_to_target = torch.full((draft_width,), ABSENT, dtype=torch.long).index_put_((draft_columns,), target_ids)
        target_to_draft = torch.full((target_width,), ABSENT, dtype=torch.long).index_put_((target_ids,), draft_columns)
        return cls(draft_columns, target_ids, draft_to_target, target_to_draft)

    def to(self, device: torch.device | str) -> SharedVocabulary:
        return SharedVocabulary(*(tensor.to(device) for tensor in vars(self).values()))


# target tokenizer -> draft tokenizer -> {(widths, vocabulary sizes, added tokens): SharedVocabulary}. Weak on both
# tokenizers: an entry goes with either of them. A chat calls generate() once per turn with the same pair.
_SHARED: "weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, dict[tuple, SharedVocabulary]]]" = (
    weakref.WeakKeyDictionary()
)


def shared_vocabulary(
    target_tokenizer: Any, draft_tokenizer: Any, target_width: int, draft_width: int
) -> SharedVocabulary:
    """Pair the tokens of equal content of two tokenizers, within the models' logit widths (cached per pair).

    Tokenizers of one `token_form` are compared by their vocabulary strings; otherwise by the bytes each token
    stands for (`token_contents`). Pairs are made one-to-one: where an id would pair twice, the pair with the
    lowest target id (then draft id) stays. Qwen2.5-Coder (151,936 ids) with SmolLM2 (49,152 ids), both byte-level,
    share 39,237 tokens; building the pairs takes about 0.25 s of CPU time, so the result is kept weakly per
    tokenizer pair, keyed by the logit widths and by what a tokenizer can change in place (its size and its added
    tokens, `tokenizer.add_tokens`): a changed tokenizer gets a new map, never a stale one.

    Args:
        target_width / draft_width: the models' logit widths; ids at or beyond them are left out.
    """
    try:
        entries = _SHARED.setdefault(target_tokenizer, weakref.WeakKeyDictionary()).setdefault(draft_tokenizer, {})
    except TypeError:  # a tokenizer that cannot be referenced weakly: built for this call only
        return _pair_vocabularies(target_tokenizer, draft_tokenizer, target_width, draft_width)
    key = (target_width, draft_width, _tokenizer_state(target_tokenizer), _tokenizer_state(draft_tokenizer))
    if key not in entries:
        entries.clear()  # one map per pair: the previous one described the tokenizers before a change
        entries[key] = _pair_vocabularies(target_tokenizer, draft_tokenizer, target_width, draft_width)
    return entries[key]


def _tokenizer_state(tokenizer: Any) -> tuple:
    """What of a tokenizer's vocabulary can change after loading: its size and its added tokens."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else len(tokenizer.get_vocab())
    return (size, tuple(sorted(added.items())))


def _pair_vocabularies(
    target_tokenizer: Any, draft_tokenizer: Any, target_width: int, draft_width: int
) -> SharedVocabulary:
    """`shared_vocabulary`, built."""
    as_bytes = token_form(target_tokenizer) is not token_form(draft_tokenizer)
    target = token_contents(target_tokenizer, as_bytes)
    draft = token_contents(draft_tokenizer, as_bytes)
    pairs = sorted((target[key], draft[key]) for key in target.keys() & draft.keys())
    seen_targets, seen_drafts, kept = set(), set(), []
    for token, column in pairs:
        if token < target_width and column < draft_width and token not in seen_targets and column not in seen_drafts:
            seen_targets.add(token)
            seen_drafts.add(column)
            kept.append((column, token))
    columns = torch.tensor([column for column, _ in kept], dtype=torch.long)
    ids = torch.tensor([token for _, token in kept], dtype=torch.long)
    return SharedVocabulary.from_pairs(columns, ids, draft_width, target_width)


class TextBridge:
    """Target ids -> the draft's ids, through text, for the tokens the vocabularies do not share.

    A per-call memo (it lives as long as its `DraftIdBuffer`): identical prompts and tokens are translated once.
    """

    def __init__(self, target_tokenizer: Any, draft_tokenizer: Any):
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self._form = token_form(target_tokenizer)
        self._added = set(target_tokenizer.get_added_vocab()) if hasattr(target_tokenizer, "get_added_vocab") else set()
        self._target_bos = _added_bos(target_tokenizer)
        self._draft_bos = _added_bos(draft_tokenizer)
        self._prompts: dict[tuple[int, ...], list[int]] = {}
        self._tokens: dict[tuple[int, ...], list[int]] = {}

    def prompt(self, target_ids: Sequence[int]) -> list[int]:
        """A row's prompt in draft ids: its text as the draft's tokenizer encodes it, never empty.

        A BOS the target's tokenizer adds by itself is dropped from the text and the draft's own added BOS (if its
        tokenizer adds one) put in front. Other special tokens (chat-template markers) stay in the text, so a draft
        with the same markers reads them as its own.
        """
        key = tuple(target_ids)
        if key not in self._prompts:
            ids = list(target_ids)
            if ids and self._target_bos is not None and ids[0] == self._target_bos:
                ids = ids[1:]
            text = self.target_tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            start = [self._draft_bos] if self._draft_bos is not None else []
            encoded = start + self.draft_tokenizer(text, add_special_tokens=False)["input_ids"]
            self._prompts[key] = encoded or [_start_token(self.draft_tokenizer)]
        return self._prompts[key]

    def tokens(self, target_ids: Sequence[int]) -> list[int]:
        """Consecutive committed target tokens in draft ids: their bytes as text, encoded by the draft's tokenizer.

        Bytes that are not whole UTF-8 characters (a character split across tokens of which only some are
        translated here) become U+FFFD: the draft reads a replacement character, which costs acceptance only.
        """
        key = tuple(target_ids)
        if key not in self._tokens:
            strings = self.target_tokenizer.convert_ids_to_tokens(list(target_ids))
            raw = b"".join(
                string.encode() if string in self._added else token_bytes(string, self._form) for string in strings
            )
            text = raw.decode("utf-8", errors="replace")
            self._tokens[key] = self.draft_tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._tokens[key]


def _added_bos(tokenizer: Any) -> int | None:
    """The BOS id the tokenizer puts in front of a text by itself, or None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if with_special[:1] == [bos] else None


def _start_token(tokenizer: Any) -> int:
    """A token to start an empty draft prompt with: BOS, else EOS (GPT-2 style models start with it), else 0."""
    for token in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if token is not None:
            return int(token)
    return 0


class DraftIdBuffer:
    """Each active row's text in the draft's own ids: what a draft with another tokenizer reads.

    Owns `sequences`, a second `Sequences` over draft ids (its prompt: each row's real target prompt re-encoded, left
    padded) over the target's row book, so that rows leave both buffers together (the loop tells the draft's cache,
    `DraftModelProposer.select_rows`).

    Per round: `write` puts the draft id of each drafted target token after the row's draft ids (the draft's next
    input); `sync`, once the round is committed, appends the committed target tokens in draft ids. The leading
    committed tokens that equal the drafted ones keep their draft ids (the cache's keys for them stay valid); the
    rest go through `target_to_draft`, or, where the draft lacks the token, through text (`TextBridge.tokens`).
    So a row's draft ids are a deterministic function of its committed target tokens and the round structure; the
    output distribution never depends on them (the verifier uses the distribution each proposal was drawn from).
    """

    def __init__(self, target: Sequences, shared: SharedVocabulary, bridge: TextBridge):
        """
        Args:
            target: the target's rows (their prompts must be committed, nothing generated yet).
            shared: the shared vocabulary, its lookups on `target.tokens`' device.
            bridge: translation through text for prompts and unshared tokens.
        """
        self.target, self.shared, self.bridge = target, shared, bridge
        is_real = target.is_real(target.prompt_length)  # (batch, prompt_length)
        prompt = target.tokens[:, : target.prompt_length].cpu()
        rows = [bridge.prompt(prompt[row][is_real[row]].tolist()) for row in range(target.num_active)]
        width = max(len(row) for row in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)  # left-padded with id 0 (masked out)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, tokens in enumerate(rows):
            ids[row, width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens) :] = 1
        room = target.capacity - target.prompt_length
        # Over the target's row book: rows leave both buffers, and the draft's cache, together.
        self.sequences = Sequences(ids.to(target.tokens.device), mask, capacity=width + 2 * room, rows=target.rows)
        self.synced = list(target.lengths)  # per row, the target length its draft ids stand for
        self.drafted = 0  # draft ids written after each row's draft ids this round
        target.rows.attach(self)

    def write(self, step: int, target_tokens: torch.Tensor) -> None:
        """Write the draft ids of `(rows,)` drafted target tokens at each row's draft length + `step`.

        A token the draft lacks (a forced n-gram token, or a greedy draft whose scores were all -inf) is fed as id 0:
        the draft's later proposals condition on another token, which costs acceptance only.
        """
        draft_ids = self.shared.target_to_draft[target_tokens].clamp_min(0)
        self.sequences.reserve(max(self.sequences.lengths) + step + 1)
        self.sequences.write(step, draft_ids)
        self.drafted = step + 1

    def sync(self) -> list[int]:
        """Append each row's newly committed target tokens in draft ids.

        Returns:
            Per row, how many leading positions of its draft ids are unchanged since the draft fed them this round
            (the committed ones before plus the accepted draft tokens): the draft's cache may keep no more.
        """
        target, draft, device = self.target, self.sequences, self.target.tokens.device
        counts = [length - start for length, start in zip(target.lengths, self.synced)]
        width = max(counts)
        offsets = torch.arange(width, device=device)
        columns = (torch.tensor(self.synced, device=device)[:, None] + offsets).clamp(max=target.capacity - 1)
        new = target.tokens.gather(1, columns)  # (rows, width) the committed target tokens, then anything
        valid = offsets < torch.tensor(counts, device=device)[:, None]  # (rows, width)
        mapped = torch.where(valid, self.shared.target_to_draft[new], ABSENT)  # (rows, width) -1: no draft id
        # The committed tokens that equal this round's drafted ones are in the draft buffer already, fed.
        drafted = min(self.drafted, width)
        starts = torch.tensor(draft.lengths, device=device)[:, None]  # (rows, 1)
        fed = draft.tokens.gather(1, starts + offsets[:drafted])  # (rows, drafted)
        same = (mapped[:, :drafted] == fed) & (mapped[:, :drafted] >= 0)
        common = same.long().cumprod(dim=1).sum(dim=1).tolist()  # per row, leading committed tokens as drafted
        unchanged = [length + kept for length, kept in zip(draft.lengths, common)]
        draft.reserve(max(draft.lengths) + width)
        if bool(((mapped >= 0) | ~valid).all()):  # the usual round: one draft id per committed token, one scatter
            draft.tokens.scatter_(1, starts + offsets, mapped.clamp_min(0))  # past each row's count: unused columns
            draft.advance(counts)
        else:
            rows = zip(new.tolist(), mapped.tolist(), counts)
            draft.extend([0] * draft.num_active, [self._translate(ids[:n], ours[:n]) for ids, ours, n in rows])
        self.synced = list(target.lengths)
        self.drafted = 0
        return unchanged

    def _translate(self, target_ids: list[int], draft_ids: list[int]) -> torch.Tensor:
        """`(m,)` draft ids of consecutive target tokens: shared ones by the map (`draft_ids`, -1 where the draft
        lacks the token), runs of the others through text."""
        out: list[int] = []
        run: list[int] = []
        for token, draft_id in zip(target_ids, draft_ids):
            if draft_id == ABSENT:
                run.append(token)
                continue
            if run:
                out += self.bridge.tokens(run)
                run = []
            out.append(draft_id)
        if run:
            out += self.bridge.tokens(run)
        return torch.tensor(out, dtype=torch.long)

    def select_rows(self, rows: Sequence[int]) -> None:
        """Row-book member: keep the `synced` lengths of `rows` (the draft buffer follows the book too)."""
        self.synced = [self.synced[row] for row in rows]
