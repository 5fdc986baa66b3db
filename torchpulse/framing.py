"""Incremental frame reader over a byte stream (used by the blocking agent side)."""

from __future__ import annotations

from torchpulse.protocol import HEADER_SIZE, parse_header


class FrameReader:
    """Accumulates received bytes and yields complete frame bodies."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        bodies: list[bytes] = []
        while len(self._buffer) >= HEADER_SIZE:
            length = parse_header(bytes(self._buffer[:HEADER_SIZE]))
            end = HEADER_SIZE + length
            if len(self._buffer) < end:
                break
            bodies.append(bytes(self._buffer[HEADER_SIZE:end]))
            del self._buffer[:end]
        return bodies
