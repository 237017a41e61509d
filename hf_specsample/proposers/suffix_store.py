"""Token text indexed for suffix matches: `TokenIndex` (flat arrays and hash chains) and `SuffixDraft`, the store of
earlier calls' outputs a user holds and passes as `draft_model=`.

A `TokenIndex` keeps documents of token ids in one flat int32 array, each followed by a separator (-1), and for each
n-gram size of `NGRAMS` a hash chain over the positions where an n-gram ends: ``head[bucket]`` is the latest position
whose n-gram hashed there, ``prev[position]`` the one before it (llama.cpp's lookup caches and zstd's match finder
keep the same chains). Positions are global counters: the oldest documents are evicted by raising `floor` (a chain
walk stops below it) and their storage freed by shifting `offset`, without touching any chain. Memory is about
``4 + 8 * len(NGRAMS)`` bytes a token, plus the heads; inserting a document is linear in its length (a stable sort
of its buckets per n-gram size).

`TokenIndex.matches` finds where the query's last tokens occurred before: it walks the chain of the longest n-gram
size that has a verified occurrence (at most `CHAIN_STEPS` positions, the latest first), and measures each
occurrence's match backwards (up to `MAX_MATCH` tokens). `TokenIndex.continuations` reads what followed them. The
drafter (`proposers.suffix`) turns those continuations into a tree by their counts.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

NGRAMS = (16, 8, 4, 2, 1)  # n-gram sizes with a chain, longest first: a long n-gram's occurrences are few and good
CHAIN_STEPS = 64  # the most occurrences read of one n-gram (the latest first): a common n-gram's chain is long
MAX_MATCH = 32  # the longest match measured (occurrences matching this many tokens are all equally good)
SEPARATOR = -1  # after every document, and in slots not yet written: no n-gram or continuation crosses it
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of h * golden ratio spread well
FORMAT_VERSION = 1  # of `SuffixDraft.save`'s file


class Matches(NamedTuple):
    """Earlier occurrences of a query's last tokens in one index.

    Attributes:
        positions: `(m,)` int64 global positions of each occurrence's last token, the latest first.
        lengths: `(m,)` int64, how many of the query's last tokens each matches (at most `MAX_MATCH`).
    """

    positions: np.ndarray
    lengths: np.ndarray


class TokenIndex:
    """Documents of token ids with hash chains over their n-grams (module docstring).

    Attributes:
        tokens: int32 storage; global position p is ``tokens[p - offset]``, `SEPARATOR` where nothing was written.
        offset: the global position of ``tokens[0]``.
        floor: the first global position still held (earlier ones are evicted: chains stop there).
        end: one past the last global position written so far.
    """

    def __init__(self, capacity: int = 1024, buckets: int = 1 << 16):
        """
        Args:
            capacity: storage to allocate first (it doubles as needed).
            buckets: hash buckets per n-gram size (a power of two; more: shorter chains, more memory).
        """
        assert buckets & (buckets - 1) == 0, "buckets must be a power of two"
        self.bits = buckets.bit_length() - 1
        self.tokens = np.full(capacity, SEPARATOR, dtype=np.int32)
        self.prev = {n: np.full(capacity, -1, dtype=np.int64) for n in NGRAMS}
        self.head = {n: np.full(buckets, -1, dtype=np.int64) for n in NGRAMS}
        self.offset = self.floor = self.end = 0

    @property
    def nbytes(self) -> int:
        """Bytes the index holds (storage, chains and heads)."""
        arrays: list[np.ndarray] = [self.tokens, *self.prev.values(), *self.head.values()]
        return sum(array.nbytes for array in arrays)

    def _reserve(self, end: int) -> None:
        """Make room for global positions up to `end` (exclusive)."""
        needed = end - self.offset
        if needed <= self.tokens.shape[0]:
            return
        size = max(needed, 2 * self.tokens.shape[0])
        self.tokens = _grown(self.tokens, size, SEPARATOR)
        self.prev = {n: _grown(chain, size, -1) for n, chain in self.prev.items()}

    def write(self, start: int, tokens: np.ndarray) -> None:
        """Write `tokens` `(m,)` at global positions ``start .. start + m - 1`` (not written before) and index every
        n-gram that ends there (an n-gram touching a separator or an evicted position is not indexed)."""
        count = int(tokens.shape[0])
        if count == 0:
            return
        self._reserve(start + count)
        self.tokens[start - self.offset : start - self.offset + count] = tokens
        self.end = max(self.end, start + count)
        positions = np.arange(start, start + count, dtype=np.int64)
        for n in NGRAMS:
            windows = self.read(positions[:, None] - np.arange(n)[None, :])  # (m, n), the n-gram ending at each
            valid = (windows >= 0).all(axis=1)
            if not valid.any():
                continue
            buckets = self._buckets(windows[valid])
            self._link(n, positions[valid], buckets)

    def _buckets(self, windows: np.ndarray) -> np.ndarray:
        """`(m,)` int64 bucket of each `(m, n)` n-gram (its last token first)."""
        hashed = np.zeros(windows.shape[0], dtype=np.uint64)
        with np.errstate(over="ignore"):
            for column in range(windows.shape[1]):
                hashed = (hashed + windows[:, column].astype(np.uint64) + np.uint64(1)) * _MULTIPLIER
        return (hashed >> np.uint64(64 - self.bits)).astype(np.int64)

    def _link(self, n: int, positions: np.ndarray, buckets: np.ndarray) -> None:
        """Put `positions` (ascending) at the head of their buckets' chains, in order."""
        order = np.argsort(buckets, kind="stable")
        sorted_buckets, sorted_positions = buckets[order], positions[order]
        first = np.ones(order.shape[0], dtype=bool)
        first[1:] = sorted_buckets[1:] != sorted_buckets[:-1]
        previous = np.empty_like(sorted_positions)
        previous[1:] = sorted_positions[:-1]
        previous[first] = self.head[n][sorted_buckets[first]]
        self.prev[n][sorted_positions - self.offset] = previous
        last = np.ones(order.shape[0], dtype=bool)
        last[:-1] = first[1:]
        self.head[n][sorted_buckets[last]] = sorted_positions[last]

    def read(self, positions: np.ndarray) -> np.ndarray:
        """The tokens at global `positions` (any shape), `SEPARATOR` outside what is held."""
        index = positions - self.offset
        held = (positions >= self.floor) & (index < self.tokens.shape[0]) & (index >= 0)
        return np.where(held, self.tokens[np.clip(index, 0, self.tokens.shape[0] - 1)], SEPARATOR)

    def matches(self, query: np.ndarray, exclude: int = -1) -> Matches:
        """Earlier occurrences of the last tokens of `query` `(q,)`: those of the longest n-gram size with one.

        Args:
            query: the text whose end is matched (its last `MAX_MATCH` tokens matter).
            exclude: a global position never returned (the query's own end, where the query is in this index).
        """
        empty = Matches(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        tail = query[-MAX_MATCH:][::-1].astype(np.int64)  # the query's last token first
        for n in NGRAMS:
            if tail.shape[0] < n:
                continue
            bucket = int(self._buckets(tail[None, :n])[0])
            found: list[int] = []
            position, chain = int(self.head[n][bucket]), self.prev[n]
            while position >= self.floor and len(found) < CHAIN_STEPS:
                if position != exclude:
                    found.append(position)
                position = int(chain[position - self.offset])
            if not found:
                continue
            positions = np.array(found, dtype=np.int64)
            back = self.read(positions[:, None] - np.arange(tail.shape[0])[None, :])  # (m, q)
            lengths = np.cumprod(back == tail[None, :], axis=1).sum(axis=1)
            kept = lengths >= n  # a bucket's other n-grams (hash collisions) match less
            if kept.any():
                return Matches(positions[kept], lengths[kept])
        return empty

    def continuations(self, positions: np.ndarray, depth: int) -> np.ndarray:
        """`(m, depth)` int64: the tokens after each of `positions`, `SEPARATOR` from the first separator on."""
        following = self.read(positions[:, None] + 1 + np.arange(depth)[None, :]).astype(np.int64)
        ended = np.cumsum(following < 0, axis=1) > 0
        return np.where(ended, SEPARATOR, following)

    def evict_before(self, floor: int) -> None:
        """Forget every global position below `floor`; free their storage once it outweighs what is held."""
        self.floor = max(self.floor, floor)
        dead = self.floor - self.offset
        if dead > self.end - self.floor:
            self.tokens = self.tokens[dead:].copy()
            self.prev = {n: chain[dead:].copy() for n, chain in self.prev.items()}
            self.offset = self.floor


def _grown(array: np.ndarray, size: int, fill: int) -> np.ndarray:
    """`array` extended to `size` entries with `fill`."""
    grown = np.full(size, fill, dtype=array.dtype)
    grown[: array.shape[0]] = array
    return grown


def _token_ids(document: Sequence[int] | np.ndarray) -> np.ndarray:
    """A document as `(length,)` int32 ids, or ValueError saying what it is instead."""
    tokens = np.asarray(document)
    if tokens.ndim != 1:
        raise ValueError(
            f"SuffixDraft.add takes a sequence of documents, each a 1-D sequence of token ids; got a document of "
            f"shape {tokens.shape} (a single document is added as add([ids]))."
        )
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"SuffixDraft.add: token ids must be integers, got {tokens.dtype}.")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**31):
        raise ValueError("SuffixDraft.add: token ids must be in [0, 2**31).")
    return tokens.astype(np.int32)


def vocabulary_fingerprint(tokenizer: Any) -> str:
    """A digest of a tokenizer's vocabulary (every token and its id): two tokenizers with the same one give the
    same ids to the same text."""
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocabulary).encode()).hexdigest()[:32]


@dataclass
class SuffixStats:
    """What a `SuffixDraft` did over its life (`SuffixDraft.stats`).

    Attributes:
        tokens: tokens held now; documents: outputs held now.
        added_tokens, evicted_tokens: tokens added and evicted since it was made (or loaded).
        lookups: rows' rounds that looked it up; matched: those that found an occurrence.
        accepted_tokens: draft tokens the target accepted that were drafted from its text.
    """

    tokens: int = 0
    documents: int = 0
    added_tokens: int = 0
    evicted_tokens: int = 0
    lookups: int = 0
    matched: int = 0
    accepted_tokens: int = 0


@dataclass(eq=False)  # a store is itself (identity), whatever it holds
class SuffixDraft:
    """Earlier outputs kept for drafting: pass it as ``draft_model=`` and every call drafts from what earlier calls
    wrote (and from its own rows' prompts and text), then adds its outputs.

    ``model.generate(**inputs, draft_model=store, do_sample=True)`` drafts each row's round as a tree of the
    continuations the store and the call's rows hold after the row's last tokens (`proposers.suffix`); exact as any
    draft (the tree's children are fixed before the target's draws). ``draft_model="suffix"`` makes an empty store
    for one call. A call that raises adds no document (its lookups still count in `stats`).

    Attributes:
        max_tokens: the most tokens held; adding past it evicts the oldest outputs whole.
        fingerprint: the vocabulary's digest (`vocabulary_fingerprint`), given a tokenizer; a store loaded from a file
            made with another vocabulary is refused.
        stats: what it holds and did (`SuffixStats`).
    """

    max_tokens: int = 1 << 20
    tokenizer: Any = None
    fingerprint: str | None = None
    stats: SuffixStats = field(default_factory=SuffixStats)

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, numbers.Integral)
            or self.max_tokens < 1
        ):
            raise ValueError(f"SuffixDraft(max_tokens=) must be a positive int, got {self.max_tokens!r}.")
        self.max_tokens = int(self.max_tokens)
        if self.tokenizer is not None:
            fingerprint = vocabulary_fingerprint(self.tokenizer)
            if self.fingerprint is not None and self.fingerprint != fingerprint:
                raise ValueError("SuffixDraft: the tokenizer given is not the one its fingerprint names.")
            self.fingerprint = fingerprint
        self.tokenizer = None  # only its fingerprint is kept
        buckets = 1 << max(10, min(22, (2 * self.max_tokens - 1).bit_length()))
        self.index: TokenIndex = TokenIndex(capacity=min(self.max_tokens, 1 << 16) + 1, buckets=buckets)
        self.starts: list[int] = []  # each held document's first global position, oldest first
        self.largest_id: int = -1  # the largest token id held (a call's target must have a logit for it)

    def add(self, outputs: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Hold `outputs` (a sequence of documents, each a 1-D sequence of token ids), evicting the oldest documents
        beyond `max_tokens`. A document longer than `max_tokens` keeps its last `max_tokens` tokens. All documents are
        checked before any is added.

        Raises:
            ValueError: a document that is not a 1-D sequence of integer ids in [0, 2**31).
        """
        documents = [_token_ids(document) for document in outputs]
        for tokens in documents:
            tokens = tokens[-self.max_tokens :]
            if tokens.size == 0:
                continue
            self.starts.append(self.index.end)
            self.index.write(self.index.end, tokens.astype(np.int32))
            self.index.end += 1  # the separator's slot
            self.largest_id = max(self.largest_id, int(tokens.max()))
            self.stats.added_tokens += int(tokens.size)
        self._evict()
        self.stats.tokens, self.stats.documents = self.held_tokens, len(self.starts)

    @property
    def held_tokens(self) -> int:
        """Tokens held (separators excluded)."""
        return self.index.end - self.index.floor - len(self.starts)

    def _evict(self) -> None:
        evicted = False
        while self.held_tokens > self.max_tokens and len(self.starts) > 1:
            removed = self.starts[1] - self.starts[0] - 1
            self.starts.pop(0)
            self.index.evict_before(self.starts[0])
            self.stats.evicted_tokens += removed
            evicted = True
        if evicted:  # the largest id still held
            held = self.index.read(np.arange(self.index.floor, self.index.end))
            self.largest_id = int(held.max()) if held.size else -1

    def documents(self) -> list[np.ndarray]:
        """The held documents, oldest first, each `(length,)` int32."""
        bounds = [*self.starts, self.index.end]
        return [self.index.read(np.arange(start, stop - 1)).astype(np.int32) for start, stop in zip(bounds, bounds[1:])]

    def check_vocabulary(self, logit_width: int, tokenizer: Any = None) -> None:
        """Refuse a call whose target cannot score every id held, or whose tokenizer is not the store's.

        Raises:
            ValueError: saying which, and what to do.
        """
        if self.largest_id >= logit_width:
            raise ValueError(
                f"The SuffixDraft holds token id {self.largest_id}, past the target's {logit_width} logits: it was "
                "filled with another tokenizer's ids. Use a store filled by this model's calls (or a new one)."
            )
        if tokenizer is not None and self.fingerprint is not None:
            if vocabulary_fingerprint(tokenizer) != self.fingerprint:
                raise ValueError(
                    "The SuffixDraft was filled with another tokenizer's ids (its vocabulary fingerprint differs "
                    "from the tokenizer= of this call). Use a store made for this tokenizer."
                )

    def save(self, path: str | Path) -> None:
        """Write the held documents, `max_tokens` and the fingerprint to `path` (a `.npz` file)."""
        documents = self.documents()
        lengths = np.array([document.shape[0] for document in documents], dtype=np.int64)
        tokens = np.concatenate(documents) if documents else np.zeros(0, dtype=np.int32)
        meta = json.dumps({"version": FORMAT_VERSION, "max_tokens": self.max_tokens, "fingerprint": self.fingerprint})
        with open(path, "wb") as file:
            np.savez(file, tokens=tokens, lengths=lengths, meta=np.array(meta))

    @classmethod
    def load(cls, path: str | Path, tokenizer: Any = None, max_tokens: int | None = None) -> SuffixDraft:
        """A store with the documents `save` wrote to `path`.

        Args:
            tokenizer: the tokenizer the calls will use: refused (ValueError) where the file was made with another
                vocabulary; a file saved without a fingerprint takes this tokenizer's.
            max_tokens: the new store's budget (default: the saved one).
        """
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            tokens, lengths = data["tokens"], data["lengths"]
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: a SuffixDraft file of format {meta.get('version')}; this version reads {FORMAT_VERSION}."
            )
        fingerprint = meta.get("fingerprint")
        if tokenizer is not None and fingerprint is not None and vocabulary_fingerprint(tokenizer) != fingerprint:
            raise ValueError(
                f"{path} was saved from a SuffixDraft filled with another tokenizer's ids (its vocabulary fingerprint "
                "differs): its drafts would be noise for this tokenizer. Load a file made with this tokenizer."
            )
        budget = max_tokens if max_tokens is not None else int(meta["max_tokens"])
        store = cls(max_tokens=budget, tokenizer=tokenizer, fingerprint=fingerprint)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        store.add([tokens[start:stop] for start, stop in zip(bounds, bounds[1:])])
        return store
