"""positions.not_coming: which positions of another rank tell a rank waiting in an entry check to give up.

Reference: the positions are written out by hand as `positions.in_call` and `in_collective` publish them;
the rule is that a collective this rank has launched already (its number within this rank's count) can
still land, however slow, and one past it cannot while this rank waits.
"""

from zeroshard.comm.watch import positions
from zeroshard.comm.watch.stall import Trace


def _waiting_after(collectives: int) -> dict:
    trace = Trace()
    for i in range(collectives):
        trace.note(f"all_gather {i}")
    return positions.in_call(trace, "save_pretrained", seq=1)


def test_a_collective_this_rank_launched_may_still_land():
    mine = _waiting_after(5)
    assert mine["noted"] == 5
    assert not positions.not_coming(mine, {"where": "collective", "noted": 5})  # its collective number 4
    assert not positions.not_coming(mine, {"where": "collective", "noted": 3})


def test_a_collective_past_this_ranks_is_not_coming():
    assert positions.not_coming(_waiting_after(5), {"where": "collective", "noted": 6})


def test_another_call_or_a_give_up_is_not_coming_and_silence_is_waited_for():
    mine = _waiting_after(2)
    assert positions.not_coming(mine, {"where": "call", "call": "save_checkpoint", "seq": 1})
    assert positions.not_coming(mine, {"where": "call", "call": "save_pretrained", "seq": 1, "state": "gave up"})
    assert not positions.not_coming(mine, {"where": "call", "call": "save_pretrained", "seq": 1})
    assert not positions.not_coming(mine, {"where": "running", "n": 3})
