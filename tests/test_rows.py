"""The row book: one map from active rows to caller rows, followed by every member."""

import gc
import weakref

import pytest
import torch

from hf_specsample.core.sequences import RowBook, Sequences


class Recorder:
    def __init__(self):
        self.calls = []

    def select_rows(self, rows):
        self.calls.append(list(rows))


def test_select_maps_active_rows_to_caller_rows_and_tells_members():
    book = RowBook(4)
    member = Recorder()
    book.attach(member)
    book.select_rows([0, 2, 3])
    assert book.active == [0, 2, 3] and member.calls == [[0, 2, 3]]
    book.select_rows([1, 2])  # active rows 1 and 2 are caller rows 2 and 3
    assert book.callers() == [2, 3] and book.caller(0) == 2 and book.caller(1) == 3
    assert member.calls[-1] == [1, 2]
    book.select_rows([0, 1])  # nothing changes: members are not asked
    assert len(member.calls) == 2
    book.select_rows([])  # every row done: the book records it, members are not asked to keep zero rows
    assert book.num_active == 0 and len(member.calls) == 2


@pytest.mark.parametrize("rows", [[2, 0], [0, 0], [5]])
def test_select_refuses_rows_out_of_order_repeated_or_out_of_range(rows):
    with pytest.raises(ValueError, match="ascending and distinct"):
        RowBook(3).select_rows(rows)


def test_two_buffers_over_one_book_drop_rows_together():
    # A draft with another tokenizer reads a second buffer over the target's rows: a row leaves both at once.
    target = Sequences(torch.arange(12).reshape(3, 4), None, capacity=10)
    draft = Sequences(torch.arange(6).reshape(3, 2), None, capacity=10, rows=target.rows)
    target.advance([1, 2, 3])
    draft.advance([3, 2, 1])
    target.drop_finished([False, True, False])
    assert target.rows is draft.rows and target.rows.active == [0, 2]
    assert target.lengths == [5, 7] and draft.lengths == [5, 3]
    assert torch.equal(draft.tokens[:, :2], torch.tensor([[0, 1], [4, 5]]))
    assert torch.equal(target.finished[1], torch.tensor([4, 5, 6, 7, 0, 0]))


def test_a_new_buffer_needs_a_book_with_all_its_rows_active():
    book = RowBook(3)
    book.select_rows([0, 2])
    with pytest.raises(ValueError, match="exactly those rows active"):
        Sequences(torch.zeros((3, 2), dtype=torch.long), None, capacity=4, rows=book)


def test_the_book_keeps_no_member_alive():
    # A buffer holds its book and is a member of it: held strongly, that cycle would keep the call's buffers and
    # KV caches alive until the garbage collector runs.
    gc.collect()
    gc.disable()
    try:
        target = Sequences(torch.zeros((2, 3), dtype=torch.long), None, capacity=8)
        draft = Sequences(torch.zeros((2, 2), dtype=torch.long), None, capacity=8, rows=target.rows)
        member = Recorder()
        target.rows.attach(member)
        references = [weakref.ref(target), weakref.ref(draft), weakref.ref(member)]
        del target, draft, member
        assert [reference() for reference in references] == [None, None, None]  # freed without a collection
    finally:
        gc.enable()


def test_a_freed_member_stops_following():
    book = RowBook(3)
    kept, dropped = Recorder(), Recorder()
    book.attach(kept)
    book.attach(dropped)
    del dropped
    book.select_rows([1, 2])
    assert kept.calls == [[1, 2]]
