"""Shared checks for rendered manifests (kustomize base, Helm chart): the same pod
shape must come out of both, so both run the same assertions."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from kvd.config import Config, load
from kvd.ops.metric_docs import metric_names

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DEFAULTS = Config()
Doc = dict[str, Any]


def load_docs(path: Path) -> list[Doc]:
    return load_docs_text(path.read_text())


def load_docs_text(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def pod_spec(workload: Doc) -> Doc:
    return workload["spec"]["template"]["spec"]


def kvd_container(spec: Doc) -> Doc:
    """The kvd container: a native sidecar (init container) or, for the per-node
    DaemonSet, a plain container."""
    (kvd,) = [c for c in spec.get("initContainers", []) + spec.get("containers", [])
              if c["name"] == "kvd"]
    return kvd


def env_map(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def effective_config(workload: Doc, configmaps: dict[str, Doc], tmp_path: Path,
                     shm_dir_here: Path | None = None) -> Config:
    """What `kvd serve` would run with in this pod: the mounted ConfigMap's kvd.toml
    (written to a file and read by kvd.config.load) plus the container's KVD_*
    environment, with the downward-API pod IP and the mounted token substituted.
    ``shm_dir_here``: an existing directory standing in for shm_dir (a host path that
    does not exist on this machine; config validation requires it to)."""
    spec = pod_spec(workload)
    kvd = kvd_container(spec)
    args = kvd.get("args", [])
    assert "--config" in args, "kvd must be started with --config"
    config_path = args[args.index("--config") + 1]
    (mount,) = [m for m in kvd["volumeMounts"] if m["mountPath"] == config_path]
    volumes = {v["name"]: v for v in spec["volumes"]}
    cm_name = volumes[mount["name"]]["configMap"]["name"]
    toml_text = configmaps[cm_name]["data"][mount["subPath"]]
    toml_file = tmp_path / "kvd.toml"
    toml_file.write_text(toml_text)

    token = tmp_path / "token"
    token.write_text("test-token")
    env: dict[str, str] = {}
    known = {"POD_IP": "10.1.2.3"}
    for item in kvd.get("env", []):
        if "valueFrom" in item:
            assert item["name"] == "POD_IP", item
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            continue
        # $(VAR) expands only for variables defined earlier in the list
        value = re.sub(r"\$\((\w+)\)", lambda m: known[m.group(1)], str(item["value"]))
        known[item["name"]] = value
        if item["name"].startswith("KVD_"):
            env[item["name"]] = value
    if "KVD_AUTH_TOKEN_FILE" in env:
        env["KVD_AUTH_TOKEN_FILE"] = str(token)
    if shm_dir_here is not None:
        env["KVD_SHM_DIR"] = str(shm_dir_here)
    if "KVD_CURVE_SECRET_KEY_FILE" in env:  # stand-ins for the mounted Secrets
        from kvd.wire.curve import write_keypair

        pub, sec = write_keypair(tmp_path / "curve", "kvd", force=True)
        allow = tmp_path / "curve-allow"
        allow.mkdir(exist_ok=True)
        (allow / pub.name).write_text(pub.read_text())
        env["KVD_CURVE_SECRET_KEY_FILE"], env["KVD_CURVE_ALLOWLIST"] = str(sec), str(allow)
    return load(toml_file, env=env)


def check_curve(workload: Doc, configmaps: dict[str, Doc], tmp_path: Path,
                secrets: set[str] | None = None) -> None:
    """The pod runs kvd with CURVE: keypair and allowlist mounted from Secrets, the
    keypair file never open to other users, readable by kvd's group, and kvd's own
    start-up checks (load_token, load_curve) pass on the effective config."""
    import os

    from kvd.daemon.run import load_curve, load_token

    cfg = effective_config(workload, configmaps, tmp_path)
    assert cfg.curve_secret_key_file and cfg.curve_allowlist
    spec = pod_spec(workload)
    kvd = kvd_container(spec)
    env = env_map(kvd)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in kvd["volumeMounts"]}
    key_path = Path(env["KVD_CURVE_SECRET_KEY_FILE"]["value"])
    key_mount = mounts[str(key_path.parent)]
    key_secret = volumes[key_mount["name"]]["secret"]
    assert key_mount.get("readOnly") is True
    assert [i["path"] for i in key_secret["items"]] == [key_path.name]
    mode = key_secret["defaultMode"]
    assert mode & 0o007 == 0, f"keypair Secret mode {mode:o} is open to other users"
    assert mode & 0o040, "kvd reads its keypair through the pod's fsGroup"
    assert spec["securityContext"]["fsGroup"] == kvd["securityContext"]["runAsGroup"]
    allow_mount = mounts[env["KVD_CURVE_ALLOWLIST"]["value"]]
    assert "secret" in volumes[allow_mount["name"]]
    if secrets is not None:
        assert {key_secret["secretName"],
                volumes[allow_mount["name"]]["secret"]["secretName"]} <= secrets
    os.chmod(cfg.curve_secret_key_file, mode)  # as kubelet writes it
    if cfg.auth_token_file:
        Path(cfg.auth_token_file).write_text("test-token-0123456789abcdef")
    load_token(cfg)
    keys = load_curve(cfg)
    assert keys is not None and "secret" not in repr(keys)


def check_kvd_pod(workload: Doc, configmaps: dict[str, Doc], tmp_path: Path) -> Config:
    """Every property the sidecar needs; returns the effective config for more checks."""
    cfg = effective_config(workload, configmaps, tmp_path)
    spec = pod_spec(workload)
    kvd = kvd_container(spec)
    assert kvd.get("image"), "kvd container has no image"
    assert kvd["restartPolicy"] == "Always", "native sidecar needs restartPolicy: Always"

    ports = {p["name"]: p["containerPort"] for p in kvd["ports"]}
    assert ports == {
        "kvd-engine": port_of(cfg.engine_address),
        "kvd-peer": port_of(cfg.peer_address),
        "kvd-metrics": cfg.metrics_port,
    }
    assert all(len(name) <= 15 for name in ports)
    # on defaults, the ports are the config defaults
    assert cfg.metrics_port == DEFAULTS.metrics_port
    assert port_of(cfg.engine_address) == port_of(DEFAULTS.engine_address)
    assert port_of(cfg.peer_address) == port_of(DEFAULTS.peer_address)

    for probe, path in (
        ("startupProbe", "/readyz"),
        ("readinessProbe", "/readyz"),
        ("livenessProbe", "/livez"),
    ):
        http = kvd[probe]["httpGet"]
        assert http["path"] == path, probe
        port = ports[http["port"]] if isinstance(http["port"], str) else http["port"]
        assert port == cfg.metrics_port, f"{probe} does not hit the metrics server"

    # probes and Prometheus come from outside the container: bind the pod IP
    assert cfg.metrics_host == "10.1.2.3"
    assert cfg.peer_address == f"tcp://10.1.2.3:{port_of(DEFAULTS.peer_address)}"
    assert cfg.engine_address.startswith("tcp://127.0.0.1:")  # engines are in the pod

    caps = kvd["securityContext"]["capabilities"]["add"]
    assert "IPC_LOCK" in caps
    assert kvd["securityContext"].get("runAsNonRoot") is True

    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = [m for m in kvd["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(shm) == 1
    assert volumes[shm[0]["name"]]["emptyDir"]["medium"] == "Memory"
    engines = spec["containers"]
    assert engines, "no engine container"
    for engine in engines:
        assert engine.get("image"), f"container {engine['name']} has no image (patch mismatch?)"
        mounts = {m["mountPath"]: m["name"] for m in engine.get("volumeMounts", [])}
        assert mounts.get("/dev/shm") == shm[0]["name"], "engine must map the same /dev/shm"

    assert spec["terminationGracePeriodSeconds"] > cfg.drain_timeout_s
    assert spec.get("shareProcessNamespace") is True  # CUDA IPC between containers

    token_file = env_map(kvd)["KVD_AUTH_TOKEN_FILE"]["value"]
    token_mounts = [
        m for m in kvd["volumeMounts"] if token_file.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert len(token_mounts) == 1 and "secret" in volumes[token_mounts[0]["name"]]
    return cfg


def check_service(service: Doc, workload: Doc) -> None:
    spec = pod_spec(workload)
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None", "peers must reach a specific pod"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    names = {p["name"]: p["containerPort"] for p in kvd_container(spec)["ports"]}
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["kvd-peer"]["port"] == port_of(DEFAULTS.peer_address)
    for port in by_name.values():
        assert port["targetPort"] in names


def check_podmonitor(monitor: Doc, workload: Doc) -> None:
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "PodMonitor"
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    spec = pod_spec(workload)
    pod_ports = {p["name"] for c in spec.get("initContainers", []) + spec["containers"]
                 for p in c.get("ports", [])}
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in pod_ports
        assert endpoint.get("path", "/metrics") == "/metrics"


REQUIRED_PANELS = (
    "kvd_transferred_bytes_total",
    "kvd_transfer_duration_seconds_bucket",
    "kvd_leases_expired_total",
    "kvd_inflight_transfers",
    "kvd_held_requests",
    "kvd_handshakes_total",
)


def check_dashboard(raw: str) -> None:
    dash = json.loads(raw)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    used = {name for e in exprs for name in re.findall(r"\bkvd_[a-z_]+", e)}
    unknown = used - metric_names()
    assert not unknown, f"dashboard uses metrics kvd does not export: {sorted(unknown)}"
    for name in REQUIRED_PANELS:
        assert name in used, f"dashboard lacks a panel over {name}"
    assert any("histogram_quantile(0.99" in e for e in exprs)
    assert any("histogram_quantile(0.5" in e for e in exprs)
    assert any('outcome!="ok"' in e for e in exprs)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


FILE_BACKINGS = ("shm", "tmpfs_huge", "hugetlbfs")  # pools other pods can open by path


def check_node_daemon(daemonset: Doc, engines: list[Doc], configmaps: dict[str, Doc],
                      tmp_path: Path) -> Config:
    """The per-node shape: a DaemonSet kvd that every engine pod of the node reaches
    through two host directories (socket, pools), both that uid's alone. Returns
    the effective config (its shm_dir is the manifest's, not the stand-in)."""
    import tomllib

    assert daemonset["kind"] == "DaemonSet"
    spec = pod_spec(daemonset)
    kvd = kvd_container(spec)
    assert kvd in spec["containers"], "the per-node kvd is a plain container"
    stand_in = tmp_path / "pools-here"
    stand_in.mkdir(exist_ok=True)
    cfg = effective_config(daemonset, configmaps, tmp_path, shm_dir_here=stand_in)
    volumes = {v["name"]: v for v in spec["volumes"]}
    (cm_mount,) = [m for m in kvd["volumeMounts"] if m["mountPath"] == "/etc/kvd/kvd.toml"]
    toml_text = configmaps[volumes[cm_mount["name"]]["configMap"]["name"]]["data"]["kvd.toml"]
    shm_dir = tomllib.loads(toml_text)["kvd"]["shm_dir"]
    assert cfg.shm_dir == str(stand_in)

    # Engines connect to a unix socket in a host directory, never a node TCP port.
    assert cfg.engine_address.startswith("ipc:///"), cfg.engine_address
    socket_path = cfg.engine_address[len("ipc://"):]
    socket_dir = str(Path(socket_path).parent)
    assert cfg.pool_backing in FILE_BACKINGS, "engines in other pods cannot open a memfd"
    assert socket_dir != shm_dir

    def host_mount(container: Doc, pod_volumes: dict[str, Doc], path: str, kind: str) -> str:
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
        host_path = pod_volumes[mount["name"]]["hostPath"]
        assert host_path == {"path": path, "type": kind}, "same path on host and in pod"
        return mount["name"]

    sock_vol = host_mount(kvd, volumes, socket_dir, "DirectoryOrCreate")
    pool_vol = host_mount(kvd, volumes, shm_dir, "DirectoryOrCreate")

    # The one root step makes both host directories kvd's uid's alone (0700).
    uid = kvd["securityContext"]["runAsUser"]
    assert kvd["securityContext"].get("runAsNonRoot") is True
    (init,) = [c for c in spec.get("initContainers", []) if c["name"] != "kvd"]
    script = " ".join(str(x) for x in init["command"])
    assert "0o700" in script and f"os.chown(d, {uid}, " in script
    init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert init_mounts.keys() == {sock_vol, pool_vol}
    for path in init_mounts.values():
        assert path in init["command"], f"init container does not fix {path}"
    caps = init["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"] and caps["add"] == ["CHOWN"]
    assert init["securityContext"]["allowPrivilegeEscalation"] is False

    assert spec.get("hostIPC", False) is False and spec.get("hostPID", False) is False
    assert spec.get("hostNetwork", False) is False

    ports = {p["name"]: p["containerPort"] for p in kvd["ports"]}
    assert ports == {"kvd-peer": port_of(cfg.peer_address), "kvd-metrics": cfg.metrics_port}
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"),
                        ("livenessProbe", "/livez")):
        assert kvd[probe]["httpGet"] == {"path": path, "port": "kvd-metrics"}, probe
    assert cfg.metrics_host == "10.1.2.3"
    assert cfg.peer_address == f"tcp://10.1.2.3:{port_of(DEFAULTS.peer_address)}"
    assert "IPC_LOCK" in kvd["securityContext"]["capabilities"]["add"]
    assert spec["terminationGracePeriodSeconds"] > cfg.drain_timeout_s
    token_file = env_map(kvd)["KVD_AUTH_TOKEN_FILE"]["value"]
    (token_mount,) = [m for m in kvd["volumeMounts"]
                      if token_file.startswith(m["mountPath"].rstrip("/") + "/")]
    assert "secret" in volumes[token_mount["name"]]

    assert engines, "no engine workload"
    for workload in engines:
        espec = pod_spec(workload)
        engine_volumes = {v["name"]: v for v in espec["volumes"]}
        assert not [c for c in espec["containers"] + espec.get("initContainers", [])
                    if c["name"] == "kvd"], "engine pods carry no kvd of their own"
        for engine in espec["containers"]:
            assert engine.get("image"), f"{engine['name']} has no image (patch mismatch?)"
            env = env_map(engine)
            assert env["KVD_ENGINE_ADDRESS"]["value"] == cfg.engine_address
            assert env["KVD_AUTH_TOKEN_FILE"]["value"] == token_file
            # Same host directories at the same paths; must exist (the node's kvd
            # made them): an engine on a node without kvd waits instead.
            host_mount(engine, engine_volumes, socket_dir, "Directory")
            host_mount(engine, engine_volumes, shm_dir, "Directory")
            assert engine["securityContext"]["runAsUser"] == uid, \
                "engines must run as kvd's uid: the directories are 0700"
            mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
            secret = engine_volumes[mounts[str(Path(token_file).parent)]]["secret"]
            assert secret["secretName"] == volumes[token_mount["name"]]["secret"]["secretName"]
    return cfg
