"""A `torchpulse ctl` connection: one request, routed by the control hub, and its reply.

A ctl client sends one frame, then only waits: the end of its stream means it hung up (Ctrl-C), and the
command is dropped at once. Waiting on for a hung rank's answer (up to an hour) held one of the
connections kept for status and ctl, so a few abandoned commands could lock operators out.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from torchpulse.daemon.control import ControlHub, NotAuthorized, logged_ranks
from torchpulse.daemon.logs import cut
from torchpulse.daemon.peercred import Peer
from torchpulse.daemon.writes import drain
from torchpulse.limits import MAX_NAME_CHARS
from torchpulse.protocol import CtlReply, CtlRequest, ErrorReply, FrameError, encode

log = structlog.get_logger("torchpulse.daemon.server")


async def serve_ctl(
    control: ControlHub,
    request: CtlRequest,
    peer: Peer | None,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    reached: list[int] = []
    handling = asyncio.ensure_future(control.handle(request, peer, reached))
    hangup = asyncio.ensure_future(reader.read(1))
    sent_more = False
    try:
        await asyncio.wait((handling, hangup), return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if hangup.done() and not hangup.cancelled():
            # A reset connection is a hang-up too (retrieved, so asyncio does not log it); bytes are not.
            sent_more = hangup.exception() is None and bool(hangup.result())
        if not handling.done():
            handling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handling  # unwinds at once: its commands leave the table of answers awaited
    if handling.cancelled() and sent_more:
        # Not a hang-up: a client that is still there is told why it gets no answer.
        raise FrameError(
            "unexpected_type",
            "a ctl connection carries one request and then waits for the "
            f"reply, but more bytes followed it: the {cut(request.name, MAX_NAME_CHARS)!r} "
            f"command for run {cut(request.run, MAX_NAME_CHARS)!r} was dropped (ranks it "
            "reached may still apply it)",
        )
    if handling.cancelled():
        log.info(
            "command abandoned by its client; ranks it reached may still apply it",
            command=cut(request.name, MAX_NAME_CHARS),
            run=cut(request.run, MAX_NAME_CHARS),
            ranks_reached=logged_ranks(reached),
            uid=peer.uid if peer else None,
            pid=peer.pid if peer else None,
        )
        return
    try:
        reply: CtlReply | ErrorReply = handling.result()
    except NotAuthorized as exc:
        log.warning(
            "command refused",
            command=cut(request.name, MAX_NAME_CHARS),
            run=cut(request.run, MAX_NAME_CHARS),
            uid=peer.uid if peer else None,
            pid=peer.pid if peer else None,
            reason=str(exc),
        )
        reply = ErrorReply("not_authorized", str(exc))
    writer.write(encode(reply))
    await drain(writer)
