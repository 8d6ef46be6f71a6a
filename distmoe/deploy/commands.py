"""The Flower 1.42 commands of a deployment, built from a credentials directory (``distmoe deploy``).

Owns: the exact command line of the coordinator's ``flower-superlink`` (TLS, SuperNode
authentication, a state database, Flower's state directory ``FLWR_HOME``; run through :mod:`server.superlink`, which
keeps the content of messages in flight in memory), of a data owner's
``flower-supernode`` (CA certificate, authentication key, the node config distmoe reads:
``data-path``, ``party-name``, ``ledger-key``, ``work-dir`` (default ``<credentials dir>/work``),
``epsilon-max``, ``model-path``, and with ``--code-pin`` the owner's pinned ClientApp launcher first on its ``PATH``,
the SuperNode run through the owner's :mod:`clients.supernode` (Flower's, with a short idle poll) and the
SuperExec's task poll at 50 ms),
of the registration of each data owner's public key (``flwr supernode register``), and the
``$FLWR_HOME/config.toml`` connection the ``flwr`` CLI uses. Each is a :class:`FlowerCommand`
(argv + environment) that is printed for copy-paste or executed as is.

Flower does the transport, TLS and authentication; nothing here re-implements them: ``--exec``
replaces this process with the Flower process (``os.execvpe``), or, for registration, runs
``flwr`` once per key and reports its exit status.

Must not: import ``flwr`` (it calls Flower's executables), or hold credentials logic (that is
:mod:`distmoe.deploy.credentials`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from distmoe.config import HARDWARE_KEYS, PHASE_KINDS, ConfigError, NodeConfig, TrainConfig
from distmoe.deploy.credentials import (
    CredentialsError,
    PartyFiles,
    read_credentials,
    read_party_dir,
)
from distmoe.deploy.pin import CodePinError, pin_dir_of

DEFAULT_SUPERLINK_PORT = 8000  # flower-superlink's default (--port)
DEFAULT_SUPERNODE_PORT = 9094  # flower-supernode's local Runtime API (--port); one per SuperNode on a host
DEFAULT_CONNECTION = "distmoe"
# flwr 1.42's SuperExec asks its SuperNode for a task every second unless this says otherwise; the owner's SuperNode
# launcher (clients/supernode.py) wakes it as soon as there is a task, so this is only its fallback
SUPEREXEC_POLL_ENV, SUPEREXEC_POLL_S = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.5"
# Environment for every Flower process: no telemetry or update check (no network beyond the federation).
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}


class DeployError(CredentialsError):
    """A deploy command that cannot be built (the message names the option or the file)."""


@dataclass(frozen=True)
class FlowerCommand:
    """One Flower command: what to run and the environment variables it needs set."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """The command as one copy-pasteable POSIX shell line (env assignments first)."""
        envs = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*envs, *(shlex.quote(a) for a in self.argv)])

    def resolved_argv(self) -> list[str]:
        """argv with the executable found on PATH or next to this Python (a virtual environment's bin/)."""
        exe = self.argv[0]
        found = shutil.which(exe) or shutil.which(exe, path=str(Path(sys.executable).parent))
        if not found:
            raise DeployError(f"{exe} not found on PATH or next to {sys.executable}: install flwr 1.42 "
                              "in this environment")
        return [found, *self.argv[1:]]

    def full_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def exec(self) -> None:  # pragma: no cover - replaces the process
        """Replace this process with the command (signals and exit status are Flower's own)."""
        argv = self.resolved_argv()
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(argv[0], argv, self.full_env())

    def run(self, timeout: float | None = 60.0) -> subprocess.CompletedProcess:
        """Run the command to completion, output captured."""
        return subprocess.run(self.resolved_argv(), env=self.full_env(), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)


def _abs(p: str | os.PathLike[str]) -> str:
    return str(Path(p).expanduser().resolve())


def _need_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise DeployError(f"{path}: {what} not found (made by 'distmoe credentials')")


def flwr_env(flwr_home: str | os.PathLike[str] | None) -> dict[str, str]:
    env = dict(QUIET_ENV)
    if flwr_home:
        env["FLWR_HOME"] = _abs(flwr_home)
    return env


def toml_string(value: str, key: str) -> str:
    """A TOML string literal that Flower's ``--node-config`` parser keeps intact (it splits on
    whitespace outside one pair of quotes and allows no quote of the same kind inside)."""
    if '"' not in value and "\\" not in value:
        return f'"{value}"'
    if "'" not in value:
        return f"'{value}'"  # literal string: backslashes and double quotes verbatim
    raise DeployError(f"node config key '{key}': value {value!r} contains both quote characters; "
                      "use a path without quotes")


def node_config_string(items: Mapping[str, str | float | int]) -> str:
    """``key="value" key=1.5`` in Flower's ``--node-config`` syntax (TOML values)."""
    parts = []
    for k, v in items.items():
        if isinstance(v, bool):
            parts.append(f"{k}={'true' if v else 'false'}")
        elif isinstance(v, (int, float)):
            parts.append(f"{k}={v!r}")
        else:
            parts.append(f"{k}={toml_string(str(v), k)}")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------- coordinator
def superlink_command(credentials: str | os.PathLike[str], *, host: str = "127.0.0.1",
                      port: int = DEFAULT_SUPERLINK_PORT, database: str | os.PathLike[str] | None = None,
                      flwr_home: str | os.PathLike[str] | None = None,
                      runtime_dependency_installation: bool = False, link_state: str = "memory") -> FlowerCommand:
    """``flower-superlink`` with TLS (CA, certificate, key), SuperNode authentication and a state database, run
    through :mod:`server.superlink`: the content of messages in flight in memory, and with ``link_state``
    ``"memory"`` (the default) runs and messages too, the SuperNode registrations in the database; ``"database"``
    keeps Flower's link state (runs, registrations, messages' metadata) in the database.

    ``database`` defaults to ``<flwr_home>/superlink-state.db`` (or ``./superlink-state.db``); one is always
    given, so that the SuperNode registrations survive a restart.
    """
    creds = read_credentials(credentials)
    for path, what in ((creds.superlink_ca, "CA certificate"), (creds.server_cert, "server certificate"),
                       (creds.server_key, "server private key")):
        _need_file(path, what)
    if not 0 < port < 65536:
        raise DeployError(f"--port: value {port} is not a TCP port")
    if link_state not in ("memory", "database"):
        raise DeployError(f"--link-state: value {link_state!r} is not one of memory, database")
    db = _abs(database) if database else _abs(Path(flwr_home or ".") / "superlink-state.db")
    argv = [sys.executable, "-P", "-m", "server.superlink",  # Flower's, its working state in memory
            "--link-state", link_state,
            "--ssl-ca-certfile", _abs(creds.superlink_ca),
            "--ssl-certfile", _abs(creds.server_cert),
            "--ssl-keyfile", _abs(creds.server_key),
            "--enable-supernode-auth",
            "--host", host, "--port", str(port),
            "--database", db]
    if not runtime_dependency_installation:
        argv.append("--disable-runtime-dependency-installation")
    return FlowerCommand(tuple(argv), flwr_env(flwr_home))


def connection_toml(credentials: str | os.PathLike[str], address: str, name: str = DEFAULT_CONNECTION) -> str:
    """The ``[superlink.<name>]`` table for ``$FLWR_HOME/config.toml`` (TLS with the federation's CA)."""
    creds = read_credentials(credentials)
    _need_file(creds.superlink_ca, "CA certificate")
    _check_name(name)
    _check_address(address, "--address")
    return (f"[superlink.{name}]\naddress = {toml_string(address, 'address')}\n"
            f"root-certificates = {toml_string(_abs(creds.superlink_ca), 'root-certificates')}\n")


def add_connection(config_toml: str | os.PathLike[str], table: str, name: str) -> Path:
    """Append ``table`` to ``config_toml`` (the file ``flwr`` created), refusing a duplicate connection."""
    import tomllib

    path = Path(config_toml)
    if not path.is_file():
        raise DeployError(f"{path} not found: run 'flwr config list' once with this FLWR_HOME so flwr creates it")
    try:
        existing = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise DeployError(f"{path} is not valid TOML: {exc}") from None
    if name in existing.get("superlink", {}):
        raise DeployError(f"{path} already has a connection [superlink.{name}]; edit it or pick another --name")
    with path.open("a") as fh:
        fh.write("\n" + table)
    return path


@dataclass(frozen=True)
class Registration:
    """One data owner's registration: its name, the public key file and the ``flwr`` command that registers it."""

    party: str
    public_key: str
    command: FlowerCommand


def register_commands(credentials: str | os.PathLike[str], connection: str = DEFAULT_CONNECTION,
                      parties: Sequence[str] | None = None,
                      flwr_home: str | os.PathLike[str] | None = None,
                      json_output: bool = False) -> list[Registration]:
    """``flwr supernode register <pub> <connection> --name <party>`` for each data owner's public key
    (``json_output``: with ``--format json``, whose ``node-id`` :func:`registered_node_id` reads)."""
    creds = read_credentials(credentials)
    _check_name(connection)
    chosen = [creds.party(p) for p in parties] if parties else list(creds.parties)
    out = []
    for p in chosen:
        pub = creds.registered_pub(p.name)
        _need_file(pub, f"public key of {p.name}")
        argv = ("flwr", "supernode", "register", _abs(pub), connection, "--name", p.name)
        argv += ("--format", "json") if json_output else ()
        out.append(Registration(p.name, _abs(pub), FlowerCommand(argv, flwr_env(flwr_home))))
    return out


def registered_node_id(output: str) -> int:
    """The node ID Flower gave a registration: the ``node-id`` of ``flwr supernode register --format json``'s
    JSON object (flwr 1.42 prints ``{"success": true, "node-id": N}`` to stdout); ``DeployError`` otherwise."""
    start, end = output.find("{"), output.rfind("}")
    try:
        data = json.loads(output[start:end + 1]) if 0 <= start < end else None
    except json.JSONDecodeError:
        data = None
    node_id = data.get("node-id") if isinstance(data, dict) and data.get("success") else None
    if isinstance(node_id, bool) or not isinstance(node_id, int):
        raise DeployError(f"flwr supernode register printed no node ID: {output.strip()[:300]!r}")
    return node_id


def registration_table(rows: Sequence[tuple[str, str, str]]) -> str:
    """Owner name, public key file, node ID as aligned columns (the answer to 'which node is which owner')."""
    head = ("owner", "public key", "node ID")
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in (head, *rows)) + "\n"


# --------------------------------------------------------------------------------------------- data owner
def supernode_command(party_dir: str | os.PathLike[str], *, superlink: str, data_path: str | os.PathLike[str],
                      party_name: str | None = None, host: str = "127.0.0.1", port: int = DEFAULT_SUPERNODE_PORT,
                      work_dir: str | os.PathLike[str] | None = None, epsilon_max: float | None = None,
                      model_path: str | os.PathLike[str] | None = None,
                      flwr_home: str | os.PathLike[str] | None = None,
                      hardware: Mapping[str, str | int | bool] | None = None,
                      base_cache: str | os.PathLike[str] | None = None,
                      code_pin: str | os.PathLike[str] | None = None,
                      policy: Mapping[str, str | float | int | bool] | None = None,
                      check_paths: bool = True) -> FlowerCommand:
    """``flower-supernode`` with TLS (the federation's CA), its authentication key and distmoe's node config.

    ``party_dir`` is the data owner's credentials directory (``OUT/parties/<party>``); the party name
    defaults to the one it was made for. With ``check_paths`` the data directory must exist here.
    ``hardware`` holds the owner's own compute settings as node-config keys (``device``, ``dtype``,
    ``micro-batch-size``, ``gradient-checkpointing``, ``quantize``; ``distmoe.config.HARDWARE_KEYS``).
    ``code_pin`` is a directory made by ``distmoe deploy pin`` (:mod:`distmoe.deploy.pin`): its ``bin/`` goes
    first on the SuperNode's ``PATH``, so every ClientApp process is the owner's pinned launcher, which
    refuses an app bundle whose party code differs from the pin. ``policy`` (None: no owner policy) holds the
    owner's ``policy-*`` node-config keys that differ from the deployed defaults; with it the node config
    carries ``policy="deployed"`` and those keys (``distmoe.party.policy``, ``docs/deploy.md`` §2.3).
    """
    party: PartyFiles = read_party_dir(party_dir)
    if not party.ca_cert.is_file():
        raise DeployError(f"{party.ca_cert}: CA certificate not found; put the coordinator's ca.crt (its "
                          f"OUT/parties/{party.name}/ca.crt from 'distmoe credentials') there")
    for path, what in ((party.supernode_key, "SuperNode private key"), (party.ledger_key, "ledger signing key")):
        if not path.is_file():
            raise DeployError(f"{path}: {what} not found (made by 'distmoe deploy owner-keys')")
    _check_address(superlink, "--superlink")
    if not 0 < port < 65536:
        raise DeployError(f"--port: value {port} is not a TCP port")
    data = Path(data_path).expanduser()
    if check_paths and not data.is_dir():
        raise DeployError(f"--data-path: {data} is not a directory (one directory of <task>.jsonl files "
                          "for this party)")
    name = party_name or party.name
    if name != party.name:
        raise DeployError(f"--party-name {name!r} differs from the party these credentials were made for "
                          f"({party.name!r}, {party.info})")
    nc: dict[str, str | float] = {"data-path": _abs(data), "party-name": name, "ledger-key": _abs(party.ledger_key)}
    if not work_dir:  # next to the owner's keys, where docs/deploy.md shows it (one per owner on a shared host)
        legacy = data.parent / f".{name}-work"
        if legacy.is_dir():
            raise DeployError(f"{legacy} holds this party's earlier work (ledger, privacy budget; the old default): "
                              f"pass --work-dir {legacy} to keep using it, or move it to {party.dir / 'work'}")
        work_dir = party.dir / "work"
    nc["work-dir"] = _abs(work_dir)
    if model_path:
        nc["model-path"] = _abs(model_path)
    if base_cache:
        nc["base-cache"] = "off" if str(base_cache) == "off" else _abs(base_cache)
    if epsilon_max is not None:
        if not epsilon_max > 0:
            raise DeployError(f"--epsilon-max: value {epsilon_max} must be > 0")
        nc["epsilon-max"] = float(epsilon_max)
    if policy is not None:
        nc["policy"] = "deployed"
        nc.update(_checked_policy(policy))
    for k, v in (hardware or {}).items():
        if k not in HARDWARE_KEYS:
            raise DeployError(f"hardware setting {k!r} is not one of {', '.join(HARDWARE_KEYS)}")
        if v is not None:
            nc[k] = v
    try:
        # validated here exactly as the party will validate them, so a typo fails before anything starts
        NodeConfig(party=name, data_path=data, work_dir=data, model_path="",
                   hardware=tuple((HARDWARE_KEYS[k], v) for k, v in nc.items() if k in HARDWARE_KEYS)
                   ).train(TrainConfig())
    except ConfigError as exc:
        raise DeployError(str(exc)) from None
    env = flwr_env(flwr_home)
    if code_pin is not None:
        try:
            pin_file, bindir = pin_dir_of(code_pin)
        except CodePinError as exc:
            raise DeployError(f"--code-pin: {exc}") from None
        # the launcher first; then this Python's bin/ (flower-superexec), then the rest of the PATH
        env["PATH"] = os.pathsep.join([str(bindir), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        env[SUPEREXEC_POLL_ENV] = SUPEREXEC_POLL_S
    # with the pin: Flower's SuperNode through the owner's launcher, whose idle poll is short (clients.supernode)
    argv = (["flower-supernode"] if code_pin is None
            else [sys.executable, "-P", "-m", "clients.supernode", "--code-pin", str(pin_file)])
    argv += ["--root-certificates", _abs(party.ca_cert),
             "--auth-supernode-private-key", _abs(party.supernode_key),
             "--superlink", superlink,
             "--host", host, "--port", str(port),
             "--node-config", node_config_string(nc)]
    return FlowerCommand(tuple(argv), env)


# --------------------------------------------------------------------------------------------- checks
def _checked_policy(policy: Mapping[str, str | float | int | bool]) -> dict:
    """The owner's ``policy-*`` keys, checked as the party will (``distmoe.party.policy.owner_policy``)."""
    out = {}
    for k, v in policy.items():
        if v is None:
            continue
        flag = "--" + k
        if k in ("policy-allow-plaintext", "policy-allow-unpinned"):
            ok = isinstance(v, bool)
        elif k.startswith("policy-min-") and k.endswith("noise-multiplier"):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6
        elif k in ("policy-min-parties", "policy-max-rounds", "policy-max-runs"):
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= (2 if k == "policy-min-parties" else 1)
        elif k == "policy-phases":
            kinds = {x.strip() for x in str(v).split(",") if x.strip()}
            ok = bool(kinds) and kinds <= set(PHASE_KINDS)
        else:
            raise DeployError(f"{flag}: not an owner-policy setting")
        if not ok:
            raise DeployError(f"{flag}: value {v!r} is not allowed (docs/deploy.md §2.3)")
        out[k] = v
    return out


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise DeployError(f"connection name {name!r} must use only letters, digits, '-', '_'")


def _check_address(address: str, option: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or " " in address:
        raise DeployError(f"{option}: {address!r} is not host:port (e.g. 127.0.0.1:8000 or superlink.example.org:8000)")
