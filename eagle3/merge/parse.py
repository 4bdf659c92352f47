"""Read tokenized JSONL in large blocks and parse each block into an Arrow table.

The fast path hands a whole block to pyarrow's multithreaded JSON reader (no Python object per token).
When a block holds anything it cannot parse (malformed JSON, a wrong type, a blank line) the block is
re-parsed line by line with the json module, so every bad line is found and named with its line number
and the good lines around it are kept.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.json as pajson

from eagle3.datagen.contract import FIELDS
from eagle3.io import BadJSONLine, json_line

# Parsed straight into the output types: an id beyond int32 or a mask value beyond int8 fails the fast
# path and is then named by the line-by-line path.
JSON_SCHEMA = pa.schema([("sample_id", pa.string()), ("dataset", pa.string()),
                         ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])
PARSED_SCHEMA = JSON_SCHEMA.append(pa.field("line", pa.int64()))
_PARSE_OPTIONS = pajson.ParseOptions(explicit_schema=JSON_SCHEMA, unexpected_field_behavior="ignore")
_ARROW_BLOCK = 2 << 20  # pyarrow parses blocks of this size on its threads


@dataclass
class BadLine:
    reason: str
    line: int
    message: str


@dataclass
class ParsedBlock:
    table: pa.Table  # PARSED_SCHEMA; fields may be null (checked by validate)
    bad: list[BadLine] = field(default_factory=list)
    lines: int = 0
    nbytes: int = 0


def iter_line_blocks(path: Path, block_bytes: int) -> Iterator[tuple[int, int, bytes]]:
    """Yield (first line number, number of lines, bytes) blocks ending on a line boundary (the last may not)."""
    first_line = 1
    rest = b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(block_bytes)
            if not chunk:
                break
            buf = rest + chunk if rest else chunk
            cut = buf.rfind(b"\n")
            if cut < 0:  # one line longer than a block: keep reading
                rest = buf
                continue
            block, rest = buf[:cut + 1], buf[cut + 1:]
            n = block.count(b"\n")
            yield first_line, n, block
            first_line += n
    if rest:
        yield first_line, 1, rest


def iter_parsed_blocks(paths: list[Path], block_bytes: int, id_limit: int) -> Iterator[tuple[int, ParsedBlock]]:
    """(index into paths, ParsedBlock) for every block of every file, in order. The next block is parsed on a
    thread (pyarrow releases the GIL) while the caller works on this one, across file boundaries too; at most
    two blocks are in memory. A file with no bytes yields one empty block, so every file is seen."""
    def blocks():
        for i, path in enumerate(paths):
            empty = True
            for first_line, n_lines, block in iter_line_blocks(path, block_bytes):
                empty = False
                yield i, first_line, n_lines, block
            if empty:
                yield i, 1, 0, b""

    with ThreadPoolExecutor(1) as pool:
        pending = None
        for i, first_line, n_lines, block in blocks():
            nxt = (i, pool.submit(parse_block, first_line, n_lines, block, id_limit))
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = nxt
        if pending is not None:
            yield pending[0], pending[1].result()


def _arrow_parse(block: bytes) -> pa.Table:
    opts = pajson.ReadOptions(block_size=_ARROW_BLOCK, use_threads=True)
    try:
        return pajson.read_json(pa.BufferReader(block), read_options=opts, parse_options=_PARSE_OPTIONS)
    except pa.ArrowInvalid as e:
        if "straddl" not in str(e):
            raise
        # a line longer than pyarrow's block: parse the whole block as one
        opts = pajson.ReadOptions(block_size=len(block) + 1, use_threads=False)
        return pajson.read_json(pa.BufferReader(block), read_options=opts, parse_options=_PARSE_OPTIONS)


def parse_block(first_line: int, n_lines: int, block: bytes, id_limit: int) -> ParsedBlock:
    if not block:
        return ParsedBlock(pa.table({k: [] for k in PARSED_SCHEMA.names}, schema=PARSED_SCHEMA), [], 0, 0)
    if not block.endswith(b"\n"):
        block += b"\n"  # a last line without newline (the only such line is a file's last)
    try:
        table = _arrow_parse(block)
        for name in ("sample_id", "dataset"):  # pyarrow's reader takes non-UTF-8 bytes into strings as they are
            table.column(name).validate(full=True)
    except pa.ArrowInvalid:
        table = None
    if table is not None and table.num_rows == n_lines:  # one row per line: row i is line first_line + i
        lines = pa.array(range(first_line, first_line + n_lines), pa.int64())
        table = table.append_column("line", lines)
        return ParsedBlock(table.combine_chunks(), [], n_lines, len(block))
    return parse_lines(first_line, block, id_limit)


def _int_list(v) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def parse_lines(first_line: int, block: bytes, id_limit: int) -> ParsedBlock:
    """Slow path: one json.loads per line; structural problems become BadLines, the rest a table."""
    cols: dict[str, list] = {k: [] for k in PARSED_SCHEMA.names}
    bad: list[BadLine] = []
    raw_lines = block.split(b"\n")
    if raw_lines[-1] == b"":
        raw_lines.pop()
    for i, raw in enumerate(raw_lines):
        ln = first_line + i
        if not raw.strip():
            bad.append(BadLine("malformed_json", ln, "blank line"))
            continue
        try:
            obj = json_line(raw)
        except BadJSONLine as e:
            bad.append(BadLine("malformed_json", ln, str(e)))
            continue
        if not isinstance(obj, dict):
            bad.append(BadLine("malformed_json", ln, f"not a JSON object but {type(obj).__name__}"))
            continue
        missing = [k for k in FIELDS if obj.get(k) is None]
        if missing:
            bad.append(BadLine("missing_field", ln, f"missing field(s) {missing}"))
            continue
        wrong = [k for k in ("sample_id", "dataset") if not isinstance(obj[k], str)]
        wrong += [k for k in ("input_ids", "loss_mask") if not _int_list(obj[k])]
        if wrong:
            bad.append(BadLine("bad_type", ln, f"wrong type for {wrong} (want str, str, [int], [int])"))
            continue
        ids = obj["input_ids"]
        if ids and not (0 <= min(ids) and max(ids) < id_limit):
            bad.append(BadLine("id_out_of_vocab", ln, f"token id outside [0, {id_limit}): min {min(ids)}, max {max(ids)}"))
            continue
        mask = obj["loss_mask"]
        if mask and not (0 <= min(mask) and max(mask) <= 1):
            bad.append(BadLine("bad_loss_mask", ln, "loss_mask values must be 0 or 1"))
            continue
        for k in FIELDS:
            cols[k].append(obj[k])
        cols["line"].append(ln)
    table = pa.table(cols, schema=PARSED_SCHEMA)
    return ParsedBlock(table, bad, len(raw_lines), len(block))
