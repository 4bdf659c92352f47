"""The plugin pages' look: one style sheet and page frame (the pages open inside the Airflow UI's run tabs)."""

from __future__ import annotations

import html

STYLE = """body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1a202c}table{border-collapse:collapse;margin:.5rem 0}
td,th{border:1px solid #cbd5e0;padding:.3rem .6rem;text-align:right}th{background:#edf2f7}td.l{text-align:left}
.complete{background:#c6f6d5}.in.progress{background:#fefcbf}.not.started{background:#edf2f7}
.failed{background:#fed7d7}.damaged{background:#fbd38d}.err{color:#c53030}
pre{background:#f7fafc;border:1px solid #cbd5e0;padding:.5rem;white-space:pre-wrap;word-break:break-all}
.state{font-size:.8em;padding:.1rem .4rem;border-radius:.3rem;vertical-align:middle;background:#edf2f7}
.state.complete{background:#c6f6d5}.state.in-progress{background:#fefcbf}.state.failed{background:#fed7d7}
.note{color:#4a5568;font-size:.9em}"""


def page(title: str, body: str, refresh_s: int | None = None) -> str:
    refresh = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return (f'<!doctype html><html><head><meta charset="utf-8">{refresh}<title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>{body}</body></html>")
