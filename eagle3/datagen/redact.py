"""Secrets out of everything datagen writes: files, exceptions, log lines.

An endpoint can echo what it was sent (an Authorization header in a 401 body) and a base URL can carry
`user:key@`, so every text that leaves the process passes `redact()` first: the registered key values,
`Bearer <token>`, `Authorization: <value>` and URL userinfo become `***`. An answer (200) that holds a key is
stored with the key masked (`redact_secrets`) and counted in the report (`this_run.redacted_secrets`).
"""

from __future__ import annotations

import logging
import re

MASK = "***"
# keys shorter than this are placeholders ("EMPTY", "none"), and masking them would garble ordinary text
MIN_SECRET_LEN = 6

_secrets: set[str] = set()
_PATTERNS = (
    (re.compile(r"(?i)\b(authorization\s*[:=]\s*)(?:(bearer|basic)\s+)?[^\s\"',}]+"),
     lambda m: f"{m.group(1)}{m.group(2) + ' ' if m.group(2) else ''}{MASK}"),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+"), lambda m: m.group(1) + MASK),
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@\"']+@"), lambda m: m.group(1) + MASK + "@"),
)


def register_secret(value: str | None) -> None:
    """Mask `value` wherever it appears from now on (the API key of an endpoint)."""
    if value and len(value) >= MIN_SECRET_LEN:
        _secrets.add(value)


def redact_secrets(text: str) -> tuple[str, int]:
    """Only the registered key values masked, and how many: what an answer (the training data) gets; the
    header patterns of `redact` would garble an answer that explains them."""
    n = 0
    for secret in sorted(_secrets, key=len, reverse=True):
        if secret in text:
            n += text.count(secret)
            text = text.replace(secret, MASK)
    return text, n


def redact(text: str) -> str:
    for secret in sorted(_secrets, key=len, reverse=True):  # longest first: a key containing another
        text = text.replace(secret, MASK)
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


class RedactFilter(logging.Filter):
    """Redacts a log record's final message (added to each datagen logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def redacting_logger(name: str) -> logging.Logger:
    log = logging.getLogger(name)
    if not any(isinstance(f, RedactFilter) for f in log.filters):
        log.addFilter(RedactFilter())
    return log
