"""`torchpulse` command line: daemon, run, status, check."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    from torchpulse import __version__
    from torchpulse.daemon.log_settings import LOG_FORMATS, LOG_LEVELS

    parser = argparse.ArgumentParser(prog="torchpulse", description="Profiling daemon for PyTorch training jobs.")
    parser.add_argument("--version", action="version", version=f"torchpulse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    daemon = sub.add_parser("daemon", help="run the daemon in the foreground")
    daemon.add_argument("--config", type=str, help="TOML config file (default: embedded defaults)")
    daemon.add_argument("--socket", type=str, help="agent socket path")
    daemon.add_argument("--listen", type=str, help="metrics HTTP listener, HOST:PORT")
    daemon.add_argument("--state-dir", type=str, help="state directory")
    daemon.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        help="log format on stderr (default: the config's, auto: JSON unless stderr is a terminal)",
    )
    daemon.add_argument("--log-level", choices=LOG_LEVELS, help="minimum log level (default: the config's, info)")

    run = sub.add_parser("run", help="run a command with the agent attached (no code change)")
    run.add_argument("--socket", type=str, help="daemon socket (default: TORCHPULSE_SOCKET or the default path)")
    run.add_argument("--run-name", type=str, help="run label (default: TORCHPULSE_RUN or a generated name)")
    run.add_argument("--probes", type=str, help="comma-separated probes to enable")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")

    status = sub.add_parser("status", help="show what the running daemon sees")
    status.add_argument("--socket", type=str, help="daemon socket")
    status.add_argument("--json", action="store_true", help="print JSON")

    attach = sub.add_parser("attach", help="inject the agent into a running process (Python >= 3.14)")
    attach.add_argument("pid", type=int, help="process id of the running Python process")
    attach.add_argument("--socket", type=str, help="daemon socket")
    attach.add_argument("--run-name", type=str, help="run label")

    sub.add_parser("check", help="validate a DCP checkpoint directory", add_help=False)
    _add_ctl(sub)
    return parser


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (msgpack cannot carry larger ones, and agents refuse them)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
        return value

    return parse


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _bounded_float(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _float(text)
        if not (low < value <= high if low_open else low <= value <= high):
            raise argparse.ArgumentTypeError(
                f"must be from {low:g}{' (exclusive)' if low_open else ''} to {high:g}, got {text}"
            )
        return value

    return parse


def _sample_rate(low: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _float(text)
        if value == 0:
            return 0.0  # sampling off
        if not low <= value <= 1:  # NaN fails here too
            raise argparse.ArgumentTypeError(f"must be 0 (off) or from {low:g} to 1, got {text}")
        return value

    return parse


def _add_ctl(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from torchpulse.limits import MAX_COMMAND_TIMEOUT, MAX_LOG_PASSES, MAX_TRACE_STEPS, MIN_SAMPLE_RATE

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run", required=True, help="run to address")
    common.add_argument(
        "--rank", type=_bounded_int(0, 2**63 - 1), action="append", help="rank to address (repeatable; default all)"
    )
    common.add_argument("--socket", type=str, help="daemon socket")
    common.add_argument(
        "--timeout",
        type=_bounded_float(0, MAX_COMMAND_TIMEOUT, low_open=True),
        default=30.0,
        help="seconds to wait for the ranks' answers (a trace answers once its file is written)",
    )
    ctl = sub.add_parser("ctl", help="send a command to the agents of a running job")
    actions = ctl.add_subparsers(dest="action", required=True)
    actions.add_parser("status", parents=[common], help="probes, sampling, buffer fill, last step")
    for name in ("enable", "disable"):
        action = actions.add_parser(name, parents=[common], help=f"{name} a probe at the next step")
        action.add_argument("probe", help="probe name")
    sample = actions.add_parser("sample", parents=[common], help="set a probe's sampling rate, e.g. autograd 0.1")
    sample.add_argument("probe", help="probe name (`autograd`)")
    sample.add_argument("rate", type=_sample_rate(MIN_SAMPLE_RATE), help="0 (off), or from 1e-06 to 1")
    log = actions.add_parser("autograd-log", parents=[common], help="log every autograd node for N passes")
    log.add_argument("passes", type=_bounded_int(1, MAX_LOG_PASSES), help=f"passes to log, 1 to {MAX_LOG_PASSES}")
    trace = actions.add_parser("trace", parents=[common], help="capture a torch.profiler trace of N steps")
    trace.add_argument(
        "--steps", type=_bounded_int(1, MAX_TRACE_STEPS), required=True, help=f"steps to trace, 1 to {MAX_TRACE_STEPS}"
    )
    trace.add_argument("--out", required=True, help="directory for the Chrome-trace JSON files")
    trace.add_argument(
        "--start-step",
        type=_bounded_int(0, 2**63 - 1),
        help="first step to trace (default: the same near step on all ranks)",
    )
    actions.add_parser("cudagraph-dump", parents=[common], help="CUDA-graph tree state, read on the training thread")
    stacks = actions.add_parser(
        "stacks", parents=[common], help="each rank's training thread's Python stack, answered at once"
    )
    stacks.add_argument("--json", action="store_true", help="print the daemon's reply as JSON")
    # Answered by the agent's own thread, not at a step boundary: a rank silent for 5 s is not answering.
    stacks.set_defaults(timeout=5.0)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["daemon"]:
        return _dispatch(args_list)
    try:
        return _dispatch(args_list)
    except BrokenPipeError:
        # `torchpulse check DIR --format json | head`: the reader left. Quiet, like a shell tool (128 + SIGPIPE);
        # stdout now points at /dev/null so the interpreter's own flush at exit cannot fail again.
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        # Ctrl-C while `ctl` or `status` waits for the daemon: the shell's 130, not a traceback.
        return 128 + signal.SIGINT


def _dispatch(args_list: list[str]) -> int:
    if args_list and args_list[0] == "check":
        from torchpulse.checkpoints.cli import main as check_main

        return check_main(args_list[1:])
    args = _parser().parse_args(args_list)
    if args.command == "daemon":
        from torchpulse.daemon.main import run_daemon

        return run_daemon(args.config, args.socket, args.listen, args.state_dir, args.log_format, args.log_level)
    if args.command == "run":
        from torchpulse.launcher import launch

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return launch(cmd, socket=args.socket, run_name=args.run_name, probes=args.probes)
    if args.command == "status":
        return _status(args.socket, args.json)
    if args.command == "ctl":
        return _ctl(args)
    if args.command == "attach":
        from torchpulse.remote_attach import attach_pid

        return attach_pid(args.pid, args.socket, args.run_name)
    return 2


def _client_errors() -> tuple[type[Exception], ...]:
    """What a one-shot request to the daemon can raise; each is reported as one line and status 1.

    The client raises DaemonUnavailable for what it expects; a peer that resets the connection
    (a daemon killed mid-answer), speaks another protocol version or sends garbage surfaces as
    OSError or FrameError, which must not end in a traceback either.
    """
    from torchpulse.daemon.client import DaemonUnavailable
    from torchpulse.protocol import FrameError

    return DaemonUnavailable, FrameError, OSError


def _client_error(path: Path, exc: Exception, socket_arg: str | None = None) -> str:
    """One line for a failed request, escaped: what the peer said (a refusal, an undecodable tag) is its text.

    When nothing listens at `path`, the line says where the path came from and how to name another:
    a daemon started with `--socket` elsewhere is the usual cause.
    """
    from torchpulse.daemon.client import DaemonUnavailable
    from torchpulse.protocol import FrameError
    from torchpulse.terminal import printable

    if isinstance(exc, FrameError):
        return printable(f"torchpulse: unexpected answer from {path}: {exc}")
    if isinstance(exc, OSError):
        return printable(f"torchpulse: lost the connection to the daemon at {path}: {exc.strerror or exc}")
    text = f"torchpulse: {exc}"
    if isinstance(exc, DaemonUnavailable) and str(exc).startswith("no daemon at "):
        if socket_arg:
            text += " (the path given with --socket; is `torchpulse daemon --socket PATH` running?)"
        elif os.environ.get("TORCHPULSE_SOCKET"):
            text += " (from TORCHPULSE_SOCKET; is a daemon listening there?)"
        else:
            text += (
                " (the default path; start `torchpulse daemon`, or name another daemon's socket with "
                "--socket PATH or TORCHPULSE_SOCKET)"
            )
    return printable(text)


def _ctl(args: argparse.Namespace) -> int:
    import msgspec

    from torchpulse.daemon.client import format_ctl, format_stacks, send_ctl
    from torchpulse.paths import agent_socket_path
    from torchpulse.protocol import CtlRequest, FieldValue, utf8

    command_args: dict[str, FieldValue] = {}
    timeout = float(args.timeout)
    if args.action in ("enable", "disable", "sample"):
        command_args["probe"] = utf8(args.probe)
    if args.action == "sample":
        command_args["rate"] = args.rate
    if args.action == "autograd-log":
        command_args["passes"] = args.passes
    if args.action == "trace":
        out = str(Path(args.out).resolve())
        if utf8(out) != out:
            print(f"torchpulse: --out must be a UTF-8 path (commands travel as UTF-8): {out!r}", file=sys.stderr)
            return 2
        command_args.update(steps=args.steps, out=out)
        if args.start_step is not None:
            command_args["start_step"] = args.start_step
    # Agents send undecodable bytes of a run name as "?" (it travels as UTF-8): so does the address.
    # A rank named twice is merged by the daemon, for every client.
    request = CtlRequest(utf8(args.run), args.rank, args.action, command_args, timeout)
    path = Path(args.socket) if args.socket else agent_socket_path()
    try:
        reply = send_ctl(path, request, timeout + 5.0)
    except _client_errors() as exc:
        print(_client_error(path, exc, args.socket), file=sys.stderr)
        return 1
    if args.action == "stacks":
        print(msgspec.json.encode(reply).decode() if args.json else format_stacks(reply))
    else:
        print(format_ctl(reply))
    return 0 if reply.results and all(r.status == "ok" for r in reply.results) else 1


def _status(socket_arg: str | None, as_json: bool) -> int:
    import msgspec

    from torchpulse.daemon.client import format_status, request_status
    from torchpulse.paths import agent_socket_path

    path = Path(socket_arg) if socket_arg else agent_socket_path()
    try:
        reply = request_status(path)
    except _client_errors() as exc:
        print(_client_error(path, exc, socket_arg), file=sys.stderr)
        return 1
    if as_json:
        print(msgspec.json.encode(reply).decode())
    else:
        print(format_status(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main())
