"""A batch split over several frames: what a connection lost midway sends again."""

from __future__ import annotations

import os

from tests.support import local_agent
from torchpulse.limits import MAX_ITEMS_PER_FRAME
from torchpulse.probes.agent.agent import Agent
from torchpulse.probes.agent.sender import Sender


def test_events_of_frames_already_sent_are_not_queued_again_when_a_later_frame_fails() -> None:
    """Only the events of the failed frame and after go back to the queue: the daemon got the rest."""
    agent = local_agent(("optimizer",), max_pending_events=4 * MAX_ITEMS_PER_FRAME)
    assert isinstance(agent, Agent)
    sender = Sender(agent)
    sent: list[bytes] = []

    def first_frame_only(frame: bytes) -> bool:
        sent.append(frame)
        return len(sent) == 1

    sender.link.send_frame = first_frame_only  # type: ignore[method-assign]
    agent.store.take_changes()  # the agent's counters at 0, sent earlier: this batch is events only
    try:
        for i in range(MAX_ITEMS_PER_FRAME + 500):
            agent.emit("info", "tick", i=i)
        assert not sender._send_changes()
        requeued = agent.take_events(4 * MAX_ITEMS_PER_FRAME)
        assert (2, list(range(MAX_ITEMS_PER_FRAME, MAX_ITEMS_PER_FRAME + 500))) == (
            len(sent),
            [e.fields["i"] for e in requeued],
        )
    finally:
        os.close(sender._wake_r)
        os.close(sender._wake_w)
        agent.shutdown()
