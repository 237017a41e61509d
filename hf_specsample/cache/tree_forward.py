"""A draft tree in a `CachedModel`'s cache: its nodes fed in one forward with a tree mask, then compacted.

A tree's nodes (`draft_tree.DraftTree`) are fed after each row's committed tokens, one slot per node, in the order
they are fed. Node ``i`` attends to its row's real committed slots (the root's included), to its ancestors' slots
and to its own, and sits at position ``root + depth``: the keys, values and logits of a sequential forward along its
path, whatever its siblings. Transformers takes such a mask as a 4D tensor used as given
(`transformers_api.additive_attention_mask`), by eager and sdpa attention only.

While the tree is in the cache, its node slots count as fed positions of the `CachedModel` (`fed`, `slot_is_real`):
each row holds its committed positions, then the node slots, in its last `fed` slots, as the module invariant of
`cache.cached_model` wants. After verification, `CachedTree.compact` moves the accepted path's entries into the slots
right after the root and rolls the rest back (`CachedModel.keep_path`, which the model holding a tree waits for): the
cache then holds what a sequential feed of the committed tokens would, and the loop's usual `rollback_to_committed`
follows.

What trees cannot serve yet (`validation.tree_problem` says it in words, for the plan to choose chains there):
convolution and recurrent states (a state cannot branch), positions read off a 2D mask (ALiBi), sliding-window layers (a
forward sees only a layer's last ``window - 1 + width`` slots, which, once nodes sit after the root, miss the start of
its window, and models take their masks per layer type in ways of their own), attention without a 4D mask (flash
attention, flex attention), forwards that take no position ids, compiled forwards and runners (their inputs have fixed
shapes). A static cache (full `StaticLayer`s) run eagerly serves trees: the mask covers all its slots, and the
compaction moves entries in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.draft_tree import DraftTree
from ..core.sequences import Columns, Sequences
from ..options import TreeShape
from . import row_ops
from .cached_model import CachedModel


class CachedTree:
    """A round's tree in one model's cache: which nodes it holds in which slots, until `compact`.

    Attributes:
        model: the `CachedModel`.
        tree: the round's tree (the drafter fills `tree.tokens` level by level; a node is read when it is fed).
        first_slot: the cache slot of the first node slot (the slot after every row's root).
        committed: per row, the buffer positions fed before the nodes (its committed length: the root included).
        node_slots: per node, its slot after `first_slot` (-1: not fed), the same in every row.
    """

    def __init__(
        self,
        model: CachedModel,
        tree: DraftTree,
        committed: Sequence[int],
        root_positions: torch.Tensor,
        first_slot: int,
        shape: TreeShape | None = None,
        grows: bool = False,
    ):
        """
        Args:
            committed: per row, its committed length (the buffer positions fed before the nodes, root included).
            root_positions: `(rows,)` long on the CPU, each row's root's position id.
            first_slot: where the first node goes: the cache's slot count once the root is fed.
            shape: the static shape of `tree`, if it has one: its parents and depths are then read on the host
                (None: read off `tree`, a device read where it lives on an accelerator).
            grows: `tree`'s parents are chosen while it is drafted (a dynamic tree): they are set node by node with
                `set_parents` before a node is fed (its depths are read now).
        """
        assert model.states is None, "tree forwards need an attention cache"
        assert tree.parents is not None and tree.depths is not None  # a tree's (a chain is fed as a chain)
        self.model, self.tree, self.first_slot, self.committed = model, tree, first_slot, list(committed)
        self.node_slots = [-1] * tree.num_nodes
        rows = len(self.committed)
        if grows:  # each node its own only ancestor until `set_parents`
            self.ancestors = torch.eye(tree.num_nodes, dtype=torch.bool).expand(rows, -1, -1).clone()
            depths = tree.depths.cpu()
        else:
            if shape is not None:
                host_tree = DraftTree.of_shape(shape, torch.zeros((rows, shape.num_nodes), dtype=torch.long))
            else:
                host_tree = DraftTree(tree.tokens.cpu(), tree.parents.cpu(), tree.depths.cpu())
            self.ancestors = host_tree.ancestors()  # (rows, N, N)
            assert host_tree.depths is not None
            depths = host_tree.depths
        self.node_positions = root_positions[:, None] + depths  # (rows, N)
        model.held_tree = self  # until `compact`: the model refuses to roll back or drop rows before

    def set_parents(self, nodes: Sequence[int], parents: torch.Tensor) -> None:
        """Set the parents of `nodes` (not fed yet) of a growing tree, each parent's own set already.

        Args:
            parents: `(rows, len(nodes))` long on the CPU, each row's parent of each node (-1: the root).
        """
        assert all(self.node_slots[node] < 0 for node in nodes), "a fed node's parent is fixed"
        rows = torch.arange(parents.shape[0])
        for lane, node in enumerate(nodes):
            parent = parents[:, lane]
            inherited = self.ancestors[rows, parent.clamp(min=0)] & (parent >= 0)[:, None]  # (rows, N)
            self.ancestors[:, node] = inherited
            self.ancestors[:, node, node] = True

    @classmethod
    def after_root(
        cls,
        model: CachedModel,
        sequences: Sequences,
        tree: DraftTree,
        shape: TreeShape | None = None,
        grows: bool = False,
    ) -> CachedTree:
        """The tree (of `shape`, if static; `grows`: its parents set as it is drafted) of a model that has fed every
        row's committed tokens, the root included (a draft after its first level's forward)."""
        assert model.fed == sequences.lengths, "the root must be fed before the nodes"
        return cls(model, tree, sequences.lengths, _root_positions(sequences), model.slots, shape, grows)

    def feed(self, nodes: Sequence[int], prefix: Columns | None = None) -> torch.Tensor:
        """Feed `nodes` (none fed yet, every ancestor fed already or now, in this order), after `prefix`.

        Args:
            nodes: node indices, fed in this order into the next slots.
            prefix: the committed positions not fed yet, the root last (`Sequences.columns`), fed before the nodes
                in the same forward; only before any node is in the cache.

        Returns:
            `(rows, 1 + len(nodes), vocab)` float32 logits: the root's (when `prefix` is given), then each node's.
        """
        model = self.model
        width = prefix.input_ids.shape[1] if prefix is not None else 0
        old = model.slots
        assert old + width == self.first_slot or (prefix is None and old >= self.first_slot), (
            "the prefix must end with the root, before any node"
        )
        assert all(self.node_slots[node] < 0 for node in nodes), "a node is fed once"
        if prefix is not None:
            model.grow(prefix.is_real)
        for offset, node in enumerate(nodes):
            self.node_slots[node] = old + width + offset - self.first_slot
        rows = model.slot_is_real.shape[0]
        model.grow(torch.ones((rows, len(nodes)), dtype=torch.bool))
        allowed = self._allowed(old, width, nodes)
        node_index = torch.tensor(list(nodes), dtype=torch.long)
        input_ids = self.tree.tokens[:, node_index.to(self.tree.tokens.device)]
        positions = self.node_positions[:, node_index]
        if prefix is not None:
            input_ids = torch.cat([prefix.input_ids.to(input_ids.device), input_ids], dim=1)
            positions = torch.cat([prefix.position_ids, positions], dim=1)
        return model.feed_masked(input_ids, positions, allowed, num_logits=len(nodes) + (prefix is not None))

    def _allowed(self, old: int, width: int, nodes: Sequence[int]) -> torch.Tensor:
        """`(rows, width + len(nodes), slots)` bool: which slots each fed position attends to (the slots already
        counted by `CachedModel.grow`): the prefix causally over real slots, each node over its row's real committed
        slots and its fed ancestors' slots (itself included)."""
        real = self.model.slot_is_real  # (rows, slots)
        rows, slots = real.shape
        allowed = torch.zeros((rows, width + len(nodes)), dtype=torch.bool)[..., None].expand(-1, -1, slots).clone()
        if width:
            causal = torch.arange(slots)[None, :] <= old + torch.arange(width)[:, None]  # (width, slots)
            allowed[:, :width] = causal & real[:, None, :]
        allowed[:, width:, : self.first_slot] = real[:, None, : self.first_slot]
        held = [node for node, slot in enumerate(self.node_slots) if slot >= 0]
        held_slots = torch.tensor([self.first_slot + self.node_slots[node] for node in held], dtype=torch.long)
        sees = self.ancestors[:, list(nodes)][:, :, held]  # (rows, len(nodes), held)
        allowed[:, width:, held_slots] = sees
        return allowed

    def compact(self, path: torch.Tensor, counts: Sequence[int]) -> None:
        """Keep each row's accepted path in the slots right after its root and roll every other node back.

        The path's entries are moved in place (one gather of at most `D` slots per layer tensor); the model then
        holds each row's committed tokens through the root and the first `counts[b]` path nodes it fed (a draft does
        not feed leaves: a path that ends at one keeps one node fewer), as a sequential feed of them would leave it.

        Args:
            path: `(rows, D)` long, each row's accepted nodes from the root's child down, -1 after `counts[b]` (read
                on the host once: which path nodes this model fed decides how many positions each row keeps).
            counts: per row, its accepted nodes.
        """
        self.model.held_tree = None
        path = path.cpu()
        rows, depth = path.shape
        node_slots = torch.tensor(self.node_slots + [-1], dtype=torch.long)  # [-1]: where padding (-1) looks
        offsets = node_slots[path]  # (rows, D) each path node's slot after `first_slot`, -1: not fed
        fed = [_leading_true((offsets[row, : counts[row]] >= 0).tolist()) for row in range(rows)]
        steps = torch.arange(depth)[None, :]
        keeps = steps < torch.tensor(fed)[:, None]  # (rows, D) the path slots that stay
        source = self.first_slot + torch.where(keeps, offsets, steps)  # padding moves onto itself
        if depth and max(fed):  # the first max(fed) columns: slots that exist (a draft feeds no leaf)
            _move_slots(self.model, source[:, : max(fed)], self.first_slot)
        self.model.rollback([committed + kept for committed, kept in zip(self.committed, fed)])


def feed_tree(
    model: CachedModel, sequences: Sequences, tree: DraftTree, shape: TreeShape | None = None
) -> tuple[torch.Tensor, CachedTree]:
    """Feed every row's committed positions not fed yet (the root at least) and all of `tree`'s nodes, in one forward.

    Every row must be the same number of positions behind its length (as `CachedModel.rollback_to_committed` leaves
    them). `shape`: the tree's static shape, if it has one (its mask is then built without reading the tree's
    parents off the device).

    Returns:
        `(rows, N + 1, vocab)` float32 logits (index 0: the root's, ``i + 1``: node ``i``'s), and the tree in the
        cache, held by the model until `CachedModel.keep_path` after verification.
    """
    behind = {length - fed for length, fed in zip(sequences.lengths, model.fed)}
    assert len(behind) == 1 and min(behind) >= 1, f"rows must be one width behind their lengths, got {behind}"
    prefix = sequences.columns(model.fed, behind.pop())
    first_slot = model.slots + prefix.input_ids.shape[1]
    cached = CachedTree(model, tree, sequences.lengths, _root_positions(sequences), first_slot, shape)
    return cached.feed(range(tree.num_nodes), prefix), cached


def _leading_true(flags: list[bool]) -> int:
    """How many of `flags` are True before the first False."""
    return next((index for index, flag in enumerate(flags) if not flag), len(flags))


def _root_positions(sequences: Sequences) -> torch.Tensor:
    """`(rows,)` long on the CPU: each row's last committed token's position id."""
    return sequences.columns([length - 1 for length in sequences.lengths], 1).position_ids[:, 0]


def _move_slots(model: CachedModel, source: torch.Tensor, first: int) -> None:
    """Copy each row's slots `source` `(rows, D)` into its slots ``first .. first + D - 1``, in every attention layer,
    in place (the gathered copy is at most `D` slots per row: the only allocation besides the index)."""
    depth = source.shape[1]
    index_on: dict[torch.device, torch.Tensor] = {}
    for layer in row_ops.attention_layers(model.cache):
        if not (layer.is_initialized and layer.keys is not None and layer.keys.numel()):
            continue
        for states in (layer.keys, layer.values):
            batch, heads, _, dim = states.shape
            index = index_on.get(states.device)
            if index is None:
                index = index_on.setdefault(states.device, source.to(states.device))
            moved = states.gather(2, index[:, None, :, None].expand(batch, heads, depth, dim))
            states[:, :, first : first + depth] = moved
