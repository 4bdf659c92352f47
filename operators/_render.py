"""Templated values as operators receive them.

The DAG renders templates to native objects, but an operator used in a DAG that does not (or called
with a rendered string by hand) gets a list/dict as its string form: parse it back, once, here.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any


def rendered(value: Any) -> Any:
    """A list/dict that arrives as its string form ("[2, 15, 27]", "{'shard': 0, ...}") parsed back; a lazy XCom
    sequence (a mapped task's results) as a list."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        return ast.literal_eval(value.strip())
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, list, tuple)):
        # One slice request for all items: iterating would fetch item by item and end on a not-found probe
        # past the last one, which the task log shows as an ERROR ("XCom not found").
        return list(value[:])
    return value
