"""`make gpu-check`: torchpulse on a CUDA machine, end to end, in one command of at most four minutes.

    python bench/gpu_check.py               # on a CUDA machine; fails where there is none
    python bench/gpu_check.py --dry-run     # anywhere: every CUDA step SKIPPED, the CPU parts run for real
    python bench/gpu_check.py --download-wheels   # on a machine with PyPI: the wheels the GPU machine lacks

Steps, each printing what it checked and PASS, FAIL or SKIPPED(reason); the exit status is 1 on any FAIL:

0. dependencies: msgspec, structlog, watchdog (and hypothesis, for tests/conftest.py) importable, else
   installed with `pip install --no-index --target $TMPDIR/torchpulse-gpu-site-cpXY` from the wheels in
   --wheels (bench/gpu_wheels/, git-ignored: it travels to the GPU machine as a carried path);
1. the `cuda`-marked tests (`pytest -m cuda` on the test files that carry the mark);
2. a real daemon, and a small training job under `torchpulse run` (bench/gpu_check_job.py `train`): on CUDA
   compiled with `mode="reduce-overhead"` (recordings, new shapes, a re-recording, a mutated input and a CPU
   op that skip CUDA graphs, optimizers with and without `capturable`, a NaN gradient on the GPU, steps under
   `torch.cuda.set_sync_debug_mode("error")`); on CPU the same job with the default mode;
3. a 2-rank job (torchrun, gloo; on CUDA both ranks on the one GPU, which NCCL refuses) and a DCP save of
   its state, validated by the daemon;
4. the overhead benchmarks on the GPU, side by side in one run (bench/gpu_overhead.py); on CPU a smoke run of
   the same code, budgets not judged;
5. every `torchpulse_cudagraph_*`, optimizer readiness and `torchpulse_grad_*` line of the training job, each
   compared with what torch itself counted (Dynamo's counters, the CUDA-graph trees) where torch has it;
6. what node timing measures on CUDA.

Steps 1 to 3 run at the same time (one daemon, runs of their own names), the benchmarks alone after them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

JOB = REPO / "bench" / "gpu_check_job.py"
OVERHEAD = REPO / "bench" / "gpu_overhead.py"
WHEELS = REPO / "bench" / "gpu_wheels"
# What the GPU machine lacks: the project's own dependencies but torch and prometheus-client, and the test
# suite's conftest's. Pins as in pyproject.toml.
WHEEL_REQUIREMENTS = ("msgspec>=0.18", "structlog>=24.1", "watchdog>=4.0", "hypothesis>=6.100")
RUNTIME_MODULES = ("msgspec", "structlog", "watchdog", "prometheus_client")
TEST_MODULES = ("pytest", "hypothesis")
WHEEL_MODULES = ("msgspec", "structlog", "watchdog", "hypothesis")  # what the wheels bring
BUDGET_SECONDS = 240.0
TRAIN_RUN, RANKS_RUN = "gpu-check-train", "gpu-check-ranks"
RANK_STEPS = 4
CUDA_MARK = re.compile(r"pytest\.mark\.cuda\b")
# Readiness families of the optimizer (the cudagraphs probe's), not its step time or state size.
READINESS = ("nonstatic_grads", "moving_grads", "capturable", "cpu_step_tensors")
NODE_TIMING_NOTE = (
    "node timing on CUDA measures the host side of each autograd node: its Python and C++ and the launch of its "
    "kernels, which then run asynchronously on the device; not the kernels' run time (a node that syncs, with "
    "an .item() or a blocking copy, shows the wait). backward_duration_seconds is host time too, until the engine "
    "returns. Device time per node needs a profiler trace (`torchpulse ctl trace`)."
)


# -- the report ------------------------------------------------------------------------------------------------


@dataclass
class Line:
    verdict: str  # PASS, FAIL or SKIPPED
    what: str
    reason: str = ""

    def render(self) -> str:
        verdict = f"SKIPPED({self.reason})" if self.verdict == "SKIPPED" else self.verdict
        return f"  {verdict}  {self.what}"


@dataclass
class Step:
    number: int
    title: str
    lines: list[Line] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def check(self, ok: bool, what: str) -> bool:
        self.lines.append(Line("PASS" if ok else "FAIL", what))
        return ok

    def equal(self, what: str, metrics: object, expected: object, source: str = "torch") -> bool:
        """PASS when /metrics shows what `source` (torch, or the job) counted."""
        return self.check(metrics == expected, f"{what}: /metrics {metrics!r} == {source} {expected!r}")

    def skip(self, what: str, reason: str) -> None:
        self.lines.append(Line("SKIPPED", what, reason))

    def note(self, text: str) -> None:
        self.notes.extend(text.rstrip("\n").splitlines())

    @property
    def verdict(self) -> str:
        verdicts = {line.verdict for line in self.lines}
        if "FAIL" in verdicts:
            return "FAIL"
        if "PASS" in verdicts:
            return "PASS"
        return "SKIPPED"

    @property
    def summary(self) -> str:
        """The verdict, with how many checks were SKIPPED when others ran."""
        skipped = sum(line.verdict == "SKIPPED" for line in self.lines)
        return f"{self.verdict}, {skipped} SKIPPED" if skipped and self.verdict != "SKIPPED" else self.verdict

    def render(self) -> str:
        head = f"== {self.number}. {self.title} ({self.seconds:.1f} s): {self.summary}"
        return "\n".join([head, *(f"   {n}" for n in self.notes), *(line.render() for line in self.lines)])


# -- what a scrape says ------------------------------------------------------------------------------------------

Sample = tuple[str, dict[str, str], float]


def parse(exposition: str) -> list[Sample]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (sample.name, dict(sample.labels), float(sample.value))
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    ]


def series(samples: list[Sample], name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    """`name`'s samples whose labels include `labels`, by their other labels."""
    return {
        tuple(sorted((k, v) for k, v in got.items() if k not in labels)): value
        for sample_name, got, value in samples
        if sample_name == name and all(got.get(k) == v for k, v in labels.items())
    }


def by(samples: list[Sample], name: str, label: str, **labels: str) -> dict[str, float]:
    """`name`'s samples whose labels include `labels`, by the value of `label`."""
    return {dict(key).get(label, ""): value for key, value in series(samples, name, **labels).items()}


def one(samples: list[Sample], name: str, **labels: str) -> float | None:
    values = list(series(samples, name, **labels).values())
    return values[0] if len(values) == 1 else None


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def exposition_lines(text: str, run: str, prefixes: tuple[str, ...]) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefixes) and f'run="{run}"' in line]


# -- the run's shared parts --------------------------------------------------------------------------------------


@dataclass
class Context:
    cuda: bool
    workdir: Path
    env: dict[str, str]
    socket_path: Path
    url: str
    log_path: Path
    train: dict[str, Any] | None = None  # the training job's record, for step 5
    train_exposition: str = ""

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def run(self, cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
        """`cmd` to its end, or killed with everything it started (torchrun's ranks) after `timeout`."""
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**self.env, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n(killed after {timeout:.0f} s)"
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def under_torchpulse(self, run: str) -> list[str]:
        """`torchpulse run` for `run`, with this check's daemon; the command follows `--`."""
        return [sys.executable, "-m", "torchpulse", "run", "--socket", str(self.socket_path), "--run-name", run]

    def samples(self) -> list[Sample]:
        return parse(scrape(self.url))

    def daemon_events(self, run: str) -> list[dict[str, Any]]:
        """The daemon's JSON log lines about `run` (agents' events carry run and rank)."""
        events = []
        for text in self.log_path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(text)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("run") == run:
                events.append(entry)
        return events

    def wait_exited(self, run: str, ranks: set[str], timeout: float = 30.0) -> bool:
        """Whether every rank of `ranks` said goodbye (its last totals are in) within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            exited = by(self.samples(), "torchpulse_agent_exited", "rank", run=run)
            if all(exited.get(rank) == 1.0 for rank in ranks):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _agent_health(step: Step, ctx: Context, samples: list[Sample], run: str) -> None:
    """No probe of the run failed (a failed probe is counted and disables itself: its metrics would stop)."""
    errors = {
        probe: v for probe, v in by(samples, "torchpulse_agent_probe_errors_total", "probe", run=run).items() if v
    }
    if not step.check(not errors, f"no probe errors in run {run} (torchpulse_agent_probe_errors_total: {errors or 0})"):
        for event in ctx.daemon_events(run):
            if event.get("level") in ("warning", "error"):
                step.note(f"daemon log: {json.dumps(event, sort_keys=True)[:600]}")
    dropped = sum(by(samples, "torchpulse_agent_events_dropped_total", "reason", run=run).values())
    step.check(dropped == 0, f"the agents dropped no events (torchpulse_agent_events_dropped_total: {dropped:g})")


def _job_ran(step: Step, done: subprocess.CompletedProcess[str], what: str) -> bool:
    ok = step.check(done.returncode == 0, f"{what} exited {done.returncode}")
    if not ok:
        # torchrun's own traceback comes last: the ranks' errors first.
        errors = [
            line for line in done.stderr.splitlines() if re.match(r"(\[rank\d+\]: )?\w+(Error|Exception)\b", line)
        ]
        step.note("\n".join([*errors[:6], tail(done.stderr or done.stdout, 30)]))
    # The agent is silent when all is well: any line of its own says it could not attach or send.
    ours = [line for line in done.stderr.splitlines() if line.startswith("torchpulse")]
    step.check(not ours, f"no torchpulse lines on the job's stderr{': ' + ours[0] if ours else ''}")
    return ok


# -- step 0: dependencies ----------------------------------------------------------------------------------------


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def dependencies(step: Step, wheels: Path) -> list[str]:
    """Install what is missing from `wheels`; the directories to put on every child's PYTHONPATH."""
    missing = _missing(RUNTIME_MODULES + TEST_MODULES)
    if not missing:
        step.check(True, f"{', '.join(RUNTIME_MODULES + TEST_MODULES)} importable: nothing to install")
        return []
    # Outside the tree (mypy checks all of bench/), kept for a rerun on the same machine.
    site = Path(tempfile.gettempdir()) / f"torchpulse-gpu-site-cp{sys.version_info.major}{sys.version_info.minor}"
    if not all(_in(site, module) for module in missing if module in WHEEL_MODULES):
        files = sorted(str(p) for p in wheels.glob("*.whl"))
        if not files:
            step.check(
                False,
                f"{', '.join(missing)} missing and no wheels in {wheels} (on a machine with PyPI: "
                "python bench/gpu_check.py --download-wheels, then carry that folder here)",
            )
            return []
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--quiet", "--target", str(site), *files]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if not step.check(done.returncode == 0, f"pip install --no-index --target {site} ({len(files)} wheels)"):
            step.note(tail(done.stderr))
            return []
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    still = _missing(RUNTIME_MODULES + TEST_MODULES)
    step.check(
        not still,
        f"{', '.join(missing)} importable from {site}" + (f" (still missing: {', '.join(still)})" if still else ""),
    )
    return [str(site)]


def _in(site: Path, module: str) -> bool:
    return (site / module).is_dir() or (site / f"{module}.py").is_file()


def download_wheels(wheels: Path) -> int:
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--platform",
        "manylinux2014_x86_64",
        "--implementation",
        "cp",
        "--dest",
        str(wheels),
        *WHEEL_REQUIREMENTS,
    ]
    print(" ".join(cmd))
    done = subprocess.run(cmd)
    for path in sorted(wheels.glob("*.whl")):
        print(f"  {path.name}")
    return done.returncode


# -- step 1: the cuda-marked tests -------------------------------------------------------------------------------


def cuda_tests(step: Step, ctx: Context) -> None:
    files = sorted(p for p in (REPO / "tests").rglob("test_*.py") if CUDA_MARK.search(p.read_text(errors="replace")))
    if not step.check(
        bool(files), f"test files with the cuda mark: {', '.join(str(p.relative_to(REPO)) for p in files)}"
    ):
        return
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider", *map(str, files)]
    done = ctx.run(cmd, timeout=200)
    summary = _pytest_counts(done.stdout)
    what = f"pytest -m cuda exited {done.returncode}: {summary or 'no summary line'}"
    if done.returncode != 0:
        step.check(False, what)
        step.note(tail(done.stdout, 60))
    elif ctx.cuda:
        step.check(summary.get("passed", 0) > 0 and not summary.get("skipped"), what)
    else:
        collected = summary.get("skipped", 0)
        step.check(collected > 0 and not summary.get("passed"), f"the command runs: {what}")
        step.skip(f"{collected} cuda-marked tests", "no CUDA: collected and skipped")


def _pytest_counts(output: str) -> dict[str, int]:
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    if not lines:
        return {}
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", lines[-1])}


# -- step 2: the training job under torchpulse run ---------------------------------------------------------------


def train(step: Step, ctx: Context) -> None:
    out = ctx.workdir / "train.json"
    cmd = [*ctx.under_torchpulse(TRAIN_RUN), "--", sys.executable, str(JOB), "train", "--device", ctx.device]
    options = {
        # A readiness check at every optimizer step: the last one is what the job compares with.
        "TORCHPULSE_OPT_CUDAGRAPH_READINESS_EVERY": "1",
        # Node timing on every other pass: the sync-checked steps run timed and untimed passes alike.
        "TORCHPULSE_OPT_AUTOGRAD_SAMPLE_EVERY": "2",
    }
    done = ctx.run([*cmd, "--out", str(out)], timeout=200, **options)
    mode = 'mode="reduce-overhead"' if ctx.cuda else "the default mode"
    if not _job_ran(
        step, done, f"torchpulse run -- python bench/gpu_check_job.py train --device {ctx.device} ({mode})"
    ):
        return
    record: dict[str, Any] = json.loads(out.read_text())
    step.note(f"torch {record['torch']} on {record['device']}; inductor graph_partition={record['graph_partition']}")
    step.check(ctx.wait_exited(TRAIN_RUN, {"0"}), "the agent said goodbye (torchpulse_agent_exited 1)")
    ctx.train_exposition = scrape(ctx.url)
    samples = parse(ctx.train_exposition)
    ctx.train = record
    _agent_health(step, ctx, samples, TRAIN_RUN)
    passes = by(samples, "torchpulse_backward_passes_total", "kind", run=TRAIN_RUN, rank="0")
    step.equal("backward passes (kind backward)", passes.get("backward"), float(record["passes"]), "the job")
    if ctx.cuda:
        steps = record.get("sync_checked_steps", 0)
        step.check(
            steps > 0,
            f"{steps} steps (one with the NaN gradient, half of them node-timed) ran under "
            "torch.cuda.set_sync_debug_mode('error') with every probe on: no device-to-host sync in the job "
            "or a probe (a control .item() raised there as it should; a probe's would count as a probe error)",
        )
    else:
        step.skip("steps under torch.cuda.set_sync_debug_mode('error')", "no CUDA")
    for note in record.get("notes", []):
        step.note(f"job: {note}")


# -- step 5: /metrics against torch's own counters ---------------------------------------------------------------


def metrics_vs_torch(step: Step, ctx: Context) -> None:
    record = ctx.train
    if record is None:
        step.check(False, "the training job's record (step 2 did not finish)")
        return
    prefixes = (
        "torchpulse_cudagraph_",
        *(f"torchpulse_optimizer_{family}" for family in READINESS),
        "torchpulse_grad_",
    )
    lines = exposition_lines(ctx.train_exposition, TRAIN_RUN, prefixes)
    step.note(f"{len(lines)} lines of run {TRAIN_RUN}:")
    for line in lines:
        step.note(f"  {line}")
    samples = parse(ctx.train_exposition)
    at = {"run": TRAIN_RUN, "rank": "0"}
    _cudagraph_counts(step, ctx, samples, record, at)
    _readiness(step, ctx, samples, record, at)
    _gradients(step, ctx, samples, record, at)


def _cudagraph_counts(
    step: Step, ctx: Context, samples: list[Sample], record: dict[str, Any], at: dict[str, str]
) -> None:
    skips = by(samples, "torchpulse_cudagraph_skips_total", "reason", **at)
    phases: dict[str, int] = record["skips_by_phase"]
    step.equal(
        "cudagraph skips, all reasons (counters['inductor']['cudagraph_skips'])",
        sum(skips.values()),
        float(record["skips"]),
    )
    if ctx.cuda:
        for phase, reason in (("mutated_input", "mutated_inputs"), ("cpu_op", "cpu_device")):
            step.check(
                phases[phase] > 0, f"the {phase} graph skipped CUDA graphs ({phases[phase]} skips counted by torch)"
            )
            step.equal(
                f"skips with reason {reason} (the counter's increase over the {phase} graph)",
                skips.get(reason, 0.0),
                float(phases[phase]),
            )
    else:
        step.check(
            record["skips"] > 0,
            f"graphs compiled with reduce-overhead on CPU skipped ({record['skips']} skips counted by torch)",
        )
        step.equal(
            "skips with reason cpu_device (all of them: no CUDA device)",
            skips.get("cpu_device", 0.0),
            float(record["skips"]),
        )
    copies = one(samples, "torchpulse_cudagraph_nonstatic_input_copies_total", **at)
    trees: dict[str, int] = record["trees"]
    if not ctx.cuda:
        step.check(trees["managers"] == 0, "no CUDA-graph tree manager on CPU")
        for what in ("recordings, warm-ups, trees, nodes, pool bytes, re-recordings, non-static input copies",):
            step.skip(what, "no CUDA: no CUDA-graph trees")
        return
    step.equal(
        "non-static input copies (counters['inductor']['cudagraph_recorded_non_static_inputs'])",
        copies,
        float(record["nonstatic_input_copies"]),
    )
    step.check(trees["nodes"] >= 2, f"the trees recorded graphs ({trees['nodes']} nodes in {trees['trees']} trees)")
    step.equal(
        "recordings (the trees' nodes)",
        one(samples, "torchpulse_cudagraph_recordings_total", **at),
        float(trees["nodes"]),
    )
    step.equal(
        "warm-ups (the managers' warmed_up_functions)",
        one(samples, "torchpulse_cudagraph_warmups_total", **at),
        float(trees["warmed"]),
    )
    step.equal("trees (the managers' roots)", one(samples, "torchpulse_cudagraph_trees", **at), float(trees["trees"]))
    step.equal(
        "nodes (recorded graphs in the trees)", one(samples, "torchpulse_cudagraph_nodes", **at), float(trees["nodes"])
    )
    step.check(trees["pool"] > 0, f"the graphs' private pool holds memory ({trees['pool']} bytes)")
    step.equal(
        "pool bytes (get_cudagraph_segments of the managers' pools)",
        one(samples, "torchpulse_cudagraph_pool_bytes", **at),
        float(trees["pool"]),
    )
    rerecords = by(samples, "torchpulse_cudagraph_rerecords_total", "reason", **at)
    step.check(
        record["shape_rerecords"] > 0,
        f"a new shape of a dynamic graph recorded again ({record['shape_rerecords']} times)",
    )
    step.equal(
        "re-recordings for a new dynamic shape (shape caches of cudagraphify_impl beyond their first)",
        rerecords.get("new_dynamic_shape", 0.0),
        float(record["shape_rerecords"]),
    )
    others = sum(v for reason, v in rerecords.items() if reason != "new_dynamic_shape")
    step.equal("other re-recordings (siblings recorded again in the trees)", others, float(trees["again"]))


def _labels(record: dict[str, Any]) -> dict[str, str]:
    """The job's optimizer names -> the probe's labels (`Type#n`, numbered in the order of their first step)."""
    readiness: dict[str, dict[str, Any]] = record["readiness"]
    return {name: f"{readiness[name]['class']}#{index}" for index, name in enumerate(record["optimizer_order"])}


def _readiness(step: Step, ctx: Context, samples: list[Sample], record: dict[str, Any], at: dict[str, str]) -> None:
    labels = _labels(record)
    known = set(by(samples, "torchpulse_optimizer_steps_total", "optimizer", **at))
    if not step.check(
        set(labels.values()) <= known, f"optimizer labels {sorted(labels.values())} in /metrics ({sorted(known)})"
    ):
        return
    for name, label in labels.items():
        seen: dict[str, Any] = record["readiness"][name]
        of = {**at, "optimizer": label}
        step.equal(
            f"{label} steps",
            one(samples, "torchpulse_optimizer_steps_total", **of),
            float(record["optimizer_steps"][name]),
            "the job",
        )
        step.equal(
            f"{label} non-static grads (Dynamo's _is_static_for_cudagraphs)",
            one(samples, "torchpulse_optimizer_nonstatic_grads", **of),
            float(seen["nonstatic_grads"]),
        )
        step.equal(
            f"{label} grads that moved since the previous step",
            one(samples, "torchpulse_optimizer_moving_grads", **of),
            float(seen["moving_grads"]),
            "the grads' data_ptr()",
        )
        step.equal(
            f"{label} CPU `step` tensors of CUDA params",
            one(samples, "torchpulse_optimizer_cpu_step_tensors", **of),
            float(seen["cpu_step_tensors"]),
        )
        step.equal(
            f"{label} capturable by param group",
            by(samples, "torchpulse_optimizer_capturable", "param_group", **of),
            seen["capturable"],
        )
    if ctx.cuda:
        graphed, eager = record["readiness"]["graphed"], record["readiness"]["eager"]
        step.check(
            graphed["capturable"] == {"0": 1.0} and eager["capturable"] == {"0": 0.0},
            f"one optimizer capturable, one not ({labels['graphed']}: {graphed['capturable']}, "
            f"{labels['eager']}: {eager['capturable']})",
        )
        step.check(
            eager["nonstatic_grads"] > 0 and eager["moving_grads"] > 0 and eager["cpu_step_tensors"] > 0,
            f"the eager head's optimizer has something to count (non-static {eager['nonstatic_grads']}, moving "
            f"{eager['moving_grads']}, CPU steps {eager['cpu_step_tensors']})",
        )
    else:
        step.skip(
            "capturable=True, and non-zero readiness counts", "no CUDA: capturable and readiness are about CUDA params"
        )


def _gradients(step: Step, ctx: Context, samples: list[Sample], record: dict[str, Any], at: dict[str, str]) -> None:
    where = "on the GPU" if ctx.cuda else "on the CPU"
    step.equal(
        f"non-finite passes ({record['nonfinite_passes']} made by the job {where})",
        one(samples, "torchpulse_grad_nonfinite_passes_total", **at),
        float(record["nonfinite_passes"]),
        "the job",
    )
    step.equal(
        "non-finite parameters after the last (clean) pass",
        one(samples, "torchpulse_grad_nonfinite_parameters", **at),
        0.0,
        "expected",
    )
    logged = [e for e in ctx.daemon_events(TRAIN_RUN) if e.get("event") == "autograd.nonfinite_gradients"]
    names = sorted({name for e in logged for name in str(e.get("names", "")).split(",") if name})
    step.equal("parameters the daemon's log names (torch.isfinite on each grad)", names, record["nonfinite_parameters"])


# -- step 3: two ranks and a DCP save ----------------------------------------------------------------------------


def ranks(step: Step, ctx: Context) -> None:
    out, checkpoints = ctx.workdir / "ranks", ctx.workdir / "checkpoints"
    checkpoint = checkpoints / f"step-{RANK_STEPS:06d}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    job = [str(JOB), "ranks", "--device", ctx.device, "--out", str(out), "--checkpoint", str(checkpoint)]
    done = ctx.run(
        [*ctx.under_torchpulse(RANKS_RUN), "--", *torchrun, *job, "--steps", str(RANK_STEPS)],
        timeout=180,
        OMP_NUM_THREADS="1",
    )
    where = "sharing cuda:0 over gloo" if ctx.cuda else "on CPU over gloo"
    if not _job_ran(step, done, f"torchpulse run -- torchrun --nproc-per-node=2 (2 ranks {where}, DCP save)"):
        return
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    devices = sorted({device for r in records for device in r["state_devices"]})
    if ctx.cuda:
        step.check(devices == ["cuda:0"], f"the saved state was on the GPU ({devices})")
    else:
        step.skip(f"the saved state on the GPU ({devices})", "no CUDA")
    step.check(ctx.wait_exited(RANKS_RUN, {"0", "1"}), "both ranks' agents said goodbye")
    samples = ctx.samples()
    at = {"run": RANKS_RUN}
    steps = by(samples, "torchpulse_optimizer_steps_total", "rank", **at)
    step.equal(
        "optimizer steps by rank",
        {rank: steps.get(rank) for rank in ("0", "1")},
        {"0": float(RANK_STEPS), "1": float(RANK_STEPS)},
        "the job",
    )
    info = series(samples, "torchpulse_run_info", **at)
    world = sorted({str(dict(k).get("world_size")) for k in info})
    step.equal("world size in torchpulse_run_info", world, ["2"], "torchrun")
    saves = by(samples, "torchpulse_checkpoint_save_duration_seconds_count", "rank", **at)
    by_rank = {rank: saves.get(rank) for rank in ("0", "1")}
    step.equal("DCP saves by rank", by_rank, {"0": 1.0, "1": 1.0}, "the job")
    _agent_health(step, ctx, samples, RANKS_RUN)
    validations = _validated(ctx)
    step.equal(
        "the daemon's validations of the announced checkpoint, by status", validations, {"valid": 1.0}, "expected"
    )


def _validated(ctx: Context, timeout: float = 90.0) -> dict[str, float]:
    """Validations by status, once one finished (the daemon validates in a worker after the announcement)."""
    deadline = time.monotonic() + timeout
    while True:
        found: dict[str, float] = {}
        for key, value in series(ctx.samples(), "torchpulse_checkpoint_validations_total").items():
            status = dict(key).get("status", "")
            if value:
                found[status] = found.get(status, 0.0) + value
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


# -- step 4: the overhead benchmarks -----------------------------------------------------------------------------


def overhead(step: Step, ctx: Context) -> str:
    cmd = [sys.executable, str(OVERHEAD), "--device", ctx.device, *([] if ctx.cuda else ["--smoke"])]
    done = ctx.run(cmd, timeout=180)
    step.note(tail(done.stdout, 200))
    if done.returncode != 0:
        step.note(tail(done.stderr, 30))
    if ctx.cuda:
        step.check(
            done.returncode == 0,
            "optimizer probe <= 1.01, autograd defaults <= 1.01, every-pass node timing <= 1.03, compile + "
            f"CUDA-graph probes <= 1.005, steps >= 20 ms (bench/gpu_overhead.py exited {done.returncode})",
        )
    else:
        step.check(done.returncode == 0, f"bench/gpu_overhead.py --device cpu --smoke exited {done.returncode}")
        step.skip("the budgets", "no CUDA: they are for a GPU step of >= 20 ms")
    return done.stdout


# -- step 6: what node timing measures ---------------------------------------------------------------------------


def node_timing(step: Step, ctx: Context, bench_output: str) -> None:
    step.note(NODE_TIMING_NOTE)
    measured = [line.strip() for line in bench_output.splitlines() if "node timing on" in line]
    for line in measured:
        step.note(f"measured: {line}")
    if ctx.cuda:
        step.check(bool(measured), "node time per pass measured against the backward's device time (CUDA events)")
    else:
        step.skip("node time against the backward's device time", "no CUDA")


# -- the run -----------------------------------------------------------------------------------------------------

STEPS = ("tests", "train", "ranks", "overhead")


@contextmanager
def daemon(workdir: Path) -> Iterator[tuple[Path, str, Path]]:
    from bench.harness import running_daemon

    with running_daemon(workdir, log=True) as running:
        assert running.log_path is not None
        yield running.socket_path, running.url, running.log_path


def timed(step: Step, body: Callable[[], object]) -> object:
    started = time.monotonic()
    try:
        return body()
    except Exception as exc:  # one step's crash is its FAIL, not the others'
        step.check(False, f"the step raised {type(exc).__name__}: {exc}")
        return None
    finally:
        step.seconds = time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dry-run", action="store_true", help="without CUDA: CUDA steps SKIPPED, CPU parts run")
    parser.add_argument("--wheels", type=Path, default=WHEELS, help=f"wheels to install from (default {WHEELS})")
    parser.add_argument("--download-wheels", action="store_true", help="download those wheels (needs PyPI) and exit")
    parser.add_argument("--only", choices=STEPS, action="append", help="run only these steps (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (daemon log, records)")
    args = parser.parse_args(argv)
    if args.download_wheels:
        return download_wheels(args.wheels)
    started = time.monotonic()
    wanted = set(args.only or STEPS)
    deps = Step(0, "dependencies")
    sites = timed(deps, lambda: dependencies(deps, args.wheels))
    print(deps.render(), flush=True)
    if deps.verdict == "FAIL":
        return 1
    extra = [*(sites if isinstance(sites, list) else []), str(REPO)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*extra, *filter(None, [os.environ.get("PYTHONPATH")])]))
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # the daemon's too

    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("FAIL: no CUDA device here (torch.cuda.is_available() is False); --dry-run runs the CPU parts")
        return 1
    what = f"CUDA ({torch.cuda.get_device_name(0)})" if cuda else "dry run on CPU: every CUDA step SKIPPED"
    print(f"== torch {torch.__version__}, {what}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="torchpulse-gpu-check-"))
    steps = [
        Step(1, "cuda-marked tests (pytest -m cuda)"),
        Step(2, f"training job under torchpulse run ({'reduce-overhead on CUDA' if cuda else 'CPU, default mode'})"),
        Step(3, "2 ranks over gloo and a DCP save validated by the daemon"),
        Step(4, "overhead benchmarks, side by side in one run"),
        Step(5, "/metrics against torch's own counters"),
        Step(6, "what node timing measures on CUDA"),
    ]
    try:
        with daemon(workdir) as (socket_path, url, log_path):
            ctx = Context(cuda, workdir, env, socket_path, url, log_path)
            runners: dict[int, Callable[[], object]] = {
                1: lambda: cuda_tests(steps[0], ctx),
                2: lambda: train(steps[1], ctx),
                3: lambda: ranks(steps[2], ctx),
            }
            chosen = {1: "tests", 2: "train", 3: "ranks"}
            with ThreadPoolExecutor(max_workers=3) as pool:
                futures = {
                    number: pool.submit(timed, steps[number - 1], body)
                    for number, body in runners.items()
                    if chosen[number] in wanted
                }
                for number, future in futures.items():
                    future.result()
                    print(f"[{time.monotonic() - started:6.1f} s] step {number} done", flush=True)
            for number in (1, 2, 3):
                if chosen[number] not in wanted:
                    steps[number - 1].skip("not asked for", "--only")
            if "train" in wanted:
                timed(steps[4], lambda: metrics_vs_torch(steps[4], ctx))
            else:
                steps[4].skip("not asked for", "--only")
            bench_output = ""
            if "overhead" in wanted:
                output = timed(steps[3], lambda: overhead(steps[3], ctx))
                bench_output = output if isinstance(output, str) else ""
                print(f"[{time.monotonic() - started:6.1f} s] step 4 done", flush=True)
            else:
                steps[3].skip("not asked for", "--only")
            timed(steps[5], lambda: node_timing(steps[5], ctx, bench_output))
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.monotonic() - started
    for step in steps:
        print(step.render(), flush=True)
    timing = Step(7, "time")
    if cuda and wanted == set(STEPS):
        timing.check(elapsed <= BUDGET_SECONDS, f"the whole run took {elapsed:.0f} s (budget {BUDGET_SECONDS:.0f} s)")
    else:
        timing.skip(f"the whole run took {elapsed:.0f} s", "the 4-minute budget is for the full CUDA run")
    print("\n== summary" + (" (dry run: no CUDA)" if not cuda else ""))
    for step in [deps, *steps, timing]:
        print(f"  {step.number}. {step.title}: {step.summary}")
    failed = any(step.verdict == "FAIL" for step in [deps, *steps, timing])
    print("FAIL" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
