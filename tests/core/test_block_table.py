"""The model runner's persistent block table (vframe/core/worker/input_batch.py)."""

import numpy as np

from vframe.core.worker.input_batch import BlockTable


def test_rows_gather_in_request_order_with_zero_tails() -> None:
    table = BlockTable(rows=2, width=2)
    table.add("a", [7, 3])
    table.add("b", [5])
    table.extend("b", [9, 11, 2])  # past the width: the table widens
    assert table.gather(["b", "a"]).tolist() == [[5, 9, 11, 2], [7, 3, 0, 0]]
    assert table.gather(["a"]).tolist() == [[7, 3]]  # as wide as the widest row asked for
    table.add("c", [1])  # no free row: the table doubles its rows
    assert table.gather(["c", "a", "b"]).tolist() == [[1, 0, 0, 0], [7, 3, 0, 0], [5, 9, 11, 2]]
    assert table.gather(["a"]).dtype == np.int64


def test_a_removed_request_leaves_nothing_in_its_reused_row() -> None:
    table = BlockTable(rows=1, width=4)
    table.add("a", [4, 8, 15, 16])
    table.remove("a")
    table.add("b", [23])
    assert table.gather(["b"]).tolist() == [[23]]
    table.extend("b", [42])
    table.add("c", [1, 2, 3, 5])
    assert table.gather(["b", "c"]).tolist() == [[23, 42, 0, 0], [1, 2, 3, 5]]  # not a's 15, 16
    table.remove("missing")  # unknown ids are ignored, as a failed request's
    table.add("b", [6, 7])  # added again (preempted, then scheduled anew): its blocks replaced
    assert table.gather(["b"]).tolist() == [[6, 7]]
    assert len(table.rows) == 2  # b and c: re-adding b took no second row
