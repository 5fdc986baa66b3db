"""The example training job and overlay of docs/kubernetes.md: shown there verbatim, attached as the daemon expects."""

from __future__ import annotations

from tests.deploy.manifests import (
    DOC,
    EXAMPLE_JOB,
    OVERLAY,
    checkpoints_config,
    container,
    daemon_config,
    daemonset,
    documents,
    hostpath_mounts,
    one,
    pod_spec,
    yaml_blocks,
)


def _job_env() -> dict[str, dict[str, object] | str]:
    trainer = container(one(documents(EXAMPLE_JOB), "Job"), "trainer")
    return {entry["name"]: entry.get("valueFrom") or entry["value"] for entry in trainer["env"]}


def test_doc_shows_the_example_files_verbatim() -> None:
    """docs/kubernetes.md holds the example job and the overlay's kustomization exactly as the files are."""
    blocks = yaml_blocks(DOC.read_text())

    assert EXAMPLE_JOB.read_text() in blocks
    assert (OVERLAY / "kustomization.yaml").read_text() in blocks


def test_example_job_mounts_the_daemons_socket_directory() -> None:
    """The job mounts the daemon's socket directory from the host, read-only at the same path, and names the socket."""
    job = one(documents(EXAMPLE_JOB), "Job")
    socket = daemon_config().daemon.socket
    daemon_mounts = hostpath_mounts(daemonset(), container(daemonset(), "daemon"))
    job_mounts = hostpath_mounts(job, container(job, "trainer"))

    assert (daemon_mounts[str(socket.parent)][0], True) == job_mounts[str(socket.parent)]
    assert str(socket) == _job_env()["TORCHPULSE_SOCKET"]


def test_example_job_may_connect_to_the_socket() -> None:
    """The job runs as a normal uid, with the daemon's gid among its groups (the socket is 0660)."""
    pod = pod_spec(one(documents(EXAMPLE_JOB), "Job"))["securityContext"]
    daemon = pod_spec(daemonset())["securityContext"]

    assert daemon["runAsGroup"] in pod["supplementalGroups"]
    assert 0 != pod["runAsUser"]
    assert daemon["runAsUser"] != pod["runAsUser"]


def test_example_job_names_its_run_from_the_job() -> None:
    """TORCHPULSE_RUN is namespace/job name, both from the downward API."""
    env = _job_env()

    assert {
        "POD_NAMESPACE": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        "JOB_NAME": {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}},
        "TORCHPULSE_RUN": "$(POD_NAMESPACE)/$(JOB_NAME)",
    } == {name: env[name] for name in ("POD_NAMESPACE", "JOB_NAME", "TORCHPULSE_RUN")}


def test_example_job_attaches_and_checkpoints_where_the_daemon_looks() -> None:
    """The command starts with `torchpulse run --`, and the job checkpoints into a configured root at its host path."""
    job = one(documents(EXAMPLE_JOB), "Job")
    trainer = container(job, "trainer")
    roots = {root.path for root in checkpoints_config().roots}
    written = {path: host for path, (host, read_only) in hostpath_mounts(job, trainer).items() if not read_only}

    assert ["torchpulse", "run", "--"] == trainer["command"][:3]
    assert {root: root for root in roots} == written


def test_example_namespace_allows_the_socket_volume() -> None:
    """The training namespace enforces Pod Security `privileged`, which the hostPath volume needs."""
    namespace = one(documents(EXAMPLE_JOB), "Namespace")
    job = one(documents(EXAMPLE_JOB), "Job")

    assert "privileged" == namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    assert namespace["metadata"]["name"] == job["metadata"]["namespace"]
