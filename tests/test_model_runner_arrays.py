"""The runner's host arrays of a step, against loops written out plainly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.runtime.model_runner import PADDED_ROWS_MIN_SEQS, padded_block_table, step_arrays


def random_tables(rng: random.Random, num_seqs: int) -> list[list[int]]:
    return [[rng.randrange(1000) for _ in range(rng.randint(0, 12))] for _ in range(num_seqs)]


@pytest.mark.parametrize("num_seqs", [1, PADDED_ROWS_MIN_SEQS - 1, PADDED_ROWS_MIN_SEQS, 64])
def test_padded_block_table_pads_each_row_with_zeros(num_seqs):
    rng = random.Random(num_seqs)
    tables = random_tables(rng, num_seqs)
    tables[0] = list(range(1, 14))  # the longest row sets the width
    width = 13
    expected = np.zeros((num_seqs, width), dtype=np.int64)
    for row, table in enumerate(tables):
        for column, block in enumerate(table):
            expected[row, column] = block
    table = padded_block_table(tables)
    assert table.dtype == np.int64 and table.shape == (num_seqs, width)
    np.testing.assert_array_equal(table, expected)


@pytest.mark.parametrize("num_seqs", [3, 40])
@pytest.mark.parametrize("decode", [True, False])
def test_step_arrays_place_each_token_at_its_position_and_slot(num_seqs, decode):
    rng, block_size = random.Random(num_seqs), 4
    context = [rng.randint(0, 30) for _ in range(num_seqs)]
    num_new = [1 if decode else rng.randint(1, 6) for _ in range(num_seqs)]
    tables = [rng.sample(range(500), (c + n + block_size - 1) // block_size) for c, n in zip(context, num_new)]
    input_ids = list(range(sum(num_new)))
    arrays = step_arrays(input_ids, num_new, context, tables, block_size)
    positions, slots = [], []
    for c, n, table in zip(context, num_new, tables):
        for position in range(c, c + n):
            positions.append(position)
            slots.append(table[position // block_size] * block_size + position % block_size)
    np.testing.assert_array_equal(arrays["positions"], positions)
    np.testing.assert_array_equal(arrays["slot_mapping"], slots)
    np.testing.assert_array_equal(arrays["query_start_loc"], np.cumsum([0, *num_new]))
    np.testing.assert_array_equal(arrays["seq_lens"], np.add(context, num_new))
    assert arrays["max_query_len"] == max(num_new) and arrays["max_seq_len"] == max(np.add(context, num_new))
