"""Server-sent events: an incremental parser of the `text/event-stream` format (WHATWG HTML, "Server-sent
events", the event stream interpretation), for the data of each event and nothing else.

Lines end in LF, CRLF or CR; a CR that ends one network read and an LF that starts the next are one line
end. A line starting with ':' is a comment. `field:value` drops one space after the colon; a line without a
colon is a field with an empty value. `data` lines append their value to the event's data (several are
joined with LF); every other field (event, id, retry, unknown ones) is ignored. An empty line dispatches the
event, unless it has no data line. A UTF-8 byte order mark at the very start is dropped, and an event cut
off by the end of the stream is discarded.

Bytes may arrive split anywhere, also inside a UTF-8 character: lines are cut on bytes (no UTF-8 sequence
contains CR, LF or ':') and the data is handed out as bytes, to be decoded once whole (orjson takes bytes).
"""

from __future__ import annotations

import re

_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"
DEFAULT_MAX_LINE_BYTES = 16 << 20


class SseParser:
    """Feed it the bytes of one stream as they arrive; it returns the data of every event completed so far.

    One parser per stream. `max_line_bytes` bounds the memory a server can make it hold: a line (or an
    event's data) longer than that raises ValueError.
    """

    __slots__ = ("_buffer", "_data", "_data_bytes", "_is_after_cr", "_is_at_start", "max_line_bytes")

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self.max_line_bytes = max_line_bytes
        self._buffer = bytearray()  # the start of a line whose end has not arrived
        self._data: list[bytes] | None = None  # data lines of the event being read (None: no data line yet)
        self._data_bytes = 0
        self._is_at_start = True  # a byte order mark may still come
        self._is_after_cr = False  # the last read ended in CR: an LF first in the next read ends nothing

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data of the events that `chunk` completes, in order (often none, sometimes several)."""
        if not chunk:
            return []
        if self._is_after_cr:
            self._is_after_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buffer = self._buffer
        buffer += chunk
        if self._is_at_start:
            if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
                return []
            self._is_at_start = False
            if buffer.startswith(_BOM):
                del buffer[: len(_BOM)]
        events: list[bytes] = []
        start = 0
        for match in _LINE_END.finditer(buffer):
            self._line(bytes(buffer[start : match.start()]), events)
            start = match.end()
        if start:
            self._is_after_cr = start == len(buffer) and buffer[-1] == 0x0D
            del buffer[:start]
        if len(buffer) > self.max_line_bytes:
            raise ValueError(f"event stream line longer than {self.max_line_bytes} bytes")
        return events

    def _line(self, line: bytes, events: list[bytes]) -> None:
        if not line:
            if self._data is not None:
                events.append(b"\n".join(self._data))
                self._data, self._data_bytes = None, 0
            return
        if line[0] == 0x3A:  # ':' a comment (servers send them as keep-alives)
            return
        name, _, value = line.partition(b":")
        if name != b"data":
            return
        if value[:1] == b" ":
            value = value[1:]
        self._data_bytes += len(value) + 1
        if self._data_bytes > self.max_line_bytes:
            raise ValueError(f"event stream event longer than {self.max_line_bytes} bytes")
        if self._data is None:
            self._data = [value]
        else:
            self._data.append(value)
