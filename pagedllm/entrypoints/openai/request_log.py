"""What the server logs about requests: client text escaped and truncated, warnings rate-limited.

A client controls request ids and field names. Logged raw, a `\\n` in a request_id forges a log
line, and a request with a million unknown field names grows the log by megabytes. So every
client string goes through `for_log` (escaped like repr, cut at --max-log-len characters):

    for_log("abc\\nINFO fake line", 8)  ->  'abc\\\\nINFO...(+12)'   (one line, 8 characters kept)

and unknown-field warnings are counted in `pagedllm:request_unknown_fields_total` (requests that
carried them) and logged rate-limited: a burst of UNKNOWN_FIELDS_BURST lines, then one per
UNKNOWN_FIELDS_LOG_INTERVAL_S with a count of the requests not logged; each line names at most
UNKNOWN_FIELDS_LOGGED fields, and none is logged with --disable-log-requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

logger = logging.getLogger("pagedllm.entrypoints.openai")

DEFAULT_MAX_LOG_LEN = 256
UNKNOWN_FIELDS_LOG_INTERVAL_S = 10.0
UNKNOWN_FIELDS_BURST = 5
UNKNOWN_FIELDS_LOGGED = 5


def for_log(value: object, max_len: int | None = DEFAULT_MAX_LOG_LEN) -> str:
    """One printable line: control characters, quotes and non-UTF-8 text escaped; at most max_len
    characters of the value, then how many were cut."""
    text = str(value)
    cut = 0
    if max_len is not None and len(text) > max_len:
        cut = len(text) - max_len
        text = text[:max_len]
    escaped = text.encode("unicode_escape").decode("ascii")
    return f"{escaped}...(+{cut})" if cut else escaped


class UnknownFieldReporter:
    """Counts requests with unknown fields; logs a few of them, rate-limited."""

    def __init__(
        self,
        *,
        log_enabled: bool = True,
        max_log_len: int | None = DEFAULT_MAX_LOG_LEN,
        on_count: Callable[[], None] | None = None,
        interval_s: float = UNKNOWN_FIELDS_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log_enabled = log_enabled
        self.max_log_len = max_log_len
        self.on_count = on_count or (lambda: None)
        self.interval_s = interval_s
        self.clock = clock
        self.count = 0
        self._tokens = float(UNKNOWN_FIELDS_BURST)  # a token bucket: lines that may be logged now
        self._last = clock()
        self._suppressed = 0

    def report(self, request_id: str, names: Iterable[str]) -> None:
        names = list(names)
        if not names:
            return
        self.count += 1
        self.on_count()
        if not self.log_enabled:
            return
        now = self.clock()
        self._tokens = min(float(UNKNOWN_FIELDS_BURST), self._tokens + (now - self._last) / self.interval_s)
        self._last = now
        if self._tokens < 1:
            self._suppressed += 1
            return
        self._tokens -= 1
        shown = ", ".join(for_log(n, 64) for n in sorted(names[:1000])[:UNKNOWN_FIELDS_LOGGED])
        more = f" and {len(names) - UNKNOWN_FIELDS_LOGGED} more" if len(names) > UNKNOWN_FIELDS_LOGGED else ""
        quiet = f" ({self._suppressed} more requests with unknown fields not logged)" if self._suppressed else ""
        self._suppressed = 0
        if self.max_log_len is not None and len(shown) > self.max_log_len:
            shown = f"{shown[:self.max_log_len]}...(+{len(shown) - self.max_log_len})"
        logger.warning(
            "%s: ignoring unknown or unsupported fields: %s%s%s",
            for_log(request_id, self.max_log_len), shown, more, quiet,
        )
