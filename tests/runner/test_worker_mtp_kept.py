"""The MTP drafter's store of a request's hidden states (`worker_mtp._Kept`) against a dict of
position -> row: steps that add rows (a later step starting before the end replaces what
follows; a gap starts over; the oldest go past the cap), drops, and reads of any range."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.runner import worker_mtp
from deepinfer.runner.worker_mtp import _Kept

CAP = 12


class _Reference:
    def __init__(self) -> None:
        self.rows: dict[int, float] = {}

    def add(self, start: int, values: list[float]) -> None:
        self.rows = {p: v for p, v in self.rows.items() if p < start}
        if self.rows and max(self.rows) + 1 != start:
            self.rows = {}
        self.rows |= {start + i: v for i, v in enumerate(values)}
        for p in sorted(self.rows)[: max(len(self.rows) - CAP, 0)]:
            del self.rows[p]

    def drop_before(self, position: int) -> None:
        self.rows = {p: v for p, v in self.rows.items() if p >= position}

    def read(self, lo: int, hi: int) -> list[float] | None:
        if not all(p in self.rows for p in range(lo, hi)):
            return None
        return [self.rows[p] for p in range(lo, hi)]


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 40), st.integers(1, 9)),
    st.tuples(st.just("drop"), st.integers(0, 40), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(operations=st.lists(operation, min_size=1, max_size=25), reads=st.data())
def test_kept_rows_are_a_dict_of_positions(
    operations: list[tuple[str, int, int]], reads: st.DataObject
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker_mtp, "MAX_KEPT_POSITIONS", CAP)
        kept, reference, counter = _Kept(), _Reference(), 0
        for op, position, n in operations:
            if op == "add":
                values = [float(counter + i) for i in range(n)]
                counter += n
                kept.add(position, torch.tensor(values).unsqueeze(1))
                reference.add(position, values)
            else:
                kept.drop_before(position)
                reference.drop_before(position)
            for _ in range(3):
                lo = reads.draw(st.integers(0, 50))
                hi = reads.draw(st.integers(lo + 1, 51))
                got = kept.rows(lo, hi)
                want = reference.read(lo, hi)
                assert (got is None) == (want is None), (lo, hi, reference.rows)
                if got is not None:
                    assert got.squeeze(1).tolist() == want
