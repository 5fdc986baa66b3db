"""Every bound of the agent, the daemon and the exposition, each with one line of why.

A bound keeps what one peer sends (a buggy or hostile agent, a client that stops reading, a scraper crowd)
from costing the daemon, the node's journal or the training job more than its share. Values that operators
tune live in the daemon's config file instead; these are fixed by design. Each module
imports the bounds it enforces from here, so that this file is the one list to read and to review.
"""

from __future__ import annotations

from typing import Final

# -- the wire (agent <-> daemon) --------------------------------------------------------------------------
# Command arguments: the agent enforces these (it is the one that pays); `torchpulse ctl` checks them first,
# so that a typo fails at once.

MAX_FRAME_BYTES: Final = 4 * 1024 * 1024
"""Fits a full snapshot of a busy rank; a hostile length prefix cannot make the daemon allocate much."""

MAX_TRACE_STEPS: Final = 100
"""A torch.profiler trace holds every event of its steps in the job's memory until it stops."""

MAX_STACK_FRAMES: Final = 64
"""Frames of a stalled or asked-for training thread's stack: the innermost, where it waits, are the ones kept."""

MAX_STACK_CHARS: Final = 4000
"""Characters of such a stack, its innermost end, within MAX_FIELD_CHARS: one journal line per stall."""

MAX_LOG_PASSES: Final = 100
"""Autograd logging hooks every node of a logged pass and emits one event per node."""

MIN_SAMPLE_RATE: Final = 1e-6
"""`sample RATE` times one pass in round(1/RATE): a longer period would never come round (0 is off)."""

MAX_COMMAND_TIMEOUT: Final = 3600.0
"""How long a command may wait for its answers; longer, and a client's typo holds the daemon for days."""

# -- the agent, inside the training process ---------------------------------------------------------------

MAX_FIELD_CHARS: Final = 4096
"""One agent event field: keeps one hostile recompile reason from filling a frame."""

MAX_TRACEBACK_CHARS: Final = 4000
"""A probe's error traceback keeps its end, within MAX_FIELD_CHARS."""

MAX_REQUESTED_EVENTS: Final = 50_000
"""Bulk events asked for (`ctl autograd-log 10` of a 5,000-node model, ~500 B each); past it, events_overflow."""

MAX_ITEMS_PER_FRAME: Final = 2000
"""Keeps usual frames far below MAX_FRAME_BYTES (a larger one is halved)."""

MAX_PENDING_COMMANDS: Final = 32
"""Commands waiting for the next step boundary; a peer flooding more gets "busy", not the job's memory."""

SHOWN_COMMAND_CHARS: Final = 256
"""The job's command line as run_info carries it, a label value."""

MAX_CAUSE_CHARS: Final = 200
"""The exception that ended the job, as the agent's goodbye names it."""

MAX_ERROR_CHARS: Final = 64
"""A failed save's `error` label, a class name: well below MAX_LABEL_CHARS, past which the daemon refuses it."""

MAX_ERROR_LABELS: Final = 8
"""Distinct `error` names per process that keep a series of their own; later ones count under "other"."""

MAX_MESSAGE_CHARS: Final = 500
"""A failed save's message in the agent's event."""

MAX_GRAPH_DEPTH: Final = 10_000
"""Levels an autograd graph walk goes down: freeing a walked chain ~45,000 deep overflows the stack (torch 2.13)."""

MAX_SYMINT_IDS: Final = 4096
"""Compile ids whose first new shape was seen (a torch without the cudagraph trees' frames only)."""

MAX_GRAPH_BREAK_KINDS: Final = 50
"""Graph-break types come from Dynamo's registry (a few hundred); bounded anyway."""

MAX_COMPILE_FRAMES: Final = 4096
"""Frame ids are per code object; all are forgotten when a job churns through code."""

MAX_CHUNKS_PER_READ: Final = 16
"""Socket reads (64 KiB each) the sender handles before it gets back to its own cycle."""

MAX_RUN_CHARS_IN_NAME: Final = 64
"""The run's part of a trace file name: long enough to recognise, short of NAME_MAX (255)."""

MAX_TRACE_DIR_CHARS: Final = 4096
"""The directory a trace command names (PATH_MAX)."""

# -- the daemon's agent socket ----------------------------------------------------------------------------

FIRST_FRAME_TIMEOUT: Final = 10.0
"""A peer that connects and says nothing is dropped after this long."""

FRAME_BODY_TIMEOUT: Final = 30.0
"""Once a header arrived, its body must follow: a peer cannot park a half-sent frame for ever."""

AGENT_IDLE_TIMEOUT: Final = 120.0
"""An agent sends a heartbeat every 5 s; one silent this long is gone (a frozen host, a half-open socket)."""

AGENT_SOCKET_MAX_CONNECTIONS: Final = 1024
"""Connections at once, before the daemon runs out of descriptors (lowered to fit RLIMIT_NOFILE)."""

FD_RESERVE: Final = 128
"""Descriptors kept out of the connection limit: scrapes, the state store, watchers, workers."""

CLIENT_RESERVE: Final = 32
"""Connections agents may not take, so `torchpulse status` and `ctl` get in while hellos flood the rest."""

MAX_BUFFERED_BYTES: Final = 64 << 20
"""Bodies of large frames being read, all connections together; one frame may always proceed alone."""

SMALL_FRAME_BYTES: Final = 64 << 10
"""Frames this small skip that budget: an agent's usual batches never queue behind peers parking big ones."""

AGENT_SOCKET_WRITE_TIMEOUT: Final = 10.0
"""A peer that stops reading what the daemon writes it is cut off: it held a slot and the reply for ever."""

MAX_STATUS_SPACING: Final = 5.0
"""One status build serves all the requests waiting; the next waits as long as the last took, at most this."""

MAX_STATUS_HELD_BYTES: Final = 64 << 20
"""Status replies held for clients that have not read them, all together (a reply is up to 4 MiB)."""

STATUS_WRITE_CHUNK: Final = 64 << 10
"""A status reply is copied to a client's transport a chunk at a time, as it reads."""

STUCK_STATUS_SECONDS: Final = 1.0
"""At the connection limit, a status client still writing after this long gives way to a new connection."""

MAX_DETAIL_CHARS: Final = 1000
"""A rejection's detail can quote the frame: the peer gets back no megabyte it sent."""

REJECT_LOG_INTERVAL: Final = 10.0
"""Rejection warnings, per reason: a hostile client must not flood the journal."""

# -- what agents and clients make the daemon hold and log ------------------------------------------------
# journald splits a line longer than its LineMax (48 KiB by default) into entries that are no longer JSON.

MAX_TEXT_CHARS: Final = 4096
"""One text a peer puts into the daemon's log (agents cut their own fields at MAX_FIELD_CHARS too)."""

MAX_NAME_CHARS: Final = 200
"""Event names, field names, run and command names in the daemon's log."""

MAX_FIELDS: Final = 32
"""Fields of one agent event the daemon logs."""

MAX_EVENT_CHARS: Final = 16384
"""All of one event's fields together: a log line stays well inside journald's LineMax."""

MAX_LOGGED_RANKS: Final = 64
"""Ranks a "command received" line lists; a client may address thousands (or send a list of millions)."""


MAX_LABEL_CHARS: Final = 200
"""A label value (a run name, a host): one long name is copied into thousands of rendered series."""

MAX_COMMAND_CHARS: Final = 512
"""run_info's command line; agents cut it at SHOWN_COMMAND_CHARS."""

MAX_HISTOGRAM_BOUNDS: Final = 256
"""More bucket bounds than any real layout has: a hello must not make the daemon hold or walk megabytes."""

EVENT_LOG_BURST: Final = 10_000
"""An agent's log events the daemon writes at once (its full event queue several times over)."""

EVENT_LOG_RATE: Final = 20.0
"""Then this many a second: past it, a flood would fill the journal and its rate limit drop other lines."""

NODE_LOG_BURST: Final = 250_000
"""`autograd.node` events, asked for with `ctl autograd-log`: a large model's request, in a bucket of its own."""

NODE_LOG_RATE: Final = 2_000.0
"""Then this many a second."""

SUPPRESSED_REPORT_INTERVAL: Final = 60.0
"""While a rank's events are suppressed, how often the daemon says how many."""

# -- the checkpoint watcher -------------------------------------------------------------------------------

MAX_PATH_BYTES: Final = 4095
"""Longer paths cannot be opened (PATH_MAX)."""

MAX_LOGGED_ONCE: Final = 1024
"""Distinct refused or folded paths remembered for log-once; a node starting a job an hour never grows it."""

MAX_PENDING_ANNOUNCEMENTS: Final = 64
"""Announcements of one connection waiting for their check: a job sends one per save, a longer queue floods."""

MAX_ANNOUNCED_SUFFIX_PARTS: Final = 16
"""Trailing components of a container's path tried under each configured root: one stat each, never a walk."""

MAX_SCAN_DEPTH: Final = 4
"""Checkpoints sit a few levels under a root (root/run/step-N); deeper trees are not walked."""

MAX_WORKER_OUTPUT_BYTES: Final = 16 << 20
"""The end of a validation worker's stdout kept (its one JSON line): a runaway worker cannot fill memory."""

MAX_WORKER_STDERR_BYTES: Final = 64 << 10
"""A worker's stderr kept: the last line of a crash's message is all it gives."""

SETTLE_SECONDS: Final = 10.0
"""How long start and a sweep wait for a root's watch or scan; a hung mount's goes on, its root skipped."""

# -- the exposition (/metrics) ----------------------------------------------------------------------------

HTTP_MAX_HEADER_BYTES: Final = 8192
"""A request's head; a longer one is answered 431 and closed."""

HTTP_HEADER_TIMEOUT: Final = 5.0
"""A request's head must arrive within this long (slowloris)."""

HTTP_IDLE_TIMEOUT: Final = 60.0
"""A kept-alive connection with no request this long is closed."""

HTTP_MAX_CONNECTIONS: Final = 256
"""Scrape connections at once; past it, a new one is refused before the daemon runs out of descriptors."""

HTTP_WRITE_TIMEOUT: Final = 30.0
"""A client that leaves a response unread this long is cut off: it held a slot and a rendered body."""

HTTP_MAX_HELD_BYTES: Final = 128 << 20
"""Response bodies held for clients that have not read them, all together (one is tens of MB on a busy node)."""

HTTP_WRITE_CHUNK: Final = 256 << 10
"""A response is copied to a client's transport a chunk at a time, as it reads."""

MAX_RENDER_REUSE_SECONDS: Final = 5.0
"""A render is served again to scrapes within the time it took (at most this): a crowd costs one render."""

HTTP_LINGER_TIMEOUT: Final = 2.0
"""After an error answer, how long what the client still sends is read and dropped."""
