"""A minimal protocol-speaking agent for hostile tests: Hello, then Batches of running totals."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from torchpulse.protocol import Batch, Hello, Sample, encode


class RawAgent:
    """One rank's connection that reports `optimizer_steps_total` as the real agent would."""

    def __init__(self, socket_path: Path, run: str, rank: int = 0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(socket_path))
        self.sock.sendall(encode(Hello(run, rank, rank, 1, os.getpid(), "h", "2.13.0", "0.1.0", "test", time.time())))
        self.sock.recv(4096)  # Welcome
        self.seq = 0

    def send(self, samples: list[Sample]) -> None:
        self.seq += 1
        self.sock.sendall(encode(Batch(self.seq, time.time(), samples, [], [])))

    def steps(self, total: int) -> None:
        self.send([Sample("optimizer_steps_total", ("SGD#0",), float(total))])

    def close(self) -> None:
        self.sock.close()
