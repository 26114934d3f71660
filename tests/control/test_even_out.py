"""How many streams each decode worker hands on when the controller evens the pool out."""

from pdserve.control.role_switch import excess_streams


def test_the_excess_over_the_mean_moves():
    # A worker that joined by a switch holds nothing: half of the other's streams move to it.
    assert excess_streams({"d1": 8, "d2": 0}) == {"d1": 4}
    assert excess_streams({"d1": 9, "d2": 3, "d3": 0}) == {"d1": 5}


def test_nothing_moves_for_a_stream_or_two():
    assert excess_streams({"d1": 3, "d2": 1}) == {}
    assert excess_streams({"d1": 5, "d2": 3, "d3": 2}) == {}
    assert excess_streams({"d1": 7}) == {}  # a pool of one has nowhere to move them
    assert excess_streams({}) == {}
