"""`ConnectionShares` on stand-in connections: nothing is closed within the cap or for a lone
address; beyond the cap, the stalled connections of addresses over an equal share are, largest
holder and oldest first, never one serving a whole request, never a holder below its share."""

from __future__ import annotations

import pytest

from deepinfer.api.http.connections import ConnectionShares, SharedConnection


class Conn:
    def __init__(self, client_key: str, *, stalled: bool = True) -> None:
        self.client_key = client_key
        self.stalled = stalled
        self.evicted = False

    def is_stalled(self) -> bool:
        return self.stalled

    def evict(self) -> None:
        self.evicted = True


def open_all(shares: ConnectionShares, conns: list[Conn]) -> list[SharedConnection]:
    taken: list[SharedConnection] = []
    for conn in conns:
        taken += shares.open(conn)
        shares.check_integrity()
    return taken


def test_nothing_is_taken_within_the_cap() -> None:
    shares = ConnectionShares(4)
    assert open_all(shares, [Conn("a"), Conn("a"), Conn("b"), Conn("c")]) == []
    assert shares.num_open == 4


def test_a_lone_address_keeps_the_whole_cap_and_more() -> None:
    shares = ConnectionShares(3)
    assert open_all(shares, [Conn("a") for _ in range(5)]) == []
    assert shares.num_open == 5 and shares.num_held("a") == 5


def test_the_largest_holder_gives_up_its_oldest_stalled_connection() -> None:
    shares = ConnectionShares(4)
    held = [Conn("h", stalled=False), Conn("h"), Conn("h"), Conn("h")]
    open_all(shares, held)
    assert shares.open(Conn("v")) == [held[1]]  # the oldest is busy: the next oldest goes
    shares.check_integrity()
    assert shares.num_open == 4 and shares.num_held("h") == 3
    newcomer = Conn("h")
    assert shares.open(newcomer) == [held[2]]  # the holder's own newcomer costs it its oldest
    shares.check_integrity()


def test_a_newcomer_over_its_share_is_refused_when_its_others_are_busy() -> None:
    shares = ConnectionShares(4)
    open_all(shares, [Conn("h", stalled=False) for _ in range(3)] + [Conn("v")])
    newcomer = Conn("h")
    assert shares.open(newcomer) == [newcomer]
    shares.check_integrity()


def test_busy_connections_are_kept_even_beyond_the_cap() -> None:
    shares = ConnectionShares(2)
    open_all(shares, [Conn("h", stalled=False), Conn("h", stalled=False)])
    assert shares.open(Conn("v")) == []
    assert shares.num_open == 3
    shares.check_integrity()


def test_no_holder_is_taken_below_its_share() -> None:
    shares = ConnectionShares(6)
    open_all(shares, [Conn("a") for _ in range(4)] + [Conn("b") for _ in range(2)])
    big = [Conn("c") for _ in range(3)]
    taken = open_all(shares, big)  # share 2: "a" gives up 2, then "c" its own oldest
    assert [c.client_key for c in taken] == ["a", "a", "c"]
    assert shares.num_held("a") == 2 and shares.num_held("b") == 2 and shares.num_held("c") == 2
    assert taken[-1] is big[0]


def test_closing_twice_or_after_being_taken_is_harmless() -> None:
    shares = ConnectionShares(1)
    first, second = Conn("a"), Conn("b")
    shares.open(first)
    assert shares.open(second) == [first]
    shares.close(first)
    shares.close(second)
    shares.close(second)
    shares.check_integrity()
    assert shares.num_open == 0


@pytest.mark.parametrize("num_clients", [2, 3, 7])
def test_every_address_keeps_at_least_its_share(num_clients: int) -> None:
    cap = 12
    shares = ConnectionShares(cap)
    open_all(shares, [Conn("hog") for _ in range(cap)])
    for i in range(1, num_clients):
        open_all(shares, [Conn(f"c{i}") for _ in range(cap // num_clients)])
    assert shares.num_open == cap
    for key in ["hog", *(f"c{i}" for i in range(1, num_clients))]:
        assert shares.num_held(key) >= cap // num_clients
