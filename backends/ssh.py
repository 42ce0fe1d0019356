"""SSH to the hosts that run inference engines (Cloud TPU VMs, static hosts), with paramiko.

:class:`SSHPool` keeps one authenticated connection per ``(host, port)`` and runs commands,
shell scripts and file uploads over it; every blocking paramiko call runs in a worker thread
(:func:`asyncio.to_thread`), so the event loop never waits on the network.

Security (these are not options):

* Host keys are always verified: a ``known_hosts`` file (:attr:`SSHSettings.known_hosts`) and/or
  keys handed over in code (``trusted``: host -> ``["ssh-ed25519 AAAA...", ...]``, e.g. read from
  a TPU VM's guest attributes). Unknown hosts are rejected (:class:`paramiko.RejectPolicy`),
  a mismatched key is rejected; both are a :class:`ConfigError` naming the host, the fingerprint
  the server offered, and the file to add it to. Hosts on a port other than 22 are looked up as
  ``[host]:port``, as OpenSSH writes them.
* Public-key authentication only, with the one key file :attr:`SSHSettings.key_path` (no agent,
  no keys picked up from ``~/.ssh``).
* Command lines are ``shlex.join(argv)``: every argument arrives as one word, whatever spaces,
  quotes, ``$``, backticks or ``;`` it holds. Secrets never go on a command line: upload them
  with :meth:`SSHPool.put_file` (SFTP, mode 0600). Commands are logged at debug level; file
  contents never are.

Errors: network trouble and timeouts are retried (:func:`backends.base.with_retries`: up to
:attr:`SSHSettings.attempts` calls, exponential backoff with full jitter), then
:class:`TransientError`; a command that fails (``check=True``, exit status != 0) is a
:class:`BackendError` carrying the tail of its stderr; a wrong key, host key or user is a
:class:`ConfigError` (retrying cannot help).

A command that timed out or lost its connection may have run on the host (partly or wholly)
before it is retried: what runs through :meth:`SSHPool.run` must be safe to repeat (the
launcher's operations are).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
import posixpath
import shlex
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

import paramiko

from backends.base import BackendError, ConfigError, TransientError, with_retries

log = logging.getLogger(__name__)

T = TypeVar("T")

#: concurrent channels per connection; OpenSSH's sshd refuses more than ``MaxSessions``
#: (default 10) sessions on one connection
MAX_CHANNELS = 8
#: lines of stderr a failed command's :class:`BackendError` carries
STDERR_TAIL_LINES = 20


@dataclass(frozen=True)
class SSHSettings:
    """How to reach the engine hosts (the ``ssh`` section of the configuration)."""

    user: str
    key_path: str                  # private key file (no passphrase): ssh.key_path
    known_hosts: str | None        # known_hosts file; None when the keys come from `trusted`
    port: int = 22
    connect_timeout_s: float = 15.0
    command_timeout_s: float = 900.0
    attempts: int = 3


@dataclass(frozen=True)
class RunResult:
    """A finished remote command: exit status and its output, decoded as UTF-8 (undecodable
    bytes replaced). ``rc`` is -1 when the command died of a signal (the server then reports
    no exit status)."""

    rc: int
    stdout: str
    stderr: str


class _Transient(Exception):
    """Inside a worker thread: the connection or the command failed in a way worth retrying.
    ``drop``: the connection is broken (close it; the next attempt reconnects)."""

    def __init__(self, message: str, drop: bool = True):
        super().__init__(message)
        self.drop = drop


class _UnknownHost(paramiko.SSHException):
    """The server's host key is in neither the known_hosts file nor ``trusted``."""

    def __init__(self, name: str, key: paramiko.PKey):
        super().__init__(f"Server {name!r} not found in known_hosts")
        self.key = key


class _RejectUnknown(paramiko.RejectPolicy):
    """:class:`paramiko.RejectPolicy` that keeps the key it refused, for the error message."""

    def missing_host_key(self, client, hostname, key):
        try:
            super().missing_host_key(client, hostname, key)
        except paramiko.SSHException:
            pass
        raise _UnknownHost(hostname, key)


def _host_key_name(host: str, port: int) -> str:
    """How a host appears in known_hosts: ``host`` on port 22, else ``[host]:port``."""
    return host if port == 22 else f"[{host}]:{port}"


def parse_host_key(line: str) -> paramiko.PKey:
    """A public host key from ``"ssh-ed25519 AAAA... [comment]"`` (a known_hosts line without
    the host names); :class:`ConfigError` when it is not one."""
    fields = line.split()
    if len(fields) < 2:
        raise ConfigError(f"trusted host key {line[:60]!r} must read 'TYPE BASE64 [comment]'")
    try:
        return paramiko.PKey.from_type_string(fields[0], base64.b64decode(fields[1],
                                                                          validate=True))
    except (binascii.Error, ValueError, paramiko.SSHException) as e:
        raise ConfigError(f"trusted host key {line[:60]!r} is not a valid {fields[0]} public "
                          f"key: {e}") from None


class SSHPool:
    """One SSH connection per ``(host, port)``, reused by every call and reopened when it has
    died. ``trusted`` adds host keys (``host -> ["ssh-ed25519 AAAA...", ...]``) to those of
    ``settings.known_hosts``. ``backoff_s`` is the first retry's backoff ceiling (doubling up to
    10 s, full jitter).

    Coroutines can run on any event loop (the pool holds no loop-bound state); many may share
    one connection at a time (up to :data:`MAX_CHANNELS` channels each, the rest wait)."""

    def __init__(self, settings: SSHSettings,
                 trusted: Mapping[str, Sequence[str]] | None = None, *,
                 backoff_s: float = 0.5):
        if settings.attempts < 1:
            raise ConfigError(f"ssh.attempts must be >= 1, not {settings.attempts}")
        if not settings.user:
            raise ConfigError("ssh.user must not be empty")
        self.settings = settings
        self._backoff_s = backoff_s
        self._lock = threading.Lock()                         # guards the dicts below
        self._trusted: dict[str, list[paramiko.PKey]] = {}
        self._homes: dict[str, str] = {}
        self._clients: dict[tuple[str, int], paramiko.SSHClient] = {}
        self._connecting: dict[tuple[str, int], threading.Lock] = {}
        self._channels: dict[tuple[str, int], threading.BoundedSemaphore] = {}
        self.trust(trusted or {})

    def trust(self, trusted: Mapping[str, Sequence[str]]) -> None:
        """Add trusted host keys: ``host -> ["ssh-ed25519 AAAA...", ...]`` (``host`` as
        connected to, or ``[host]:port``). They count from the next connection on (an open
        connection was verified already). :class:`ConfigError` for a line that is no key."""
        parsed = {h: [parse_host_key(k) for k in keys] for h, keys in trusted.items()}
        with self._lock:
            for h, keys in parsed.items():
                have = self._trusted.setdefault(h, [])
                have.extend(k for k in keys if k not in have)

    # ---- public coroutines ---------------------------------------------------------------

    async def run(self, host: str, argv: Sequence[str], *, timeout_s: float | None = None,
                  check: bool = True, stdin_data: bytes | None = None) -> RunResult:
        """Run ``argv`` on ``host`` (as ``shlex.join(argv)``: the remote login shell sees every
        argument quoted) and wait for it, up to ``timeout_s`` (default
        ``settings.command_timeout_s``). ``stdin_data`` is written to its stdin, then EOF."""
        if isinstance(argv, (str, bytes)) or not argv:
            raise ValueError("argv must be a non-empty sequence of arguments, not a string")
        argv = [str(a) for a in argv]
        return await self._run_cmd(host, shlex.join(argv), timeout_s, check, stdin_data)

    async def run_shell(self, host: str, script: str, *, timeout_s: float | None = None,
                        check: bool = True, stdin_data: bytes | None = None) -> RunResult:
        """Run a POSIX shell script on ``host`` (``sh -c SCRIPT``, the script quoted as one
        argument, so the login shell does not interpret it first)."""
        return await self.run(host, ["sh", "-c", script], timeout_s=timeout_s, check=check,
                              stdin_data=stdin_data)

    async def put_file(self, host: str, remote_path: str, data: bytes,
                       mode: int = 0o600) -> None:
        """Write ``data`` to ``remote_path`` on ``host`` over SFTP (parent directories created,
        mode 0700), with ``mode`` set before a byte is written, and renamed into place at the
        end (readers never see half a file). A leading ``~/`` is the login's home directory.
        Nothing of ``data`` is logged or appears on a command line."""
        if not remote_path or remote_path.endswith("/"):
            raise ValueError(f"remote_path {remote_path!r} must name a file")
        log.debug("ssh %s: put %s (%d bytes, mode %o)", host, remote_path, len(data), mode)
        await self._call(host, lambda c: self._put(c, remote_path, bytes(data), mode))

    async def home(self, host: str) -> str:
        """The login's home directory on ``host`` (``$HOME``), asked once per host."""
        home = self._homes.get(host)
        if home is None:
            res = await self.run(host, ["sh", "-c", 'printf "%s\\n" "$HOME"'])
            home = res.stdout.strip()
            if not home.startswith("/"):
                raise BackendError(f"ssh {self._where(host)}: $HOME is {home!r}, not an "
                                   "absolute path")
            self._homes[host] = home
        return home

    async def close(self) -> None:
        """Close every connection (a later call opens a new one)."""
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for c in clients:
            await asyncio.to_thread(c.close)

    # ---- internals -----------------------------------------------------------------------

    def _key(self, host: str) -> tuple[str, int]:
        return host, self.settings.port

    def _where(self, host: str) -> str:
        return f"{self.settings.user}@{host}:{self.settings.port}"

    async def _run_cmd(self, host: str, cmd: str, timeout_s: float | None, check: bool,
                       stdin_data: bytes | None) -> RunResult:
        timeout = self.settings.command_timeout_s if timeout_s is None else timeout_s
        log.debug("ssh %s: run %s", self._where(host), cmd)
        res = await self._call(host, lambda c: self._exec(c, cmd, stdin_data, timeout))
        log.debug("ssh %s: rc %d", self._where(host), res.rc)
        if check and res.rc != 0:
            tail = "\n".join(res.stderr.strip().splitlines()[-STDERR_TAIL_LINES:])
            short = cmd if len(cmd) <= 240 else cmd[:120] + " ... " + cmd[-115:]
            what = "died of a signal" if res.rc == -1 else f"exited with status {res.rc}"
            raise BackendError(f"ssh {self._where(host)}: `{short}` {what}"
                               + (f"; stderr:\n{tail}" if tail else " (no stderr)"))
        return res

    async def _call(self, host: str, fn: Callable[[paramiko.SSHClient], T]) -> T:
        """``fn(client)`` in a worker thread, retried on connection trouble."""
        def attempt() -> T:
            client = self._client(host)
            sem = self._semaphore(host)
            with sem:
                try:
                    return fn(client)
                except _Transient as e:
                    if e.drop:
                        self._drop(host, client)
                    raise
                except (paramiko.SSHException, EOFError, OSError) as e:
                    t = client.get_transport()
                    if (type(e) in (OSError, FileNotFoundError, PermissionError)
                            and t is not None and t.is_active()):
                        # an SFTP status error (no such file, permission denied): the request
                        # is wrong, the connection is fine
                        raise BackendError(f"ssh {self._where(host)}: {e}") from None
                    # the connection broke under us (a channel could not open, SFTP lost...)
                    self._drop(host, client)
                    raise _Transient(f"connection lost: {type(e).__name__}: {e}") from None

        tries = 0

        async def once() -> T:
            nonlocal tries
            tries += 1
            try:
                return await asyncio.to_thread(attempt)
            except _Transient as e:
                log.debug("ssh %s: attempt %d/%d failed: %s", self._where(host), tries,
                          self.settings.attempts, e)
                raise TransientError(f"ssh {self._where(host)}: {e} (attempt {tries} of "
                                     f"{self.settings.attempts})") from None

        return await with_retries(once, attempts=self.settings.attempts,
                                  base_s=self._backoff_s, max_s=10.0)

    def _semaphore(self, host: str) -> threading.BoundedSemaphore:
        with self._lock:
            return self._channels.setdefault(self._key(host),
                                             threading.BoundedSemaphore(MAX_CHANNELS))

    def _drop(self, host: str, client: paramiko.SSHClient) -> None:
        with self._lock:
            if self._clients.get(self._key(host)) is client:
                del self._clients[self._key(host)]
        client.close()

    def _client(self, host: str) -> paramiko.SSHClient:
        """The live connection to ``host`` (opened when there is none or it died)."""
        key = self._key(host)
        with self._lock:
            gate = self._connecting.setdefault(key, threading.Lock())
        with gate:                                  # one thread connects, the others wait
            with self._lock:
                c = self._clients.get(key)
            if c is not None:
                t = c.get_transport()
                if t is not None and t.is_active():
                    return c
                log.debug("ssh %s: connection died, reconnecting", self._where(host))
                self._drop(host, c)
            c = self._connect(host)
            with self._lock:
                self._clients[key] = c
            return c

    def _connect(self, host: str) -> paramiko.SSHClient:
        s = self.settings
        where = self._where(host)
        self._check_key_file()
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(_RejectUnknown())
        if s.known_hosts is not None:
            path = os.path.expanduser(s.known_hosts)
            if not os.path.isfile(path):
                raise ConfigError(f"ssh.known_hosts: {path} does not exist (it lists the host "
                                  "keys the engine hosts must present)")
            try:
                client.load_host_keys(path)
            except (OSError, paramiko.SSHException) as e:
                raise ConfigError(f"ssh.known_hosts: cannot read {path}: {e}") from None
        name = _host_key_name(host, s.port)
        with self._lock:
            trusted = self._trusted.get(host, []) + self._trusted.get(name, [])
        for k in trusted:
            client.get_host_keys().add(name, k.get_name(), k)
        log.debug("ssh %s: connecting", where)
        try:
            client.connect(host, port=s.port, username=s.user, key_filename=s.key_path,
                           look_for_keys=False, allow_agent=False,
                           timeout=s.connect_timeout_s, banner_timeout=s.connect_timeout_s,
                           auth_timeout=s.connect_timeout_s,
                           channel_timeout=s.connect_timeout_s)
        except _UnknownHost as e:
            client.close()
            raise ConfigError(self._host_key_help(host, e.key, None)) from None
        except paramiko.BadHostKeyException as e:
            client.close()
            raise ConfigError(self._host_key_help(host, e.key, e.expected_key)) from None
        except paramiko.AuthenticationException as e:
            client.close()
            raise ConfigError(f"ssh {where}: the server refused user {s.user!r} with the key "
                              f"ssh.key_path = {s.key_path} ({e}); add its public key to that "
                              f"user's authorized_keys on {host}, or fix ssh.user") from None
        except (socket.timeout, TimeoutError) as e:
            client.close()
            raise _Transient(f"connect timed out after {s.connect_timeout_s:g}s "
                             f"({e or 'timeout'})") from None
        except (paramiko.SSHException, EOFError, OSError) as e:
            client.close()
            raise _Transient(f"cannot connect: {type(e).__name__}: {e}") from None
        t = client.get_transport()
        if t is not None:
            t.set_keepalive(30)                     # notice half-open connections
        log.debug("ssh %s: connected", where)
        return client

    def _check_key_file(self) -> None:
        path = os.path.expanduser(self.settings.key_path)
        if not self.settings.key_path or not os.path.isfile(path):
            raise ConfigError(f"ssh.key_path: private key file {path!r} does not exist")
        if not os.access(path, os.R_OK):
            raise ConfigError(f"ssh.key_path: private key file {path} is not readable")
        try:
            paramiko.PKey.from_path(path)
        except paramiko.PasswordRequiredException:
            raise ConfigError(f"ssh.key_path: {path} is protected by a passphrase; use a key "
                              "without one (this is an unattended service)") from None
        except (paramiko.SSHException, OSError, ValueError) as e:
            raise ConfigError(f"ssh.key_path: {path} is not a usable private key: {e}") from None

    def _host_key_help(self, host: str, offered: paramiko.PKey,
                       expected: paramiko.PKey | None) -> str:
        s = self.settings
        name = _host_key_name(host, s.port)
        kh = (f"the known_hosts file ssh.known_hosts = {s.known_hosts}" if s.known_hosts
              else "a known_hosts file (set ssh.known_hosts)")
        line = f"{name} {offered.get_name()} {offered.get_base64()}"
        if expected is None:
            head = (f"ssh {self._where(host)}: unknown host key: {name} offered "
                    f"{offered.get_name()} {offered.fingerprint}, which is in neither "
                    f"{s.known_hosts or 'a known_hosts file'} nor the trusted keys")
        else:
            head = (f"ssh {self._where(host)}: HOST KEY MISMATCH: {name} offered "
                    f"{offered.get_name()} {offered.fingerprint} but "
                    f"{expected.get_name()} {expected.fingerprint} is expected (the host was "
                    "re-created, or someone is intercepting the connection)")
        return (f"{head}. Nothing was run. Once you have checked the fingerprint out of band "
                f"(e.g. the VM's guest attributes or serial console), add the line\n  {line}\n"
                f"to {kh}" + (", replacing the old line" if expected is not None else ""))

    # ---- in worker threads ---------------------------------------------------------------

    def _exec(self, client: paramiko.SSHClient, cmd: str, stdin_data: bytes | None,
              timeout: float) -> RunResult:
        t = client.get_transport()
        if t is None or not t.is_active():
            raise _Transient("connection lost before the command started")
        chan = t.open_session(timeout=self.settings.connect_timeout_s)
        try:
            chan.exec_command(cmd)
            if stdin_data:
                chan.sendall(stdin_data)
            chan.shutdown_write()
            out: list[bytes] = []
            err: list[bytes] = []
            deadline = time.monotonic() + timeout
            nap = 0.001
            while True:
                got = False
                while chan.recv_ready():
                    out.append(chan.recv(65536))
                    got = True
                while chan.recv_stderr_ready():
                    err.append(chan.recv_stderr(65536))
                    got = True
                # done: an exit status (or a close) and the end of the output
                if chan.status_event.is_set() and (chan.eof_received or chan.closed) \
                        and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if time.monotonic() > deadline:
                    # the connection is fine (other channels may be busy on it); the remote
                    # process, which has no terminal, is not killed by closing the channel
                    raise _Transient(f"command timed out after {timeout:g}s", drop=False)
                if got:
                    nap = 0.001
                else:
                    chan.status_event.wait(nap)    # wakes early on the exit status
                    nap = min(nap * 2, 0.05)
            rc = chan.exit_status
            if rc == -1 and not t.is_active():
                raise _Transient("connection lost while the command ran")
            return RunResult(rc, b"".join(out).decode("utf-8", "replace"),
                             b"".join(err).decode("utf-8", "replace"))
        finally:
            chan.close()

    def _put(self, client: paramiko.SSHClient, remote_path: str, data: bytes,
             mode: int) -> None:
        sftp = client.open_sftp()
        try:
            path = remote_path
            if path == "~" or path.startswith("~/"):
                path = sftp.normalize(".") + path[1:]
            parent = posixpath.dirname(path)
            if parent:
                self._mkdirs(sftp, parent)
            tmp = posixpath.join(parent, f".{posixpath.basename(path)}.{os.urandom(4).hex()}"
                                         ".tmp")
            try:
                with sftp.open(tmp, "wb") as f:
                    f.chmod(mode)                      # before the first byte is written
                    f.set_pipelined(True)
                    f.write(data)
                try:
                    sftp.posix_rename(tmp, path)
                except OSError:                        # no posix-rename extension
                    try:
                        sftp.remove(path)
                    except OSError:
                        pass
                    sftp.rename(tmp, path)
            except BaseException:
                try:
                    sftp.remove(tmp)
                except Exception:
                    pass
                raise
        finally:
            sftp.close()

    @staticmethod
    def _mkdirs(sftp: paramiko.SFTPClient, path: str) -> None:
        missing = []
        p = path
        while p and p not in ("/", "."):
            try:
                sftp.stat(p)
                break
            except FileNotFoundError:
                missing.append(p)
                p = posixpath.dirname(p)
        for d in reversed(missing):
            try:
                sftp.mkdir(d, mode=0o700)
            except OSError:
                sftp.stat(d)                           # created meanwhile: fine; else raises


__all__ = ["SSHSettings", "RunResult", "SSHPool", "parse_host_key", "MAX_CHANNELS"]
