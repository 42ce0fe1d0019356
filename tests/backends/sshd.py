"""A real OpenSSH server on 127.0.0.1 for the SSH layer's tests (:mod:`backends.ssh`,
:mod:`backends.launcher`).

:class:`LocalSSHD` runs ``/usr/sbin/sshd -D -e -f CONFIG`` on a free port with a throw-away
ed25519 host key and user key in a temporary directory: key-only login for the current user,
no PAM, no environment accepted from the client, sshd's own log kept in ``sshd.log`` (one
``Accepted publickey`` line per connection, which the tests count). The module fixture
:func:`sshd` skips the tests, saying why, when ``/usr/sbin/sshd`` is missing (CI installs it with
``apt-get install -y openssh-server``). Import it next to the tests like the other helpers of
this directory: ``from sshd import LocalSSHD, sshd``.
"""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = "/run/sshd"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path, comment: str) -> str:
    """A new passphrase-less ed25519 key at ``path``; returns its public line
    ``ssh-ed25519 AAAA... comment``."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                    "-f", str(path)], check=True, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.chmod(path, 0o600)
    return Path(f"{path}.pub").read_text().strip()


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, ppid) of a process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    comm = raw[raw.index("(") + 1:raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2:].split()
    return comm, rest[0], int(rest[1])


def _comm(pid: int) -> str | None:
    st = _stat(pid)
    return st[0] if st else None


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may linger when pid 1 does not reap)."""
    st = _stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            children.setdefault(st[2], []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class LocalSSHD:
    """One sshd process on 127.0.0.1:``port`` (see the module docstring). Attributes for the
    client: ``host``, ``port``, ``user``, ``key_path`` (the user's private key),
    ``known_hosts_path`` (a known_hosts file with the single line ``host_key_line``:
    ``[127.0.0.1]:PORT ssh-ed25519 AAAA...``), ``host_public`` (``ssh-ed25519 AAAA...``, as a
    TPU VM's guest attributes give it) and ``dir`` (the temp directory, removed by
    :meth:`close`)."""

    def __init__(self, extra_hosts: tuple[str, ...] = ()) -> None:
        if not os.path.exists(SSHD):
            raise FileNotFoundError(SSHD)
        self.dir = Path(tempfile.mkdtemp(prefix="neuscale-sshd-"))
        self.host = "127.0.0.1"
        self.port = free_port()
        self.user = getpass.getuser()
        self.host_key_path = self.dir / "ssh_host_ed25519_key"
        self.key_path = str(self.dir / "id_ed25519")
        self.host_public = " ".join(keygen(self.host_key_path, "neuscale-test-host").split()[:2])
        user_public = keygen(Path(self.key_path), "neuscale-test-user")
        self.authorized_keys = self.dir / "authorized_keys"
        self.authorized_keys.write_text(user_public + "\n")
        os.chmod(self.authorized_keys, 0o600)
        self.host_key_line = f"[{self.host}]:{self.port} {self.host_public}"
        self.known_hosts_path = str(self.dir / "known_hosts")
        Path(self.known_hosts_path).write_text(self.host_key_line + "\n")
        self.log_path = self.dir / "sshd.log"
        self.config_path = self.dir / "sshd_config"
        # more loopback addresses (127.0.0.2, ...): several "hosts" on one machine, as the
        # workers of the fake TPU API's slices
        self.extra_hosts = tuple(extra_hosts)
        self.config_path.write_text("\n".join([
            *[f"ListenAddress {h}" for h in (self.host, *self.extra_hosts)],
            f"Port {self.port}",
            f"HostKey {self.host_key_path}",
            f"PidFile {self.dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "StrictModes no",
            "UsePAM no",
            "UseDNS no",
            "PrintMotd no",
            "X11Forwarding no",
            "AllowAgentForwarding no",
            "AllowTcpForwarding no",
            "PermitUserEnvironment no",
            "LogLevel INFO",
            "Subsystem sftp internal-sftp",
            "",                               # no AcceptEnv: the client's environment stays out
        ]))
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.start()

    # ---- life cycle ----------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> None:
        """Start sshd (again, on the same port with the same host key) and wait until the port
        accepts connections."""
        # the privilege-separation directory sshd insists on
        os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)
        os.chmod(PRIVSEP_DIR, 0o755)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config_path)],
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.proc.returncode}: {self.log()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"sshd did not listen on {self.port}: {self.log()}")
                time.sleep(0.05)

    def stop(self) -> None:
        """End sshd and the connections it serves. The per-connection sshd processes live in
        sessions of their own (sshd calls ``setsid`` for each connection), and a real sshd
        restart leaves them running; here they are ended too, by pid (the ``sshd`` processes
        descending from our listener), so every client connection drops. Processes the
        sessions launched (``setsid``: the engines of the tests) are not touched."""
        if self.proc is None:
            return
        children = [p for p in _descendants(self.proc.pid) if _comm(p) == "sshd"]
        for pid in [self.proc.pid, *children]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_running(p) for p in children):
            time.sleep(0.02)
        for pid in children:
            if _running(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- what the tests read -------------------------------------------------------------

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def accepted(self) -> int:
        """How many logins sshd has accepted so far (one per SSH connection)."""
        return self.log().count("Accepted publickey for ")


@pytest.fixture(scope="module")
def sshd():
    """A :class:`LocalSSHD` for the module's tests; skipped when sshd is not installed."""
    if not os.path.exists(SSHD):
        pytest.skip(f"{SSHD} is missing: install it with `apt-get install -y openssh-server` "
                    "to run the SSH tests against a real server")
    server = LocalSSHD()
    try:
        yield server
    finally:
        server.close()
