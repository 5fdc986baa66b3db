"""`torchpulse` command line: daemon, run, status, check."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchpulse", description="Profiling daemon for PyTorch training jobs.")
    sub = parser.add_subparsers(dest="command", required=True)

    daemon = sub.add_parser("daemon", help="run the daemon in the foreground")
    daemon.add_argument("--config", type=str, help="TOML config file (default: embedded defaults)")
    daemon.add_argument("--socket", type=str, help="agent socket path")
    daemon.add_argument("--listen", type=str, help="metrics HTTP listener, HOST:PORT")
    daemon.add_argument("--state-dir", type=str, help="state directory")

    run = sub.add_parser("run", help="run a command with the agent attached (no code change)")
    run.add_argument("--socket", type=str, help="daemon socket (default: TORCHPULSE_SOCKET or the default path)")
    run.add_argument("--run-name", type=str, help="run label (default: TORCHPULSE_RUN or a generated name)")
    run.add_argument("--probes", type=str, help="comma-separated probes to enable")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")

    status = sub.add_parser("status", help="show what the running daemon sees")
    status.add_argument("--socket", type=str, help="daemon socket")
    status.add_argument("--json", action="store_true", help="print JSON")

    sub.add_parser("check", help="validate a DCP checkpoint directory", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "check":
        from torchpulse.checkpoints.cli import main as check_main

        return check_main(args_list[1:])
    args = _parser().parse_args(args_list)
    if args.command == "daemon":
        from torchpulse.daemon.main import run_daemon

        return run_daemon(args.config, args.socket, args.listen, args.state_dir)
    if args.command == "run":
        from torchpulse.launcher import launch

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return launch(cmd, socket=args.socket, run_name=args.run_name, probes=args.probes)
    if args.command == "status":
        return _status(args.socket, args.json)
    return 2


def _status(socket_arg: str | None, as_json: bool) -> int:
    from pathlib import Path

    import msgspec

    from torchpulse.daemon.client import DaemonUnavailable, format_status, request_status
    from torchpulse.paths import agent_socket_path

    path = Path(socket_arg) if socket_arg else agent_socket_path()
    try:
        reply = request_status(path)
    except DaemonUnavailable as exc:
        print(f"torchpulse: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(msgspec.json.encode(reply).decode())
    else:
        print(format_status(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main())
