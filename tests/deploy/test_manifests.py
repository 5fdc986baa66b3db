"""The kustomize base as files: strict schema validation, hardening, and agreement with the daemon's config."""

from __future__ import annotations

import pytest

from tests.deploy.manifests import (
    BASE,
    DAEMON_CONFIG,
    EXAMPLE_JOB,
    HARDENED_CONTAINER,
    KUBERNETES_VERSIONS,
    OPERATOR_API,
    OPERATOR_DURATION,
    RULES,
    base_resources,
    checkpoints_config,
    config_disagreements,
    container,
    contract_labels,
    daemon_config,
    daemonset,
    documents,
    effective_security,
    hostpath_mounts,
    kustomization,
    one,
    pod_spec,
    quantity,
    seconds,
    strict_validation_errors,
)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_built_in_kinds_validate_strictly(version: str) -> None:
    """Every built-in resource of the base and the example job fits the Kubernetes schema, unknown fields refused."""
    resources = [*base_resources(), *documents(EXAMPLE_JOB)]
    built_in = [resource for resource in resources if resource["apiVersion"] != OPERATOR_API]

    errors = [error for resource in built_in for error in strict_validation_errors(resource, version)]

    assert {"Namespace", "ServiceAccount", "DaemonSet", "Job"} == {resource["kind"] for resource in built_in}
    assert [] == errors


def test_every_source_manifest_is_listed_in_the_kustomization() -> None:
    """Each YAML manifest of deploy/kubernetes/ is a resource of the base (none lies there unused)."""
    present = {path.relative_to(BASE).as_posix() for path in BASE.glob("**/*.yaml")}

    assert present - {"kustomization.yaml"} == set(kustomization()["resources"])


def test_daemon_container_is_hardened() -> None:
    """The daemon runs non-root on a read-only root, no privilege escalation, no capability, seccomp RuntimeDefault."""
    actual = effective_security(daemonset(), "daemon")

    assert HARDENED_CONTAINER == {key: actual[key] for key in HARDENED_CONTAINER}
    assert 0 != actual["runAsUser"]


def test_daemon_pod_shares_nothing_of_the_host_but_its_volumes() -> None:
    """No host network, pid or IPC namespace, no API token, and host users kept for SO_PEERCRED."""
    pod = pod_spec(daemonset())

    actual = {key: pod.get(key) for key in ("hostNetwork", "hostPID", "hostIPC", "hostUsers")}

    assert {"hostNetwork": None, "hostPID": None, "hostIPC": None, "hostUsers": None} == actual
    assert (False, False) == (pod["automountServiceAccountToken"], pod["enableServiceLinks"])


def test_only_the_init_container_runs_as_root_and_only_to_hand_over_directories() -> None:
    """The init container is root with CHOWN and FOWNER alone, and hands the socket and state directories over."""
    workload = daemonset()
    pod = pod_spec(workload)
    init = container(workload, "host-directories", init=True)
    security = init["securityContext"]
    uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    script = init["command"][-1]

    assert [init["name"]] == [entry["name"] for entry in pod["initContainers"]]
    assert {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]} == security["capabilities"]
    assert (False, True, False) == (
        security["allowPrivilegeEscalation"],
        security["readOnlyRootFilesystem"],
        security["privileged"],
    )
    assert f"chown {uid}:{gid} /run/torchpulse /var/lib/torchpulse" in script
    # The modes of systemd/torchpulse.tmpfiles (0755) and the unit's StateDirectoryMode (0750).
    assert ("chmod 0755 /run/torchpulse", "chmod 0750 /var/lib/torchpulse") == tuple(
        part.strip() for part in script.split("&&")[1:]
    )
    assert {"/run/torchpulse", "/var/lib/torchpulse"} == set(hostpath_mounts(workload, init))


def test_resources_cover_the_load_figures_and_a_validation_worker() -> None:
    """Requests hold bench/load.py's load; the memory limit holds the workers' limits and the daemon's buffers."""
    from torchpulse.limits import HTTP_MAX_HELD_BYTES, MAX_BUFFERED_BYTES, MAX_STATUS_HELD_BYTES

    resources = container(daemonset(), "daemon")["resources"]
    checkpoints = checkpoints_config()
    # README "Limits and guarantees": 23 % of a core and a peak RSS of 86.5 MiB with 512 agents; 340 MiB
    # with the most ended runs the default max_runs keeps exported.
    load_cpu, load_peak_rss, max_runs_rss = quantity("230m"), 86.5 * 2**20, 340 * 2**20
    workers = checkpoints.max_concurrent_validations * checkpoints.validation_memory_limit_bytes
    daemon_worst = max_runs_rss + HTTP_MAX_HELD_BYTES + MAX_STATUS_HELD_BYTES + MAX_BUFFERED_BYTES

    assert {"cpu": "250m", "memory": "128Mi"} == resources["requests"]
    assert quantity(resources["requests"]["cpu"]) >= load_cpu
    assert quantity(resources["requests"]["memory"]) >= load_peak_rss
    assert quantity(resources["limits"]["memory"]) >= workers + daemon_worst
    assert {"cpu": "2", "memory": "6Gi"} == resources["limits"]


def test_probes_check_the_exposition_and_the_agent_socket() -> None:
    """Startup and liveness GET /healthz on the metrics port; readiness runs `torchpulse status` on the socket."""
    daemon = container(daemonset(), "daemon")
    socket = str(daemon_config().daemon.socket)

    http = {name: daemon[name]["httpGet"] for name in ("startupProbe", "livenessProbe")}

    assert {name: {"path": "/healthz", "port": "metrics"} for name in http} == http
    assert [daemon["command"][0], "status", "--socket", socket] == daemon["readinessProbe"]["exec"]["command"]
    assert daemon["readinessProbe"]["timeoutSeconds"] < daemon["readinessProbe"]["periodSeconds"]


def test_metrics_port_is_named_and_is_the_configured_listen_port() -> None:
    """The container port `metrics` is the port of the config's `listen`, on every interface of the pod."""
    from torchpulse.daemon.config import parse_listen

    ports = container(daemonset(), "daemon")["ports"]

    assert [{"name": "metrics", "containerPort": 10187, "protocol": "TCP"}] == ports
    assert ("0.0.0.0", 10187) == parse_listen(daemon_config().daemon.listen)


def test_config_agrees_with_the_daemonset() -> None:
    """Socket, state directory, roots, probe and port of torchpulse.toml are the DaemonSet's mounts and settings."""
    workload = daemonset()
    daemon = container(workload, "daemon")
    config_mount = next(mount for mount in daemon["volumeMounts"] if mount["name"] == "config")

    assert [] == config_disagreements(workload, DAEMON_CONFIG.read_text())
    assert ["--config", f"{config_mount['mountPath']}/torchpulse.toml"] == daemon["command"][2:]
    assert [] != [root for root in checkpoints_config().roots]


def test_rollout_never_runs_two_daemons_on_a_node() -> None:
    """The rolling update stops the old daemon before the new one binds the socket (maxSurge 0)."""
    strategy = daemonset()["spec"]["updateStrategy"]

    assert {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}} == strategy


def test_daemon_runs_on_tainted_nodes() -> None:
    """The DaemonSet tolerates every taint: a GPU node without a daemon reports none of its jobs."""
    assert [{"operator": "Exists"}] == pod_spec(daemonset())["tolerations"]


def test_namespace_allows_the_host_paths_and_nothing_else_is_relaxed() -> None:
    """The daemon's namespace enforces Pod Security `privileged`, which hostPath volumes need."""
    namespace = one(base_resources(), "Namespace")

    assert "privileged" == namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]


def test_podmonitor_scrapes_each_daemon_pod_on_its_metrics_port() -> None:
    """The PodMonitor selects the daemon pods, scrapes `metrics` at /metrics, and times out before the next scrape."""
    workload = daemonset()
    monitor = one(base_resources(), "PodMonitor")
    spec = monitor["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]

    assert OPERATOR_API == monitor["apiVersion"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert ("metrics", "/metrics") == (endpoint["port"], endpoint["path"])
    assert ("15s", "10s") == (endpoint["interval"], endpoint["scrapeTimeout"])
    assert seconds(endpoint["scrapeTimeout"]) < seconds(endpoint["interval"])
    assert all(OPERATOR_DURATION.fullmatch(endpoint[key]) for key in ("interval", "scrapeTimeout"))


def test_podmonitor_labels_targets_as_the_alerts_expect() -> None:
    """job is "torchpulse" (TorchpulseDaemonDown), instance is the node, and no target label shadows a metric label."""
    monitor = one(base_resources(), "PodMonitor")
    pod_labels = daemonset()["spec"]["template"]["metadata"]["labels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    relabelings = endpoint["relabelings"]
    written = {rule.get("targetLabel") for rule in relabelings} - {None}

    assert "torchpulse" == pod_labels[monitor["spec"]["jobLabel"]]
    assert 'up{job="torchpulse"}' in RULES.read_text()
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "instance"} == relabelings[0]
    assert {"action": "labeldrop", "regex": "pod|container|endpoint"} == relabelings[1]
    assert set() == written & contract_labels()
