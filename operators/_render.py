"""Templated values as operators receive them.

The DAG renders templates as native objects (render_template_as_native_obj=True): a phase config pulled from
preflight's XCom arrives as the dict it was, with no string round trip. A mapped task's results arrive as a lazy
XCom sequence: read it whole, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def rendered(value: Any) -> Any:
    """A lazy XCom sequence (a mapped task's results) as a list; anything else as it is."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, list, tuple)):
        # One slice request for all items: iterating would fetch item by item and end on a not-found probe
        # past the last one, which the task log shows as an ERROR ("XCom not found").
        return list(value[:])
    return value
