"""Check parsed rows (vectorized over a whole block) and apply the length cap and the assistant-token floor.

A row gets the FIRST failing reason in BAD_REASONS order; bad rows never reach the output. Valid rows that
are too long are truncated (input_ids and loss_mask sliced at the same position, so they stay aligned) or
dropped, per cap_policy; rows left with fewer than min_assistant_tokens loss tokens are dropped.
Per-row work runs in Arrow/numpy over whole blocks; the per-token checks first test the block's min/max and
only look row by row when that fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eagle3.merge.parse import BadLine

# Row-level bad-input reasons checked here (parse.py adds malformed_json/missing_field/bad_type/...,
# the shuffle adds duplicate_sample_id, the driver adds empty_dataset).
BAD_REASONS = ("missing_field", "dataset_mismatch", "bad_type", "length_mismatch", "empty_sample",
               "id_out_of_vocab", "bad_loss_mask")
ROW_SCHEMA = pa.schema([("sample_id", pa.string()), ("dataset", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("length", pa.int32()), ("line", pa.int64())])


@dataclass
class Drop:
    count: int = 0
    tokens: int = 0  # tokens the dropped samples had (after truncation for the assistant-token floor)
    examples: list[BadLine] = field(default_factory=list)


@dataclass
class CheckedBlock:
    table: pa.Table  # ROW_SCHEMA, only rows that go on to the shuffle
    bad_counts: dict[str, int]
    bad_examples: list[BadLine]
    drops: dict[str, Drop]  # "too_long", "too_few_assistant_tokens"
    valid_lengths: np.ndarray  # lengths of valid rows before the cap (for stats)
    truncated: int = 0
    truncated_tokens: int = 0  # tokens cut away


def _column(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _lengths(arr: pa.Array) -> np.ndarray:
    return pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def _row_any(flat_flags: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per row: does any of its values have the flag? (values laid out row after row with these lengths)"""
    c = np.concatenate([[0], np.cumsum(flat_flags, dtype=np.int64)])
    ends = np.cumsum(lengths)
    return (c[ends] - c[ends - lengths]) > 0


def _rows_outside(arr: pa.Array, lengths: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Per row: has a value outside [lo, hi]? Only computed row by row when the block's min/max says so."""
    flat = arr.flatten()
    mm = pc.min_max(flat)
    if flat.null_count == len(flat) or (lo <= mm["min"].as_py() and mm["max"].as_py() <= hi):
        return np.zeros(len(arr), bool)
    v = flat.fill_null(lo).to_numpy(zero_copy_only=False)
    return _row_any((v < lo) | (v > hi), lengths)


def _rows_with_null_values(arr: pa.Array, lengths: np.ndarray) -> np.ndarray:
    flat = arr.flatten()
    if not flat.null_count:
        return np.zeros(len(arr), bool)
    return _row_any(flat.is_null().to_numpy(zero_copy_only=False), lengths)


def check_block(table: pa.Table, dataset: str, *, id_limit: int, max_seq_len: int, cap_policy: str,
                min_assistant_tokens: int, max_examples: int) -> CheckedBlock:
    n = table.num_rows
    sid, ds = _column(table, "sample_id"), _column(table, "dataset")
    ids, mask = _column(table, "input_ids"), _column(table, "loss_mask")
    line = _column(table, "line").to_numpy()
    ids_len, mask_len = _lengths(ids), _lengths(mask)

    def np_bool(a: pa.Array) -> np.ndarray:
        return a.fill_null(True).to_numpy(zero_copy_only=False).astype(bool)

    missing = (np_bool(sid.is_null()) | np_bool(ds.is_null()) | np_bool(ids.is_null()) | np_bool(mask.is_null())
               | np_bool(pc.equal(sid, "")))
    checks = {
        "missing_field": missing,
        "dataset_mismatch": np_bool(pc.not_equal(ds, dataset)),
        "bad_type": _rows_with_null_values(ids, ids_len) | _rows_with_null_values(mask, mask_len),
        "length_mismatch": ids_len != mask_len,
        "empty_sample": ids_len == 0,
        "id_out_of_vocab": _rows_outside(ids, ids_len, 0, id_limit - 1),
        "bad_loss_mask": _rows_outside(mask, mask_len, 0, 1),
    }
    ok = np.ones(n, bool)
    bad_counts: dict[str, int] = {}
    bad_examples: list[BadLine] = []
    for reason in BAD_REASONS:
        hit = ok & checks[reason]
        k = int(hit.sum())
        if not k:
            continue
        bad_counts[reason] = k
        ok &= ~hit
        for i in np.flatnonzero(hit)[:max_examples]:
            bad_examples.append(BadLine(reason, int(line[i]), _describe(reason, i, sid, ds, dataset, ids_len,
                                                                       mask_len, ids, id_limit)))

    valid_lengths = ids_len[ok]
    drops: dict[str, Drop] = {}
    too_long = ok & (ids_len > max_seq_len)
    truncated = truncated_tokens = 0
    keep = ok
    if cap_policy == "drop":
        _add_drop(drops, "too_long", too_long, ids_len, line, max_examples, f"longer than max_seq_len {max_seq_len}")
        keep = ok & ~too_long
    else:
        truncated = int(too_long.sum())
        truncated_tokens = int((ids_len[too_long] - max_seq_len).sum())

    out_len = np.minimum(ids_len[keep], max_seq_len)
    if keep.all():  # the common case: no copy
        out_sid, out_ds, out_ids, out_mask = sid, ds, ids, mask
    else:
        idx = pa.array(np.flatnonzero(keep))
        out_sid, out_ds, out_ids, out_mask = sid.take(idx), ds.take(idx), ids.take(idx), mask.take(idx)
    if truncated:  # same slice on both lists: they stay aligned
        out_ids = pc.list_slice(out_ids, 0, max_seq_len)
        out_mask = pc.list_slice(out_mask, 0, max_seq_len)
    out = pa.table({"sample_id": out_sid, "dataset": out_ds, "input_ids": out_ids, "loss_mask": out_mask,
                    "length": pa.array(out_len.astype(np.int32)), "line": pa.array(line[keep])}, schema=ROW_SCHEMA)

    if min_assistant_tokens > 0 and out.num_rows:
        # loss tokens left after the cap; every kept row is non-empty, so reduceat's row starts are valid
        flat = out_mask.flatten().to_numpy(zero_copy_only=False)
        assistant = np.add.reduceat(flat, np.cumsum(out_len) - out_len, dtype=np.int64)
        too_few = assistant < min_assistant_tokens
        if too_few.any():
            _add_drop(drops, "too_few_assistant_tokens", too_few, out_len, line[keep], max_examples,
                      f"fewer than min_assistant_tokens {min_assistant_tokens} loss tokens")
            out = out.filter(pa.array(~too_few))
    return CheckedBlock(out, bad_counts, bad_examples, drops, valid_lengths, truncated, truncated_tokens)


def _add_drop(drops, reason, hit, lengths, line, max_examples, why):
    k = int(hit.sum())
    if k:
        d = drops.setdefault(reason, Drop())
        d.count += k
        d.tokens += int(lengths[hit].sum())
        d.examples += [BadLine(reason, int(line[i]), f"{why} ({int(lengths[i])} tokens)")
                       for i in np.flatnonzero(hit)[:max_examples]]


def _describe(reason, i, sid, ds, dataset, ids_len, mask_len, ids, id_limit) -> str:
    i = int(i)
    if reason == "missing_field":
        return "missing or empty field (sample_id, dataset, input_ids, loss_mask)"
    if reason == "dataset_mismatch":
        return f"dataset {ds[i].as_py()!r} but the file is in dataset folder {dataset!r}"
    if reason == "bad_type":
        return "null inside input_ids or loss_mask"
    if reason == "length_mismatch":
        return f"input_ids has {ids_len[i]} tokens but loss_mask {mask_len[i]}"
    if reason == "empty_sample":
        return "input_ids is empty"
    if reason == "id_out_of_vocab":
        row = np.asarray(ids[i].values.to_numpy(zero_copy_only=False))
        bad = row[(row < 0) | (row >= id_limit)]
        return f"token id {int(bad[0])} outside [0, {id_limit}) (sample {sid[i].as_py()!r})"
    return "loss_mask values must be 0 or 1"
