"""The SSE parser follows the WHATWG event stream interpretation for event data, however the bytes arrive."""

from __future__ import annotations

import pytest

from loadgen.sse import SseParser


def parse(*chunks: bytes) -> list[bytes]:
    parser = SseParser()
    return [event for chunk in chunks for event in parser.feed(chunk)]


def every_split(stream: bytes) -> list[list[bytes]]:
    """The events of `stream` fed in two pieces, cut at every position, and fed one byte at a time."""
    outcomes = [parse(stream[:cut], stream[cut:]) for cut in range(len(stream) + 1)]
    outcomes.append(parse(*(stream[i : i + 1] for i in range(len(stream)))))
    return outcomes


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_each_line_end(end: bytes) -> None:
    stream = b"data: one" + end + end + b"data: two" + end + end
    assert parse(stream) == [b"one", b"two"]


def test_mixed_line_ends_in_one_stream() -> None:
    assert parse(b"data: a\r\n\ndata: b\r\rdata: c\n\r\n") == [b"a", b"b", b"c"]


def test_cr_at_the_end_of_a_read_and_lf_at_the_start_of_the_next_are_one_line_end() -> None:
    parser = SseParser()
    assert parser.feed(b"data: x\r") == []
    assert parser.feed(b"\n\r") == [b"x"]  # "\r\n" ended the data line, "\r" the event; no empty line between
    assert parser.feed(b"\ndata: y\r\n\r\n") == [b"y"]  # that LF completed "\r\n"; it is no blank line


def test_lone_cr_then_lf_in_the_next_read_dispatches_once() -> None:
    parser = SseParser()
    assert parser.feed(b"data: x\r\n\r") == [b"x"]
    assert parser.feed(b"\ndata: y\n") == []  # this LF belongs to the CR before it: no second dispatch
    assert parser.feed(b"\n") == [b"y"]


def test_comments_are_ignored() -> None:
    stream = b": keep-alive\n\n:\ndata: a\n: between data lines\ndata: b\n\n"
    assert parse(stream) == [b"a\nb"]


def test_space_after_the_colon_is_optional_and_only_one_is_dropped() -> None:
    assert parse(b"data:tight\n\n", b"data: one\n\n", b"data:  two\n\n") == [b"tight", b"one", b" two"]


def test_several_data_lines_join_with_lf() -> None:
    assert parse(b'data: {\ndata:   "a": 1\ndata: }\n\n') == [b'{\n  "a": 1\n}']


def test_empty_data_and_data_without_colon_make_events() -> None:
    assert parse(b"data\n\n", b"data:\n\n", b"data\ndata\n\n") == [b"", b"", b"\n"]


def test_an_empty_line_without_data_dispatches_nothing() -> None:
    assert parse(b"\n\n\r\n", b"event: ping\nid: 7\nretry: 100\n\n") == []


def test_other_fields_are_ignored() -> None:
    stream = b"event: message\nid: 3\nretry: 10\ndatum: no\nDATA: no\nfoo\ndata: yes\n\n"
    assert parse(stream) == [b"yes"]


def test_colons_in_the_value_are_kept() -> None:
    assert parse(b'data: {"a": "b:c"}\n\n') == [b'{"a": "b:c"}']


def test_an_event_cut_off_by_the_end_of_the_stream_is_not_dispatched() -> None:
    assert parse(b"data: whole\n\ndata: cut off\n") == [b"whole"]


def test_a_leading_byte_order_mark_is_dropped_even_when_split() -> None:
    assert parse(b"\xef\xbb", b"\xbfdata: a\n\n") == [b"a"]
    assert parse(b"\xef\xbb\xbf: comment\ndata: b\n\n") == [b"b"]


def test_utf8_split_inside_a_character() -> None:
    text = 'data: {"text": "naïve ✓ 🙂"}\n\n'.encode()
    (event,) = parse(text[:19], text[19:22], text[22:])
    assert event.decode() == '{"text": "naïve ✓ 🙂"}'


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_the_same_events_however_the_stream_is_split(end: bytes) -> None:
    lines = [b": hello", b'data: {"t": "\xc3\xa9\xe2\x9c\x93"}', b""]
    lines += [b"data:a", b"data: b", b"id: 1", b"", b"event: x", b"", b"data: [DONE]", b""]
    stream = end.join(lines) + end
    expected = [b'{"t": "\xc3\xa9\xe2\x9c\x93"}', b"a\nb", b"[DONE]"]
    assert all(outcome == expected for outcome in every_split(stream))


def test_an_endless_line_is_refused() -> None:
    parser = SseParser(max_line_bytes=16)
    assert parser.feed(b"data: 0123456789") == []
    with pytest.raises(ValueError, match="longer than 16 bytes"):
        parser.feed(b"abcdef")


def test_an_endless_event_is_refused() -> None:
    parser = SseParser(max_line_bytes=16)
    with pytest.raises(ValueError, match="longer than 16 bytes"):
        parser.feed(b"data: 0123456789\n" * 3)
