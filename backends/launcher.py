"""Engine processes on a remote host, over :class:`backends.ssh.SSHPool`.

:class:`EngineLauncher` starts, stops, inspects and lists named engine processes (the name is
a vPod id). Everything about one engine lives in ``WORKDIR/NAME/`` on its host (mode 0700):

====================  =========================================================================
``env``               ``export K='V'`` lines, mode 0600, uploaded over SFTP: the only place the
                      secret environment ever is (never a command line, never a log line)
``record.json``       the caller's record (e.g. the vPod spec): a restarted controller lists
                      what runs on a host from these
``argv.json``         the engine's command line (start is idempotent on it)
``run.sh``            the wrapper: writes ``pid``, sources ``env``, runs the engine in the
                      directory, then writes its exit status to ``exit``
``pid``               the wrapper's pid, which is also the engine's process group and session
``exit``              the engine's exit status (137 when :meth:`EngineLauncher.stop` had to
                      SIGKILL it)
``engine.log``        the engine's stdout and stderr (appended across restarts)
====================  =========================================================================

Detaching: over SSH, ``cd X && setsid nohup cmd &`` keeps the session open until ``cmd`` exits
(the ``&`` backgrounds the whole list, a subshell that holds the channel's stdout). The launch
backgrounds the wrapper alone, with all three streams redirected (stdin from /dev/null,
stdout and stderr to ``engine.log``), in a session of its own (``setsid``), so the SSH command
returns at once and nothing ties the engine to the connection.

The host must be Linux with a POSIX ``sh``, ``setsid`` (util-linux), ``ps`` (procps) and
``base64`` (coreutils): a stock Cloud TPU VM image. A process counts as running only when its
``pid`` names a live process whose command line is this engine's ``run.sh`` (a pid reused after
a reboot, or an unreaped zombie, does not count).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import posixpath
import random
import re
import shlex
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence

import aiohttp

from backends.base import BackendError, ConfigError, TransientError
from backends.ssh import SSHPool

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
STATES = ("running", "exited", "unknown")

# shell functions every script starts with: `alive DIR` (the wrapper of DIR runs) and
# `group_alive PGID` (a live, non-zombie process is in that group)
_PRELUDE = r"""
alive() {
  _p=$(cat "$1/pid" 2>/dev/null) || return 1
  case $_p in ''|*[!0-9]*) return 1;; esac
  [ -r "/proc/$_p/cmdline" ] || return 1
  tr '\000' '\n' < "/proc/$_p/cmdline" 2>/dev/null | grep -qxF "$1/run.sh"
}
group_alive() {
  ps -e -o pgid= -o stat= 2>/dev/null | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {f = 1} END {exit !f}'
}
b64() { base64 < "$1" 2>/dev/null | tr -d '\n'; }
"""


@dataclass(frozen=True)
class EngineInfo:
    """What a host says about one engine. ``status``: ``"running"``, ``"exited"`` (the
    directory is there, the process is not) or ``"unknown"`` (no such engine on the host).
    ``pid`` while running; ``exit_code`` once the wrapper (or :meth:`EngineLauncher.stop`)
    recorded one; ``record`` as given to :meth:`EngineLauncher.start` (None when unreadable)."""

    name: str
    status: str
    pid: int | None = None
    exit_code: int | None = None
    record: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "pid": self.pid,
                "exit_code": self.exit_code, "record": self.record}


def _int(s: str) -> int | None:
    s = s.strip()
    return int(s) if re.fullmatch(r"-?[0-9]+", s) else None


def _unb64_json(s: str) -> Any:
    s = s.strip()
    if not s:
        return None
    try:
        return json.loads(base64.b64decode(s))
    except ValueError:
        return None


class EngineLauncher:
    """Named engine processes on the hosts of ``pool`` (see the module docstring). ``workdir``
    on each host: ``~`` and relative paths are resolved against the login's ``$HOME`` (asked
    once per host)."""

    def __init__(self, pool: SSHPool, workdir: str = "~/.neuscale"):
        if not workdir or not workdir.strip():
            raise ConfigError("the launcher's workdir must not be empty")
        self.pool = pool
        self.workdir = workdir
        self._dirs: dict[str, str] = {}            # host -> absolute workdir

    # ---- public coroutines ---------------------------------------------------------------

    async def start(self, host: str, name: str, argv: Sequence[str], *,
                    env: Mapping[str, str] = {}, secret_env: Mapping[str, str] = {},
                    record: Mapping[str, Any] = {}) -> int:
        """Start engine ``name`` on ``host`` running ``argv`` (in ``WORKDIR/NAME`` with ``env``
        and ``secret_env`` exported) and return its pid as soon as it runs, without waiting
        for it to finish or to serve. Idempotent: when ``name`` already runs with the same
        ``argv`` its pid is returned (nothing is rewritten); with another ``argv`` it is a
        :class:`ConfigError` (stop it first)."""
        self._check_name(name)
        argv = self._check_argv(argv)
        env_text = self._env_file(env, secret_env)
        try:
            record_text = json.dumps(dict(record), sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"engine {name}: the record must be a JSON object: {e}") from None
        d = await self._dir(host, name)

        cur = await self.pool.run_shell(host, _PRELUDE + f"""
d={shlex.quote(d)}
if alive "$d"; then echo "running $(cat "$d/pid") $(b64 "$d/argv.json")"; else echo exited; fi
""")
        fields = cur.stdout.split()
        if fields and fields[0] == "running":
            pid = _int(fields[1]) if len(fields) > 1 else None
            old = _unb64_json(fields[2]) if len(fields) > 2 else None
            if old == argv and pid is not None:
                log.info("launcher %s: engine %s already runs (pid %d)", host, name, pid)
                return pid
            raise ConfigError(f"engine {name} already runs on {host} (pid {pid}) with another "
                              f"command line ({_short(old)}); stop it before starting "
                              f"{_short(argv)}")

        # the files first (the secrets only ever travel over SFTP), then the launch
        await self.pool.put_file(host, f"{d}/env", env_text.encode(), mode=0o600)
        await self.pool.put_file(host, f"{d}/argv.json", json.dumps(argv).encode(), mode=0o600)
        await self.pool.put_file(host, f"{d}/record.json", record_text.encode(), mode=0o600)
        await self.pool.put_file(host, f"{d}/run.sh", self._wrapper(d, argv).encode(),
                                 mode=0o700)
        res = await self.pool.run_shell(host, _PRELUDE + f"""
d={shlex.quote(d)}
cd "$d" || exit 1
if alive "$d"; then echo "running $(cat "$d/pid")"; exit 0; fi
rm -f "$d/exit" "$d/pid"
setsid sh "$d/run.sh" </dev/null >>"$d/engine.log" 2>&1 &
# until the wrapper has written its pid and runs (or the engine is done already): 5 s at most
n=0
while [ $n -lt 500 ] && ! alive "$d" && [ ! -f "$d/exit" ]; do sleep 0.01; n=$((n + 1)); done
if alive "$d"; then echo "started $(cat "$d/pid")"
elif [ -f "$d/exit" ]; then echo "exited $(cat "$d/pid" 2>/dev/null) $(cat "$d/exit")"
else echo "lost"; fi
""")
        fields = res.stdout.split()
        pid = _int(fields[1]) if len(fields) > 1 else None
        if fields and fields[0] in ("started", "running") and pid is not None:
            log.info("launcher %s: started engine %s (pid %d): %s", host, name, pid,
                     _short(argv))
            return pid
        if fields and fields[0] == "exited" and pid is not None:
            code = _int(fields[2]) if len(fields) > 2 else None
            log.warning("launcher %s: engine %s exited at once (status %s)", host, name, code)
            return pid
        raise BackendError(f"engine {name} on {host} did not start (launcher said "
                           f"{res.stdout.strip()!r}); see its log: "
                           f"{(await self.logs(host, name, lines=20)).strip()[-1000:]}")

    async def stop(self, host: str, name: str, grace_s: float = 30) -> None:
        """SIGTERM to the engine's process group, up to ``grace_s`` for it to end, then
        SIGKILL. Idempotent (an engine that does not run is not an error); the log stays, the
        ``pid`` file goes."""
        self._check_name(name)
        d = await self._dir(host, name)
        ticks = max(0, int(grace_s * 10))
        res = await self.pool.run_shell(host, _PRELUDE + f"""
d={shlex.quote(d)}
[ -d "$d" ] || exit 0
if alive "$d"; then
  p=$(cat "$d/pid")
  kill -TERM "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null
  n=0
  while group_alive "$p" && [ $n -lt {ticks} ]; do sleep 0.1; n=$((n + 1)); done
  if group_alive "$p"; then
    kill -KILL "-$p" 2>/dev/null
    echo killed
    n=0
    while group_alive "$p" && [ $n -lt 50 ]; do sleep 0.1; n=$((n + 1)); done
    [ -f "$d/exit" ] || echo 137 > "$d/exit"
  else
    echo stopped
  fi
fi
rm -f "$d/pid"
""", timeout_s=grace_s + 30)
        what = res.stdout.strip()
        if what:
            log.info("launcher %s: engine %s %s", host, name,
                     "killed after the grace period" if what == "killed" else "stopped")

    async def inspect(self, host: str, name: str) -> EngineInfo:
        """Status, pid, exit status and record of engine ``name`` on ``host``."""
        self._check_name(name)
        d = await self._dir(host, name)
        res = await self.pool.run_shell(host, _PRELUDE + f"""
d={shlex.quote(d)}
[ -d "$d" ] || {{ echo unknown; exit 0; }}
if alive "$d"; then s=running; p=$(cat "$d/pid"); else s=exited; p=-; fi
e=$(cat "$d/exit" 2>/dev/null); [ -n "$e" ] || e=-
r=$(b64 "$d/record.json"); [ -n "$r" ] || r=-
echo "$s $p $e $r"
""")
        return self._info(name, res.stdout.split())

    async def status(self, host: str, name: str) -> str:
        """``"running"``, ``"exited"`` or ``"unknown"`` (see :meth:`inspect` for the exit
        status)."""
        return (await self.inspect(host, name)).status

    async def list(self, host: str) -> list[dict[str, Any]]:
        """Every engine directory on ``host``, sorted by name: its record (as given to
        :meth:`start`) with the launcher's ``name``, ``status``, ``pid`` and ``exit_code``
        added (these four keys override the record's own, if it has them)."""
        w = await self._workdir(host)
        res = await self.pool.run_shell(host, _PRELUDE + f"""
w={shlex.quote(w)}
for d in "$w"/*/; do
  [ -d "$d" ] || continue
  d=${{d%/}}
  [ -f "$d/run.sh" ] || [ -f "$d/record.json" ] || continue
  if alive "$d"; then s=running; p=$(cat "$d/pid"); else s=exited; p=-; fi
  e=$(cat "$d/exit" 2>/dev/null); [ -n "$e" ] || e=-
  r=$(b64 "$d/record.json"); [ -n "$r" ] || r=-
  echo "${{d##*/}} $s $p $e $r"
done
""")
        out = []
        for line in res.stdout.splitlines():
            fields = line.split()
            if len(fields) == 5 and _NAME.match(fields[0]):
                info = self._info(fields[0], fields[1:])
                rec = dict(info.record) if isinstance(info.record, dict) else {}
                out.append({**rec, "name": info.name, "status": info.status, "pid": info.pid,
                            "exit_code": info.exit_code})
        return sorted(out, key=lambda i: i["name"])

    async def logs(self, host: str, name: str, lines: int = 200) -> str:
        """The last ``lines`` lines of the engine's log ("" when there is none)."""
        self._check_name(name)
        d = await self._dir(host, name)
        res = await self.pool.run_shell(
            host, f'f={shlex.quote(d + "/engine.log")}; [ -f "$f" ] || exit 0; '
                  f'tail -n {max(0, int(lines))} "$f"')
        return res.stdout

    async def remove(self, host: str, name: str, grace_s: float = 30) -> None:
        """:meth:`stop`, then delete the engine's directory (its log too). Idempotent."""
        await self.stop(host, name, grace_s=grace_s)
        d = await self._dir(host, name)
        await self.pool.run(host, ["rm", "-rf", "--", d])
        log.info("launcher %s: removed engine %s", host, name)

    # ---- internals -----------------------------------------------------------------------

    @staticmethod
    def _check_name(name: str) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"engine name {name!r} must be 1-63 letters, digits, '.', '_' or "
                              "'-', starting with a letter or digit")

    @staticmethod
    def _check_argv(argv: Sequence[str]) -> list[str]:
        if isinstance(argv, (str, bytes)) or not argv:
            raise ConfigError("argv must be a non-empty list of arguments, not a string")
        out = []
        for a in argv:
            if not isinstance(a, str) or "\0" in a:
                raise ConfigError(f"argv: {a!r} is not a string without NUL characters")
            out.append(a)
        return out

    @staticmethod
    def _env_file(env: Mapping[str, str], secret_env: Mapping[str, str]) -> str:
        both = set(env) & set(secret_env)
        if both:
            raise ConfigError(f"env and secret_env both set {sorted(both)}")
        lines = ["# written by neuscale: the engine's environment (mode 0600)"]
        for k, v in [*env.items(), *secret_env.items()]:
            # never the value in a message: it may be a secret
            if not isinstance(k, str) or not _ENV_KEY.match(k):
                raise ConfigError(f"environment variable name {k!r} must be letters, digits "
                                  "and '_', not starting with a digit")
            if not isinstance(v, str) or "\0" in v:
                raise ConfigError(f"environment variable {k}: the value must be a string "
                                  "without NUL characters")
            lines.append(f"export {k}={shlex.quote(v)}")
        return "\n".join(lines) + "\n"

    @staticmethod
    def _wrapper(d: str, argv: list[str]) -> str:
        q = shlex.quote
        return "\n".join([
            "#!/bin/sh",
            "# written by neuscale (backends/launcher.py): runs the engine of this directory",
            "# and records its exit status",
            f"echo $$ > {q(d + '/pid.tmp')} && mv -f {q(d + '/pid.tmp')} {q(d + '/pid')}",
            f"cd {q(d)} || exit 97",
            f". {q(d + '/env')}",
            # a trap with a command (not ''), so the engine does not inherit an ignored signal:
            # the group's SIGTERM reaches the engine, the wrapper outlives it to write `exit`
            "trap ':' TERM INT HUP",
            shlex.join(argv),
            "rc=$?",
            f"echo \"$rc\" > {q(d + '/exit.tmp')} && mv -f {q(d + '/exit.tmp')} {q(d + '/exit')}",
            'exit "$rc"',
            "",
        ])

    @staticmethod
    def _info(name: str, fields: list[str]) -> EngineInfo:
        if not fields or fields[0] not in STATES:
            raise TransientError(f"engine {name}: unreadable status {' '.join(fields)!r}")
        if fields[0] == "unknown" or len(fields) < 4:
            return EngineInfo(name, fields[0])
        return EngineInfo(name, fields[0], pid=_int(fields[1]), exit_code=_int(fields[2]),
                          record=_unb64_json(fields[3]) if fields[3] != "-" else None)

    async def _workdir(self, host: str) -> str:
        w = self._dirs.get(host)
        if w is None:
            w = self.workdir
            if w == "~" or w.startswith("~/") or not w.startswith("/"):
                home = await self.pool.home(host)
                rest = w[1:].lstrip("/") if w.startswith("~") else w
                w = posixpath.join(home, rest)
            w = posixpath.normpath(w)
            if w == "/":
                raise ConfigError("the launcher's workdir must not be /")
            self._dirs[host] = w
        return w

    async def _dir(self, host: str, name: str) -> str:
        return f"{await self._workdir(host)}/{name}"


def _short(argv: Any) -> str:
    s = shlex.join(argv) if isinstance(argv, list) else repr(argv)
    return s if len(s) <= 160 else s[:157] + "..."


async def wait_http_ready(url: str, *, timeout_s: float, health_path: str = "/health",
                          check: Callable[[str], Awaitable[Any]] | None = None,
                          watch: Callable[[], Awaitable[None]] | None = None,
                          watch_every_s: float = 5.0) -> None:
    """Poll ``url + health_path`` until it answers 200 and then, when given, until
    ``await check(url)`` succeeds (returns anything but False without raising: e.g. a first
    tiny completion). Backs off from 0.1 s to 2 s between tries (with jitter);
    :class:`TransientError` after ``timeout_s``, with the last error. ``watch()`` runs every
    ``watch_every_s`` between tries and ends the wait by raising (e.g. the engine process
    exited: no point waiting out the timeout)."""
    base = url.rstrip("/")
    health = base + (health_path if health_path.startswith("/") else "/" + health_path)
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    wait = 0.1
    watched = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if watch is not None and time.monotonic() - watched >= watch_every_s:
                watched = time.monotonic()
                await watch()
            up = False
            try:
                req_timeout = aiohttp.ClientTimeout(total=max(0.05, min(5.0, left)))
                async with session.get(health, timeout=req_timeout) as r:
                    await r.read()
                    up = r.status == 200
                    if not up:
                        last = f"{health} answered HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last = f"{health}: {type(e).__name__}: {e or 'timeout'}"
            if up:
                if check is None:
                    return
                try:
                    ok = await asyncio.wait_for(
                        check(base), timeout=max(0.05, deadline - time.monotonic()))
                    if ok is not False:
                        return
                    last = f"{health} is up, but the readiness check returned False"
                except asyncio.TimeoutError:
                    last = f"{health} is up, but the readiness check timed out"
                except Exception as e:                    # any failure of the check: try again
                    last = f"{health} is up, but the readiness check failed: " \
                           f"{type(e).__name__}: {e}"
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(left, wait * random.uniform(0.8, 1.2)))
            wait = min(2.0, wait * 2)
    raise TransientError(f"{base} not ready after {timeout_s:g}s: {last}")


__all__ = ["EngineLauncher", "EngineInfo", "wait_http_ready"]
