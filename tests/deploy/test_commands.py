"""``distmoe deploy``: the command lines it builds are the ones Flower 1.42 accepts.

Each argv is parsed by Flower's own argument parser (``flower-superlink``, ``flower-supernode``), and
the ``--node-config`` string by Flower's ``parse_config_args`` and then by distmoe's
``parse_node_config``, so a quoting or key mistake fails here rather than at a data owner's site.
The ``ledger-key`` node-config key is followed through to the ledger the party signs.
"""

from __future__ import annotations

import inspect
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from distmoe.cli import main
from distmoe.config import ConfigError, SimConfig, parse_node_config, parse_run_config
from distmoe.deploy import commands as dc
from distmoe.deploy import credentials as cr


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> cr.Credentials:
    return cr.create(tmp_path_factory.mktemp("creds") / "c", ["party-0", "party-1"])


def _sim() -> SimConfig:
    return parse_run_config({}).sim


def test_superlink_command_parses_with_flowers_parser(creds, tmp_path):
    from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink

    cmd = dc.superlink_command(creds.root, host="0.0.0.0", port=9300, flwr_home=tmp_path / "home")
    assert cmd.argv[:4] == (sys.executable, "-P", "-m", "server.superlink")  # Flower's, its state in memory
    from server.superlink import split_link_state

    link_state, flowers = split_link_state(list(cmd.argv[4:]))  # the launcher's own flag, the rest Flower's
    assert link_state == "memory"
    args = _parse_args_run_superlink().parse_args(flowers)
    assert Path(args.ssl_ca_certfile) == creds.superlink_ca.resolve()
    assert Path(args.ssl_certfile) == creds.server_cert.resolve()
    assert Path(args.ssl_keyfile) == creds.server_key.resolve()
    assert args.enable_supernode_auth and not args.insecure
    assert (args.host, args.port) == ("0.0.0.0", 9300)
    assert Path(args.database) == (tmp_path / "home" / "superlink-state.db").resolve()
    assert "--disable-runtime-dependency-installation" in cmd.argv
    assert cmd.env["FLWR_HOME"] == str((tmp_path / "home").resolve()) and cmd.env["FLWR_TELEMETRY_ENABLED"] == "0"
    # the printed line is the same command for a POSIX shell
    words = shlex.split(cmd.shell())
    assert words[len(cmd.env):] == list(cmd.argv)
    assert words[:len(cmd.env)] == [f"{k}={v}" for k, v in cmd.env.items()]
    with_deps = dc.superlink_command(creds.root, database=tmp_path / "s.db", runtime_dependency_installation=True)
    assert "--disable-runtime-dependency-installation" not in with_deps.argv
    assert with_deps.argv[with_deps.argv.index("--database") + 1] == str((tmp_path / "s.db").resolve())
    flowers_state = dc.superlink_command(creds.root, link_state="database")
    assert flowers_state.argv[flowers_state.argv.index("--link-state") + 1] == "database"
    with pytest.raises(dc.DeployError, match="--link-state: value 'disk' is not one of memory, database"):
        dc.superlink_command(creds.root, link_state="disk")


@pytest.mark.parametrize("odd", ["plain", "with space", 'with"quote', "back\\slash"])
def test_supernode_node_config_survives_flower_and_distmoe_parsing(creds, tmp_path, odd):
    from flwr.common.config import parse_config_args
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    data = tmp_path / odd / "party-0"
    data.mkdir(parents=True)
    party = creds.parties[0]
    cmd = dc.supernode_command(party.dir, superlink="superlink.example.org:9300", data_path=data, port=9500,
                               epsilon_max=2.5, work_dir=tmp_path / "work")
    args = _parse_args_run_supernode().parse_args(list(cmd.argv[1:]))
    assert Path(args.root_certificates) == party.ca_cert.resolve()
    assert Path(args.auth_supernode_private_key) == party.supernode_key.resolve()
    assert args.superlink == "superlink.example.org:9300" and args.port == 9500 and not args.insecure
    nc = parse_config_args([args.node_config])  # exactly what flower-supernode does with the string
    assert nc == {"data-path": str(data.resolve()), "party-name": "party-0",
                  "ledger-key": str(party.ledger_key.resolve()), "work-dir": str((tmp_path / "work").resolve()),
                  "epsilon-max": 2.5}
    node = parse_node_config(nc, _sim())  # and what the ClientApp then makes of it
    assert node.party == "party-0" and node.data_path == data.resolve() and node.epsilon_max == 2.5
    assert node.ledger_key == party.ledger_key.resolve() and node.work_dir == (tmp_path / "work").resolve()


def test_supernode_hardware_settings_reach_the_party(creds, tmp_path):
    from flwr.common.config import parse_config_args
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    data = tmp_path / "party-0"
    data.mkdir()
    party = creds.parties[0]
    cmd = dc.supernode_command(party.dir, superlink="127.0.0.1:9092", data_path=data,
                               hardware={"device": "cuda:1", "dtype": "bfloat16", "micro-batch-size": 2,
                                         "gradient-checkpointing": True, "quantize": None})
    nc = parse_config_args([_parse_args_run_supernode().parse_args(list(cmd.argv[1:])).node_config])
    train = parse_node_config(nc, _sim()).train(parse_run_config({}).train)
    assert (train.device, train.dtype, train.micro_batch_size, train.gradient_checkpointing) == \
        ("cuda:1", "bfloat16", 2, True)
    assert parse_node_config(nc, _sim()).base_cache == party.dir.resolve() / "work" / "base-cache"  # the default
    for given, expected in (("off", None), (tmp_path / "bc", tmp_path / "bc")):
        cmd = dc.supernode_command(party.dir, superlink="127.0.0.1:9092", data_path=data, base_cache=given)
        nc = parse_config_args([_parse_args_run_supernode().parse_args(list(cmd.argv[1:])).node_config])
        assert parse_node_config(nc, _sim()).base_cache == expected
    with pytest.raises(dc.DeployError, match="node config key 'device'.*'gpu'"):
        dc.supernode_command(party.dir, superlink="127.0.0.1:9092", data_path=data, hardware={"device": "gpu"})


def test_supernode_command_errors(creds, tmp_path):
    party = creds.parties[0].dir
    with pytest.raises(dc.DeployError, match="--data-path: .* is not a directory"):
        dc.supernode_command(party, superlink="127.0.0.1:9092", data_path=tmp_path / "nope")
    (tmp_path / "d").mkdir()
    with pytest.raises(dc.DeployError, match="--superlink: 'localhost' is not host:port"):
        dc.supernode_command(party, superlink="localhost", data_path=tmp_path / "d")
    with pytest.raises(dc.DeployError, match="differs from the party these credentials were made for"):
        dc.supernode_command(party, superlink="127.0.0.1:9092", data_path=tmp_path / "d", party_name="party-1")
    with pytest.raises(cr.CredentialsError, match="party.json not found"):
        dc.supernode_command(creds.root, superlink="127.0.0.1:9092", data_path=tmp_path / "d")
    with pytest.raises(dc.DeployError, match="both quote characters"):
        dc.toml_string("""a'b"c""", "data-path")


def test_register_commands_name_each_public_key(creds, tmp_path):
    from flwr.cli.supernode.register import try_load_public_key

    regs = dc.register_commands(creds.root, "prod", flwr_home=tmp_path / "cli")
    cmds = [r.command for r in regs]
    assert [c.argv[:3] for c in cmds] == [("flwr", "supernode", "register")] * 2
    assert [c.argv[4:] for c in cmds] == [("prod", "--name", "party-0"), ("prod", "--name", "party-1")]
    for r, p in zip(regs, creds.parties, strict=True):
        assert r.party == p.name and r.public_key == r.command.argv[3]
        assert try_load_public_key(Path(r.public_key)) == try_load_public_key(p.supernode_pub)
    assert [r.party for r in dc.register_commands(creds.root, parties=["party-1"])] == ["party-1"]
    json_regs = dc.register_commands(creds.root, "prod", json_output=True)
    assert [r.command.argv[-2:] for r in json_regs] == [("--format", "json")] * 2
    with pytest.raises(cr.CredentialsError, match="no party 'x'"):
        dc.register_commands(creds.root, parties=["x"])
    with pytest.raises(dc.DeployError, match="connection name"):
        dc.register_commands(creds.root, "bad name")


def test_connection_table_and_append(creds, tmp_path):
    table = dc.connection_toml(creds.root, "127.0.0.1:9300", "prod")
    parsed = tomllib.loads(table)["superlink"]["prod"]
    assert parsed == {"address": "127.0.0.1:9300", "root-certificates": str(creds.superlink_ca.resolve())}
    cfg = tmp_path / "config.toml"
    with pytest.raises(dc.DeployError, match="flwr config list"):
        dc.add_connection(cfg, table, "prod")
    cfg.write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    dc.add_connection(cfg, table, "prod")
    full = tomllib.loads(cfg.read_text())["superlink"]
    assert full["prod"] == parsed and full["local"] == {"address": ":local:"}
    with pytest.raises(dc.DeployError, match=r"already has a connection \[superlink.prod\]"):
        dc.add_connection(cfg, table, "prod")


def test_cli_prints_commands(creds, tmp_path, capsys):
    (tmp_path / "d").mkdir()
    assert main(["deploy", "supernode", "--credentials", str(creds.parties[1].dir), "--superlink", "10.0.0.1:9092",
                 "--data-path", str(tmp_path / "d"), "--port", "9600", "--unpinned"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "flower-supernode" in out[0] and 'party-name="party-1"' in out[0]
    assert main(["deploy", "superlink", "--credentials", str(creds.root)]) == 0
    assert "--enable-supernode-auth" in capsys.readouterr().out
    assert main(["deploy", "register", "--credentials", str(creds.root), "--connection", "prod"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 4  # each owner: a comment naming it and its key file, then its command
    for (comment, cmd), p in zip(zip(out[::2], out[1::2], strict=True), creds.parties, strict=True):
        key = str(creds.registered_pub(p.name).resolve())
        assert comment == f"# owner {p.name}: {key}" and "flwr supernode register " in cmd
        argv = shlex.split(cmd)
        assert argv[argv.index("register") + 1] == key and argv[-1] == p.name
    assert main(["deploy", "superlink", "--credentials", str(tmp_path)]) == 2
    assert "manifest.json not found" in capsys.readouterr().err


def test_supernode_code_pin_puts_the_launcher_first_on_path(creds, tmp_path, capsys):
    """``--code-pin``: the owner's launcher is what Flower's SuperExec finds as ``flwr-clientapp``."""
    import os
    import shutil
    import sys

    from distmoe.deploy import pin as cp

    (tmp_path / "d").mkdir()
    party = creds.parties[0].dir
    with pytest.raises(dc.DeployError, match="--code-pin: .*code-pin.json not found"):
        dc.supernode_command(party, superlink="127.0.0.1:9092", data_path=tmp_path / "d", code_pin=tmp_path / "no")
    cp.write_pin(tmp_path / "pin", cp.source_files(Path(__file__).resolve().parents[2]))
    cmd = dc.supernode_command(party, superlink="127.0.0.1:9092", data_path=tmp_path / "d", code_pin=tmp_path / "pin")
    path = cmd.env["PATH"].split(os.pathsep)
    assert path[0] == str((tmp_path / "pin" / "bin").resolve()) and path[1] == str(Path(sys.executable).parent)
    assert shutil.which("flwr-clientapp", path=cmd.env["PATH"]) == str(tmp_path / "pin" / "bin" / "flwr-clientapp")
    assert shutil.which("flower-superexec", path=cmd.env["PATH"])  # the SuperNode still finds Flower's SuperExec
    # Flower's SuperNode through the owner's launcher (short idle poll, the warm worker started first)
    pin_file = str((tmp_path / "pin" / "code-pin.json").resolve())
    assert cmd.argv[:6] == (sys.executable, "-P", "-m", "clients.supernode", "--code-pin", pin_file)
    assert cmd.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.5"  # a fallback: woken at each task
    plain = dc.supernode_command(party, superlink="127.0.0.1:9092", data_path=tmp_path / "d", check_paths=False,
                                 code_pin=None)
    assert plain.argv[0] == "flower-supernode" and "FLWR_SUPEREXEC_TASK_POLL_INTERVAL" not in plain.env
    base = ["deploy", "supernode", "--credentials", str(party), "--superlink", "10.0.0.1:9092", "--data-path",
            str(tmp_path / "d")]
    assert main([*base, "--code-pin", str(tmp_path / "pin")]) == 0
    out, err = capsys.readouterr()
    assert f"PATH={(tmp_path / 'pin' / 'bin').resolve()}" in out and "warning" not in err
    assert main(base) == 2  # no pin and no explicit opt-out: refused
    assert "error: --code-pin DIR is required" in capsys.readouterr().err
    assert main([*base, "--unpinned"]) == 0
    assert "warning: no --code-pin" in capsys.readouterr().err


def test_supernode_writes_the_owner_policy_into_the_node_config(creds, tmp_path, capsys):
    """The owner's policy travels in its own node config: ``policy="deployed"`` plus every floor it changed, parsed
    by the party exactly as written (``distmoe.party.policy``); a bad value fails before anything starts."""
    from distmoe.config import SimConfig, parse_node_config
    from distmoe.party.policy import OwnerPolicy, owner_policy

    (tmp_path / "d").mkdir()
    base = ["deploy", "supernode", "--credentials", str(creds.parties[0].dir), "--superlink", "10.0.0.1:9092",
            "--data-path", str(tmp_path / "d"), "--unpinned"]
    assert main([*base, "--policy-min-parties", "4", "--policy-min-update-noise-multiplier", "2.5",
                 "--policy-phases", "sft,stats,eval", "--policy-max-runs", "7"]) == 0
    out = capsys.readouterr().out
    nc_text = shlex.split(out.strip().splitlines()[-1])[-1]
    assert 'policy="deployed"' in nc_text and "policy-allow-plaintext" not in nc_text
    assert "policy-allow-unpinned=true" in nc_text  # --unpinned: the owner's opt-out, recorded in its policy
    from flwr.common.config import parse_config_args

    node_config = parse_config_args([nc_text])  # exactly what flower-supernode does with the string
    pol = owner_policy(parse_node_config(node_config, SimConfig()))
    assert pol == OwnerPolicy(min_parties=4, min_update_noise_multiplier=2.5, phases=("eval", "sft", "stats"),
                              max_runs=7, allow_unpinned=True)
    assert main([*base, "--policy-phases", "sft,train"]) == 2
    assert "--policy-phases" in capsys.readouterr().err
    assert main([*base, "--policy-min-parties", "1"]) == 2


# ----------------------------------------------------------------------------------------- ledger-key
def test_node_config_ledger_key_is_the_key_the_party_signs_with(creds, tmp_path):
    from distmoe.party.session import open_ledger

    data = tmp_path / "party-0"
    data.mkdir()
    party = creds.parties[0]
    node = parse_node_config({"data-path": str(data), "ledger-key": str(party.ledger_key)}, _sim())
    ledger = open_ledger(node)
    assert ledger.public_key_hex == party.ledger_pub.read_text().strip()
    assert not (node.work_dir / "keys").exists()  # no fallback key was generated
    # without the key, the party keeps its generated key (the old behaviour)
    other = parse_node_config({"data-path": str(data), "work-dir": str(tmp_path / "w2")}, _sim())
    assert other.ledger_key is None
    assert open_ledger(other).public_key_hex != ledger.public_key_hex
    assert (tmp_path / "w2" / "keys" / "party-0-ledger.key").is_file()
    with pytest.raises(ConfigError, match="node config key 'ledger-key': .* is not a file"):
        parse_node_config({"data-path": str(data), "ledger-key": str(tmp_path / "missing.key")}, _sim())


def test_register_reads_the_node_id_flower_prints(capfd):
    """The node ID comes from what flwr 1.42's ``supernode register --format json`` writes (its own printer)."""
    from flwr.cli.utils import print_json_to_stdout

    print_json_to_stdout({"success": True, "node-id": 5132847298102645})
    assert dc.registered_node_id(capfd.readouterr().out) == 5132847298102645
    print_json_to_stdout({"success": False, "error-message": "Public key already in use."})
    failed = capfd.readouterr().out
    with pytest.raises(dc.DeployError, match="printed no node ID: .*Public key already in use"):
        dc.registered_node_id(failed)
    for bad in ("", "SuperNode registered", '{"success": true, "node-id": "7"}', '{"success": true}'):
        with pytest.raises(dc.DeployError, match="printed no node ID"):
            dc.registered_node_id(bad)


def test_registration_table_names_each_owners_node():
    table = dc.registration_table([("hospital-a", "/k/hospital-a.pub", "17"), ("b", "/k/b.pub", "9")])
    rows = [line.split() for line in table.splitlines()]
    assert rows == [["owner", "public", "key", "node", "ID"], ["hospital-a", "/k/hospital-a.pub", "17"],
                    ["b", "/k/b.pub", "9"]]
    assert table.splitlines()[2].index("/k/b.pub") == table.splitlines()[1].index("/k/hospital-a.pub")


def test_the_owners_work_directory_is_next_to_its_keys_where_the_docs_show_it(creds, tmp_path):
    """The default work directory (ledger, privacy budget, party.log) is ``<credentials dir>/work``, a visible
    path per owner; an earlier hidden ``.<party>-work`` next to the data is named rather than silently left."""
    from flwr.common.config import parse_config_args
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    data = tmp_path / "data" / "hospital"
    data.mkdir(parents=True)
    party = creds.parties[0]

    def node(**kw):
        cmd = dc.supernode_command(party.dir, superlink="127.0.0.1:9092", data_path=data, **kw)
        return parse_node_config(parse_config_args([_parse_args_run_supernode().parse_args(
            list(cmd.argv[1:])).node_config]), _sim())

    assert node().work_dir == party.dir.resolve() / "work"
    assert node(work_dir=tmp_path / "w").work_dir == (tmp_path / "w").resolve()
    legacy = data.parent / f".{party.name}-work"
    legacy.mkdir()
    with pytest.raises(dc.DeployError, match=rf"{legacy}.*earlier work.*--work-dir {legacy}"):
        node()
    assert node(work_dir=legacy).work_dir == legacy.resolve()


@pytest.mark.slow
def test_register_exec_prints_the_node_id_a_real_superlink_gave_each_owner(tmp_path):
    """``deploy register --exec`` against a real TLS SuperLink: one row per owner whose node ID is the one
    ``flwr supernode list`` shows; a second registration of the same key fails naming the reason."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import time

    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
           f"{os.environ.get('PATH', '')}"}
    distmoe = [sys.executable, "-m", "distmoe.cli"]
    creds, cli = tmp_path / "c", tmp_path / "cli"
    subprocess.run([*distmoe, "credentials", "--out", str(creds), "--parties", "hospital-a,hospital-b"],
                   env=env, check=True, capture_output=True, timeout=60)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "superlink.log").open("w")
    link = subprocess.Popen([*distmoe, "deploy", "superlink", "--credentials", str(creds), "--port", str(port),
                             "--database", str(tmp_path / "state.db"), "--flwr-home", str(tmp_path / "sl"), "--exec"],
                            env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        subprocess.run([*distmoe, "deploy", "connection", "--credentials", str(creds), "--address",
                        f"127.0.0.1:{port}", "--write", "--flwr-home", str(cli)], env=env, check=True,
                       capture_output=True, timeout=60)
        register = [*distmoe, "deploy", "register", "--credentials", str(creds), "--flwr-home", str(cli), "--exec"]
        deadline = time.monotonic() + 60
        while True:  # the SuperLink's Control API answers after a few seconds
            res = subprocess.run(register, env=env, capture_output=True, text=True, timeout=120)
            if res.returncode == 0 or " is node " in res.stderr or time.monotonic() > deadline:
                break
            assert link.poll() is None, (tmp_path / "superlink.log").read_text()
            time.sleep(1.0)
        assert res.returncode == 0, res.stdout + res.stderr
        rows = [line.split() for line in res.stdout.strip().splitlines()]
        assert rows[0] == ["owner", "public", "key", "node", "ID"]
        assert [(r[0], r[1]) for r in rows[1:]] == [
            (p, str((creds / "superlink" / "supernodes" / f"{p}.pub").resolve())) for p in ("hospital-a", "hospital-b")]
        listed = subprocess.run(["flwr", "supernode", "list", "distmoe", "--format", "json"],
                                env={**env, "FLWR_HOME": str(cli)}, capture_output=True, text=True, timeout=60)
        nodes = json.loads(listed.stdout[listed.stdout.find("{"):])["nodes"]
        assert sorted(r[2] for r in rows[1:]) == sorted(str(n["node-id"]) for n in nodes)
        again = subprocess.run([*register, "--party", "hospital-b"], env=env, capture_output=True, text=True,
                               timeout=120)
        assert again.returncode == 2 and "Public key already in use" in again.stderr, again.stderr
    finally:
        link.terminate()
        link.wait(timeout=30)
        log.close()


def test_flowers_superexec_reads_the_task_poll_interval_the_pinned_supernode_sets(monkeypatch):
    """The SuperExec's task poll (flwr 1.42 ``supercore/superexec/run_superexec.py``, 1 s by default) is Flower's
    own setting: a Flower that renames or bounds it differently fails here instead of polling at 1 s again."""
    from flwr.supercore.superexec import run_superexec

    assert run_superexec._TASK_POLL_INTERVAL_ENV == dc.SUPEREXEC_POLL_ENV
    assert "time.sleep(task_poll_interval)" in inspect.getsource(run_superexec.run_superexec)
    monkeypatch.setenv(dc.SUPEREXEC_POLL_ENV, dc.SUPEREXEC_POLL_S)
    assert run_superexec._get_task_poll_interval() == float(dc.SUPEREXEC_POLL_S)
    monkeypatch.delenv(dc.SUPEREXEC_POLL_ENV)
    assert run_superexec._get_task_poll_interval() == 1.0
