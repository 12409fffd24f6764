"""StagedUpload and to_device_packed: many host arrays in one copy, handed back in their shapes
and order."""

from __future__ import annotations

import numpy as np
import torch

from outrider.transfer import StagedUpload, to_device_packed


def test_parts_come_back_in_order_and_shape_and_the_buffer_grows() -> None:
    up = StagedUpload(torch.device("cpu"), capacity=8)
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    b = np.array([7, -1], dtype=np.int32)
    c = np.full((3, 4), 9, dtype=np.int64)  # 20 values in all: past the capacity of 8
    got = up.send([a, b, c])
    assert [g.shape for g in got] == [(2, 3), (2,), (3, 4)]
    assert all(g.dtype == torch.int64 for g in got)
    np.testing.assert_array_equal(got[0].numpy(), a)
    np.testing.assert_array_equal(got[1].numpy(), b)
    np.testing.assert_array_equal(got[2].numpy(), c)
    again = up.send([np.array([[1, 2]], dtype=np.int64)])  # a smaller send reuses the buffer
    np.testing.assert_array_equal(again[0].numpy(), [[1, 2]])


def test_packed_parts_keep_their_values_dtypes_and_shapes_each_aligned() -> None:
    tables = [[3, 1, 0], [2, 5, 9]]
    got = to_device_packed(
        [([5, -2, 7], torch.int64), ([0, 1], torch.int32), (tables, torch.int32),
         ([], torch.int64), ([2**40], torch.int64)],
        torch.device("cpu"),
    )  # fmt: skip
    assert [g.dtype for g in got] == [torch.int64, torch.int32, torch.int32, torch.int64,
                                      torch.int64]  # fmt: skip
    assert [tuple(g.shape) for g in got] == [(3,), (2,), (2, 3), (0,), (1,)]
    assert got[0].tolist() == [5, -2, 7] and got[1].tolist() == [0, 1]
    assert got[2].tolist() == tables and got[4].tolist() == [2**40]
    assert all(g.data_ptr() % 16 == 0 for g in got if g.numel())
    assert all(g.is_contiguous() for g in got)
