"""Stop strings over streamed text: never leak part of a stop sequence, cut at the earliest one."""

from __future__ import annotations

from services.router.stops import StopMatcher


def feed_all(stops: list[str], parts: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for part in parts:
        text, hit = m.feed(part)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_stop_split_across_pieces() -> None:
    assert feed_all(["END"], ["abc E", "N", "D tail"]) == ("abc ", True)


def test_partial_match_released_when_it_diverges() -> None:
    m = StopMatcher(["END"])
    assert m.feed("xE") == ("x", False)
    assert m.feed("Nx") == ("ENx", False)


def test_earliest_of_several_stops_wins() -> None:
    assert feed_all(["b", "zz"], ["azzb"]) == ("a", True)


def test_no_stops_is_passthrough() -> None:
    m = StopMatcher([])
    assert m.feed("hello") == ("hello", False)


def test_flush_returns_held_prefix_at_end() -> None:
    assert feed_all(["STOP"], ["hi ST"]) == ("hi ST", False)
