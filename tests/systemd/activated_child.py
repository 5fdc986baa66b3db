"""Stand-in for the daemon under socket activation: report what listen_fds() found.

With --serve it also answers one client on the first passed socket, proving the
socket works. The report is one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import sys

from torchpulse.daemon import systemd


def main() -> None:
    passed = systemd.listen_fds_with_names()
    report = {
        "pid": os.getpid(),
        "names": [name for name, _sock in passed],
        "fds": [sock.fileno() for _name, sock in passed],
        "families": [sock.family.name for _name, sock in passed],
        "inheritable": [os.get_inheritable(sock.fileno()) for _name, sock in passed],
        "listen_env_left": sorted(key for key in os.environ if key.startswith("LISTEN_")),
    }
    if passed and "--serve" in sys.argv:
        conn, _ = passed[0][1].accept()
        with conn:
            conn.sendall(b"echo:" + conn.recv(64))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
