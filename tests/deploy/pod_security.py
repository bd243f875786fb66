"""The Pod Security Standards' checks (kubernetes.io/docs/concepts/security/pod-security-standards,
as the API server's admission plugin applies them, policy version v1.30) on a pod spec, offline:
`violations(spec, "baseline")` and `violations(spec, "restricted")` list what the namespace's
labels would refuse (enforce) or report (warn, audit). Windows-only fields are not evaluated (no
Windows nodes here).
"""

from __future__ import annotations

from typing import Any

LEVELS = ("baseline", "restricted")
# Capabilities baseline allows a container to add.
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip
VOLUME_META = {"name"}


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        *spec.get("initContainers", []),
        *spec.get("containers", []),
        *spec.get("ephemeralContainers", []),
    ]


def _baseline(spec: dict[str, Any], annotations: dict[str, str]) -> list[str]:
    out = []
    pod_sc = spec.get("securityContext") or {}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            out.append(f"{host}: true")
    for v in spec.get("volumes", []):
        if "hostPath" in v:
            out.append(f"volume {v['name']}: hostPath")
    contexts = [("pod", pod_sc)]
    for c in _containers(spec):
        sc = c.get("securityContext") or {}
        contexts.append((c["name"], sc))
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        added = set((sc.get("capabilities") or {}).get("add", []))
        if added - BASELINE_CAPABILITIES:
            out.append(f"{c['name']}: adds {sorted(added - BASELINE_CAPABILITIES)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{c['name']}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{c['name']}: procMount {sc['procMount']}")
    for who, sc in contexts:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{who}: hostProcess")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{who}: seccomp Unconfined")
        apparmor = (sc.get("appArmorProfile") or {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{who}: appArmorProfile {apparmor}")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{who}: seLinuxOptions {se}")
    for key, value in annotations.items():
        apparmor_key = key.startswith("container.apparmor.security.beta.kubernetes.io/")
        if apparmor_key and value != "runtime/default" and not value.startswith("localhost/"):
            out.append(f"annotation {key}: {value}")
    for s in pod_sc.get("sysctls", []):
        if s["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctl {s['name']}")
    return out


def _restricted(spec: dict[str, Any]) -> list[str]:
    out = []
    pod_sc = spec.get("securityContext") or {}
    for v in spec.get("volumes", []):
        kinds = set(v) - VOLUME_META
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    pod_non_root = pod_sc.get("runAsNonRoot")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_sc.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    for c in _containers(spec):
        name, sc = c["name"], c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation not false")
        non_root = sc.get("runAsNonRoot", pod_non_root)
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
    return out


def violations(
    spec: dict[str, Any], level: str, annotations: dict[str, str] | None = None
) -> list[str]:
    """What the `level` profile refuses in a pod spec (empty: the pod is admitted)."""
    assert level in LEVELS, level
    out = _baseline(spec, annotations or {})
    if level == "restricted":
        out += _restricted(spec)
    return out
