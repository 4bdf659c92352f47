"""Check parsed rows (vectorized over a whole block) and apply the length cap and the assistant-token floor.

A row gets the FIRST failing reason in BAD_REASONS order; bad rows never reach the output. Valid rows that
are too long are truncated (input_ids and loss_mask cut at the same position, so they stay aligned) or
dropped, per cap_policy; rows left with fewer than min_assistant_tokens loss tokens are dropped.
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


def _row_sum(flat_values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    c = np.concatenate([[0], np.cumsum(flat_values, dtype=np.int64)])
    ends = np.cumsum(lengths)
    return c[ends] - c[ends - lengths]


def _flat_int(arr: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    flat = arr.flatten()
    nulls = flat.is_null().to_numpy(zero_copy_only=False) if flat.null_count else None
    return flat.fill_null(0).to_numpy(zero_copy_only=False), nulls


def _kept_values(values: np.ndarray, lengths: np.ndarray, keep_row: np.ndarray, cap: int) -> np.ndarray:
    """The values of kept rows, each row cut to its first `cap` values."""
    n_vals = len(values)
    starts = np.cumsum(lengths) - lengths
    pos = np.arange(n_vals, dtype=np.int64) - np.repeat(starts, lengths)
    return values[np.repeat(keep_row, lengths) & (pos < cap)]


def check_block(table: pa.Table, dataset: str, *, id_limit: int, max_seq_len: int, cap_policy: str,
                min_assistant_tokens: int, max_examples: int) -> CheckedBlock:
    n = table.num_rows
    sid, ds = _column(table, "sample_id"), _column(table, "dataset")
    ids, mask = _column(table, "input_ids"), _column(table, "loss_mask")
    line = _column(table, "line").to_numpy()
    ids_len, mask_len = _lengths(ids), _lengths(mask)
    ids_flat, ids_nulls = _flat_int(ids)
    mask_flat, mask_nulls = _flat_int(mask)

    def np_bool(a: pa.Array) -> np.ndarray:
        return a.fill_null(True).to_numpy(zero_copy_only=False).astype(bool)

    missing = (np_bool(sid.is_null()) | np_bool(ds.is_null()) | np_bool(ids.is_null()) | np_bool(mask.is_null())
               | np_bool(pc.equal(sid, "")))
    checks = {
        "missing_field": missing,
        "dataset_mismatch": np_bool(pc.not_equal(ds, dataset)),
        "bad_type": (_row_any(ids_nulls, ids_len) if ids_nulls is not None else np.zeros(n, bool))
                    | (_row_any(mask_nulls, mask_len) if mask_nulls is not None else np.zeros(n, bool)),
        "length_mismatch": ids_len != mask_len,
        "empty_sample": ids_len == 0,
        "id_out_of_vocab": _row_any((ids_flat < 0) | (ids_flat >= id_limit), ids_len),
        "bad_loss_mask": _row_any((mask_flat != 0) & (mask_flat != 1), mask_len),
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
    keep = ok.copy()
    drops: dict[str, Drop] = {}
    too_long = ok & (ids_len > max_seq_len)
    truncated = truncated_tokens = 0
    cap = max_seq_len
    if cap_policy == "drop":
        _add_drop(drops, "too_long", too_long, ids_len, line, max_examples, f"longer than max_seq_len {max_seq_len}")
        keep &= ~too_long
    else:
        truncated = int(too_long.sum())
        truncated_tokens = int((ids_len[too_long] - max_seq_len).sum())
    new_len = np.minimum(ids_len, cap)
    # loss tokens left after the cap, for valid rows (their mask is 0/1 and as long as input_ids)
    assistant = np.zeros(n, np.int64)
    assistant[ok] = _row_sum(_kept_values(mask_flat, mask_len, ok, cap), new_len[ok])
    too_few = keep & (assistant < min_assistant_tokens)
    _add_drop(drops, "too_few_assistant_tokens", too_few, new_len, line, max_examples,
              f"fewer than min_assistant_tokens {min_assistant_tokens} loss tokens")
    keep &= ~too_few

    out_len = new_len[keep]
    offsets = pa.array(np.concatenate([[0], np.cumsum(out_len)]).astype(np.int32))
    out_ids = _kept_values(ids_flat, ids_len, keep, cap).astype(np.int32)
    out_mask = _kept_values(mask_flat, mask_len, keep, cap).astype(np.int8)
    idx = pa.array(np.flatnonzero(keep))
    out = pa.table({
        "sample_id": sid.take(idx), "dataset": ds.take(idx),
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(out_ids, pa.int32())),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(out_mask, pa.int8())),
        "length": pa.array(out_len.astype(np.int32)), "line": pa.array(line[keep]),
    }, schema=ROW_SCHEMA)
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
