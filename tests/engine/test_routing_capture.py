"""`RoutingCapture`'s copies in flight (CPU, with stand-in events): applied in forward order once
landed, and `gather` waits only for a copy that writes a slot it reads. The real copies and events
run in the GPU test `test_host_sync.py::test_routing_capture_does_not_wait_for_the_gpu`."""

from __future__ import annotations

import torch

from kiln.engine.routing import RoutingCapture


class FakeEvent:
    def __init__(self):
        self.landed, self.waited = False, 0

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.waited += 1
        self.landed = True


def _in_flight(cap: RoutingCapture, slots: list[int], value: int) -> FakeEvent:
    ev = FakeEvent()
    ids = torch.full((len(slots), cap.num_moe_layers, cap.top_k), value, dtype=torch.int32)
    cap._in_flight.append((ids, torch.tensor(slots), ev))
    return ev


def test_copies_land_in_order_and_gather_waits_only_for_its_slots():
    cap = RoutingCapture(num_pages=4, page_size=4, num_moe_layers=2, top_k=2)
    first, second = _in_flight(cap, [1, 2], 7), _in_flight(cap, [2, 3], 9)  # slot 2 reused: 9 wins
    cap._apply(wait_for=None)
    assert len(cap._in_flight) == 2 and (cap.buffer[1] == -1).all()  # nothing landed yet
    second.landed = True
    cap._apply(wait_for=None)
    assert len(cap._in_flight) == 2  # the second waits behind the first: order is kept
    assert (cap.gather([5, 6, 7]) == -1).all() and first.waited == 0  # slots 5..7: no wait
    got = cap.gather([0, 1, 2, 3])  # slots 0..3: the first copy writes 1 and 2, so it is waited for
    assert first.waited == 1 and second.waited == 0 and not cap._in_flight
    assert (got[0] == -1).all() and (got[1] == 7).all() and (got[2] == 9).all() and (got[3] == 9).all()


def test_gather_waits_when_only_a_later_copy_writes_its_slots():
    cap = RoutingCapture(num_pages=2, page_size=4, num_moe_layers=1, top_k=1)
    first, second = _in_flight(cap, [0], 1), _in_flight(cap, [5], 2)
    got = cap.gather([5])
    assert first.waited == 1 and second.waited == 1 and got[0, 0, 0] == 2
