"""The cluster config's backend sections (``tpu:``, ``hosts:``, ``ssh:``, ``engine:``) as typed
settings, and the backend they describe. Every mistake is one :class:`ConfigError` naming the
setting (``deploy/gcp/cluster.yaml`` documents each field)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .base import Backend, ConfigError
from .engine import EngineSettings

REMOTE_BACKENDS = ("tpu", "static")


def ssh_settings(d: Mapping[str, Any] | None, *, need_known_hosts: bool,
                 check_files: bool = True):
    """``ssh:``: user, key_path, known_hosts, port, connect_timeout_s, command_timeout_s,
    attempts. ``check_files=False`` (a dry run on another machine) skips the files' checks."""
    from .ssh import SSHSettings
    d = {str(k).replace("-", "_"): v for k, v in dict(d or {}).items()}
    known = set(SSHSettings.__dataclass_fields__)
    for k in d:
        if k not in known:
            raise ConfigError(f"ssh: unknown setting {k!r}; known: {', '.join(sorted(known))}")
    user = d.get("user")
    if not isinstance(user, str) or not user.strip():
        raise ConfigError("ssh.user must name the login on the hosts (OS Login: your POSIX "
                          "user name, e.g. sa_1234567890)")
    key = d.get("key_path", "~/.ssh/google_compute_engine")
    if not isinstance(key, str) or not key:
        raise ConfigError("ssh.key_path must be the path of a private key file")
    key = str(Path(key).expanduser())
    if check_files and not Path(key).is_file():
        raise ConfigError(f"ssh.key_path: no private key at {key}")
    kh = d.get("known_hosts")
    if kh is None and need_known_hosts:
        kh = "~/.ssh/known_hosts"
    if kh is not None:
        if not isinstance(kh, str) or not kh:
            raise ConfigError("ssh.known_hosts must be the path of a known_hosts file")
        kh = str(Path(kh).expanduser())
        if check_files and need_known_hosts and not Path(kh).is_file():
            raise ConfigError(f"ssh.known_hosts: no file at {kh} (host keys are verified, "
                              "never accepted blindly: add the hosts' keys there)")
    vals: dict[str, Any] = {"user": user, "key_path": key, "known_hosts": kh}
    for name, kind in (("port", int), ("connect_timeout_s", (int, float)),
                       ("command_timeout_s", (int, float)), ("attempts", int)):
        if name in d:
            v = d[name]
            if isinstance(v, bool) or not isinstance(v, kind) or not v > 0:
                raise ConfigError(f"ssh.{name} must be a number > 0 (got {v!r})")
            vals[name] = v
    if not 1 <= vals.get("port", 22) <= 65535:
        raise ConfigError("ssh.port must be 1-65535")
    return SSHSettings(**vals)


@dataclass(frozen=True)
class Sections:
    """A remote backend's settings, parsed and checked."""

    kind: str                   # tpu | static
    engine: EngineSettings
    ssh: Any                    # backends.ssh.SSHSettings
    tpu: Any = None             # backends.tpu.TpuSettings (kind tpu)
    hosts: tuple = ()           # backends.static.StaticHost (kind static)


def parse_sections(kind: str, sections: Mapping[str, Any], catalog, served_model_name: str,
                   *, check_files: bool = True) -> Sections:
    """The config's ``engine``, ``ssh`` and ``tpu`` or ``hosts`` sections; one
    :class:`ConfigError` naming the first bad setting. ``check_files=False`` (a dry run on
    another machine) does not require the SSH key files to exist here."""
    if kind not in REMOTE_BACKENDS:
        raise ConfigError(f"backend {kind!r}: expected one of {', '.join(REMOTE_BACKENDS)}")
    missing = [m for m in ("paramiko", "google.cloud.tpu_v2") if not _installed(m)]
    if missing:
        raise ConfigError(f"the {kind} backend needs {' and '.join(missing)}: pip install "
                          "'neuscale[tpu]'")
    engine = EngineSettings.from_mapping(sections.get("engine"),
                                         served_model_name=served_model_name)
    if not engine.model:
        raise ConfigError("engine.model must name the weights the engines serve: a Hugging "
                          "Face id (e.g. meta-llama/Meta-Llama-3-8B-Instruct), a gs:// path "
                          "or a directory on the hosts")
    if kind == "tpu":
        from .tpu import TpuSettings
        tpu = TpuSettings.from_mapping(sections.get("tpu"))
        for chip in tpu.zones:
            catalog.get(chip)
        ssh = ssh_settings(sections.get("ssh"), need_known_hosts=tpu.host_keys == "known-hosts",
                           check_files=check_files)
        return Sections(kind, engine, ssh, tpu=tpu)
    from .static import parse_hosts
    hosts = tuple(parse_hosts(sections.get("hosts"), catalog))
    ssh = ssh_settings(sections.get("ssh"), need_known_hosts=True, check_files=check_files)
    return Sections(kind, engine, ssh, hosts=hosts)


def _installed(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:            # a missing parent package (google.cloud)
        return False


def make_backend(kind: str, sections: Mapping[str, Any], catalog, served_model_name: str,
                 environ: Mapping[str, str] | None = None) -> Backend:
    """The backend ``kind`` (tpu | static) from the config's sections (``tpu``, ``hosts``,
    ``ssh``, ``engine``); nothing is contacted yet."""
    p = parse_sections(kind, sections, catalog, served_model_name)
    from .remote import RemoteEngines
    remote = RemoteEngines(p.ssh, p.engine, os.environ if environ is None else environ)
    if kind == "tpu":
        from .tpu import TpuBackend
        return TpuBackend(p.tpu, p.engine, remote, catalog)
    from .static import StaticBackend
    return StaticBackend(p.hosts, remote, catalog)


__all__ = ["REMOTE_BACKENDS", "Sections", "ssh_settings", "parse_sections", "make_backend"]
