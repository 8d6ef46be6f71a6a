"""The ``distmoe credentials`` and ``distmoe deploy superlink|supernode|register|connection|owner-keys|pin|wait``
subcommands.

Owns: their argument parsers and the print-or-exec behaviour. By default each ``deploy`` command
prints the Flower command line(s) on stdout (copy-pasteable, one per line) and notes on stderr;
``--exec`` runs them: ``superlink``/``supernode`` replace this process with Flower's (same PID, same
exit status), ``register`` runs ``flwr supernode register`` per key, stops at the first failure and prints
a table owner → public key file → the node ID Flower gave it.
Errors are one ``error: ...`` line and exit status 2, like the rest of ``distmoe``.

Must not: hold logic beyond argument handling (that is :mod:`.credentials` and :mod:`.commands`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distmoe.deploy import commands as dc
from distmoe.deploy import credentials as cr
from distmoe.deploy import pin as cp


def _fail(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2


def cmd_credentials(args) -> int:
    try:
        if args.owner_keys:
            public = [cr.read_owner_public(f) for v in args.owner_keys for f in v.split(",") if f.strip()]
            creds = cr.create(Path(args.out), (), args.san, days=args.days, force=args.force, owner_public=public)
        else:
            names = cr.party_names(args.parties, args.num_parties)
            creds = cr.create(Path(args.out), names, args.san, days=args.days, force=args.force)
    except cr.CredentialsError as exc:
        return _fail(exc)
    print(cr.summary(creds))
    return 0


def cmd_deploy_owner_keys(args) -> int:
    try:
        party, public = cr.create_owner_keys(Path(args.out), args.party, force=args.force)
    except cr.CredentialsError as exc:
        return _fail(exc)
    print(public.read_text(), end="")
    print(f"# kept here (mode 0600): {party.supernode_key}, {party.ledger_key}\n"
          f"# send only {public} to the coordinator (compare the fingerprint with it out of band);\n"
          f"# put the ca.crt it sends back at {party.ca_cert}", file=sys.stderr)
    return 0


def cmd_deploy_pin(args) -> int:
    try:
        files = cp.source_files(args.source)
        pin_file, pin = cp.write_pin(Path(args.out), files, force=args.force, warm=not args.cold)
    except cp.CodePinError as exc:
        return _fail(exc)
    print(cp.summary(pin_file, pin, [args.source or f"the install of {sys.executable}"]))
    return 0


def _emit(cmds: list[dc.FlowerCommand], note: str = "") -> int:
    for c in cmds:
        print(c.shell())
    if note:
        print(note, file=sys.stderr)
    return 0


def _one(args, build, note: str) -> int:
    """Build one command (``CredentialsError`` -> exit 1), run it with ``--exec``, print it and ``note``."""
    try:
        cmd = build()
        if args.exec:
            cmd.exec()
    except cr.CredentialsError as exc:
        return _fail(exc)
    return _emit([cmd], note)


def cmd_deploy_superlink(args) -> int:
    return _one(args, lambda: dc.superlink_command(
        args.credentials, host=args.host, port=args.port, database=args.database, flwr_home=args.flwr_home,
        runtime_dependency_installation=args.allow_runtime_dependency_installation, link_state=args.link_state),
        "# next: 'distmoe deploy connection' for the flwr CLI, then 'distmoe deploy register'. "
        "Use --host 0.0.0.0 when data owners connect from other machines.")


POLICY_FLAGS = ("allow_plaintext", "min_parties", "min_noise_multiplier", "min_metric_noise_multiplier",
                "min_update_noise_multiplier", "phases", "max_rounds", "max_runs")


def cmd_deploy_supernode(args) -> int:
    if not args.code_pin and not args.unpinned:  # the owner opts out of the code pin explicitly, or not at all
        print("error: --code-pin DIR is required (pin your reviewed release with 'distmoe deploy pin'); "
              "--unpinned runs whatever party code the coordinator's app bundle holds", file=sys.stderr)
        return 2
    policy = {"policy-" + f.replace("_", "-"): getattr(args, "policy_" + f) for f in POLICY_FLAGS}
    if args.unpinned:  # the opt-out is part of the owner's policy: in its signed ledger, judged by the audit
        policy["policy-allow-unpinned"] = True
    return _one(args, lambda: dc.supernode_command(
        args.credentials, superlink=args.superlink, data_path=args.data_path, party_name=args.party_name,
        host=args.host, port=args.port, work_dir=args.work_dir, epsilon_max=args.epsilon_max,
        model_path=args.model_path, flwr_home=args.flwr_home,
        hardware={"device": args.device, "dtype": args.dtype, "micro-batch-size": args.micro_batch_size,
                  "gradient-checkpointing": args.gradient_checkpointing, "quantize": args.quantize},
        base_cache=args.base_cache, code_pin=args.code_pin, policy=policy),
        "# the coordinator must have registered this SuperNode's public key (supernode.pub) first; otherwise "
        "Flower refuses it (exit code 305)" + ("" if args.code_pin else
        "\n# warning: no --code-pin: this SuperNode runs whatever party code the coordinator's app bundle "
        "holds (docs/privacy.md §1); pin your reviewed version with 'distmoe deploy pin'"))


def cmd_deploy_register(args) -> int:
    try:
        regs = dc.register_commands(args.credentials, args.connection, args.party, flwr_home=args.flwr_home,
                                    json_output=args.exec)
        if not args.exec:  # one comment line naming the owner and its key file above each command
            for r in regs:
                print(f"# owner {r.party}: {r.public_key}\n{r.command.shell()}")
            print("# each command prints the node ID Flower gives that owner; with --exec a table of them",
                  file=sys.stderr)
            return 0
        rows = []
        for r in regs:
            res = r.command.run(timeout=args.timeout)
            out = (res.stdout + res.stderr).strip()
            if res.returncode != 0:
                done = "".join(f"; {p} is node {n}" for p, _k, n in rows)
                return _fail(dc.DeployError(f"{r.command.shell()} failed (exit {res.returncode}): {out}{done}"))
            rows.append((r.party, r.public_key, str(dc.registered_node_id(res.stdout))))
        print(dc.registration_table(rows), end="")
    except cr.CredentialsError as exc:
        return _fail(exc)
    return 0


def cmd_deploy_connection(args) -> int:
    try:
        table = dc.connection_toml(args.credentials, args.address, args.name)
        if not args.write:
            print(table, end="")
            print("# add this to $FLWR_HOME/config.toml (default ~/.flwr/config.toml), or use --write", file=sys.stderr)
            return 0
        home = Path(args.flwr_home).expanduser() if args.flwr_home else Path.home() / ".flwr"
        cfg = home / "config.toml"
        if not cfg.exists():  # flwr writes its default config on first use; let it
            dc.FlowerCommand(("flwr", "config", "list"), dc.flwr_env(home)).run(timeout=args.timeout)
        path = dc.add_connection(cfg, table, args.name)
    except cr.CredentialsError as exc:
        return _fail(exc)
    print(f"added connection [superlink.{args.name}] to {path}")
    return 0


def cmd_deploy_wait(args) -> int:
    from distmoe.deploy.wait import wait_for_run

    try:
        return wait_for_run(Path(args.run_dir).expanduser(), args.timeout, args.poll)
    except ValueError as exc:
        return _fail(exc)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``credentials`` and ``deploy`` on the top-level ``distmoe`` parser."""
    c = sub.add_parser("credentials", help="make a federation's CA, SuperLink certificate and data-owner keys")
    c.add_argument("--out", required=True, metavar="DIR", help="credentials directory (created, mode 0700)")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--parties", metavar="A,B,...", help="data owner names, comma separated")
    g.add_argument("--num-parties", type=int, metavar="N", help="N data owners named party-0 .. party-N-1")
    g.add_argument("--owner-keys", action="append", metavar="FILE",
                   help="a data owner's <party>.public.json from 'distmoe deploy owner-keys' (repeatable or comma "
                        "separated): only public keys, the owners keep their private keys. --parties and "
                        "--num-parties instead make every owner's private keys here (development only)")
    c.add_argument("--san", action="append", metavar="NAME",
                   help="subject alternative name of the SuperLink certificate: DNS name or IP (repeatable; "
                        f"default: {', '.join(cr.DEFAULT_SANS)})")
    c.add_argument("--days", type=int, default=cr.DEFAULT_DAYS, help="validity of the certificates in days")
    c.add_argument("--force", action="store_true", help="replace existing credential files (new keys)")
    c.set_defaults(fn=cmd_credentials)

    d = sub.add_parser("deploy", help="print (or --exec) the Flower commands of a TLS + node-auth deployment")
    dsub = d.add_subparsers(dest="deploy_cmd", required=True)

    def common(sp, what: str):
        sp.add_argument("--flwr-home", metavar="DIR", help=f"Flower's state directory FLWR_HOME for {what} "
                                                           "(default: Flower's, ~/.flwr)")
        sp.add_argument("--exec", action="store_true", help="run the command instead of printing it")

    s = dsub.add_parser("superlink", help="the coordinator's flower-superlink (TLS, node auth, state database)")
    s.add_argument("--credentials", required=True, metavar="DIR", help="directory made by 'distmoe credentials'")
    s.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0 for remote data owners)")
    s.add_argument("--port", type=int, default=dc.DEFAULT_SUPERLINK_PORT, help="the one HTTPS port (Fleet, "
                                                                             "Control, Runtime APIs)")
    s.add_argument("--database", metavar="PATH", help="state database (default: FLWR_HOME/superlink-state.db)")
    s.add_argument("--link-state", choices=("memory", "database"), default="memory",
                   help="memory: runs and messages in memory, SuperNode registrations in the database (default); "
                        "database: Flower's link state in the database, runs still listed after a restart")
    s.add_argument("--allow-runtime-dependency-installation", action="store_true",
                   help="let Flower install the app's dependencies per run (off by default)")
    common(s, "the SuperLink")
    s.set_defaults(fn=cmd_deploy_superlink)

    n = dsub.add_parser("supernode", help="a data owner's flower-supernode (TLS, auth key, node config)")
    n.add_argument("--credentials", required=True, metavar="PARTY_DIR",
                   help="the data owner's own directory (made by 'distmoe deploy owner-keys', with the "
                        "coordinator's ca.crt in it)")
    n.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the coordinator's SuperLink address")
    n.add_argument("--data-path", required=True, metavar="DIR", help="this party's data (<task>.jsonl files)")
    n.add_argument("--party-name", help="must match the credentials (default: theirs)")
    n.add_argument("--host", default="127.0.0.1", help="local Runtime API address of the SuperNode")
    n.add_argument("--port", type=int, default=dc.DEFAULT_SUPERNODE_PORT,
                   help="local Runtime API port (one per SuperNode on the same host)")
    n.add_argument("--work-dir", metavar="DIR", help="your work directory: ledger, budget, party.log "
                   "(default: CREDENTIALS/work)")
    n.add_argument("--epsilon-max", type=float, help="node config epsilon-max: this party's own budget cap")
    n.add_argument("--model-path", metavar="DIR", help="node config model-path: a local checkpoint")
    n.add_argument("--base-cache", metavar="DIR|off",
                   help="node config base-cache: where the loaded base is kept memory-mapped between messages "
                        "(default WORK/base-cache; one copy of the base in its dtype; 'off' to disable)")
    n.add_argument("--device", help="node config device: auto, cpu, cuda, cuda:N, mps (this owner's hardware)")
    n.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="node config dtype of the frozen base")
    n.add_argument("--micro-batch-size", type=int, metavar="N", help="node config micro-batch-size (0 = whole batch)")
    n.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="node config gradient-checkpointing")
    n.add_argument("--quantize", choices=("none", "4bit", "8bit"),
                   help="node config quantize: a bitsandbytes-quantised base (CUDA, lora, the quant extra)")
    n.add_argument("--unpinned", action="store_true", help="start without --code-pin: this SuperNode then runs "
                   "whatever party code the coordinator's app bundle holds (refused unless given)")
    pol = n.add_argument_group("owner policy (docs/deploy.md §2.3): floors the party holds every run config to")
    pol.add_argument("--policy-allow-plaintext", action="store_true", default=None,
                     help="accept privacy.mode = plaintext (default: refused; secure aggregation required)")
    pol.add_argument("--policy-min-parties", type=int, metavar="N", help="floor of privacy.min-parties and the "
                     "SecAgg threshold (default 3)")
    pol.add_argument("--policy-min-noise-multiplier", type=float, metavar="Z", help="floor of the router-statistics "
                     "noise multiplier (default 0.5)")
    pol.add_argument("--policy-min-metric-noise-multiplier", type=float, metavar="Z",
                     help="floor of privacy.metric-noise-multiplier (default 1.0)")
    pol.add_argument("--policy-min-update-noise-multiplier", type=float, metavar="Z",
                     help="floor of the model-update noise multiplier (default 0: updates without DP accepted)")
    pol.add_argument("--policy-phases", metavar="KINDS", help="phase kinds allowed, comma separated (default all: "
                     "sft,rl,dpo,stats,eval)")
    pol.add_argument("--policy-max-rounds", type=int, metavar="N", help="most rounds of a run (default 1000)")
    pol.add_argument("--policy-max-runs", type=int, metavar="N", help="most runs this work directory sets up "
                     "(default 50): bounds probing")
    n.add_argument("--code-pin", metavar="DIR", help="directory made by 'distmoe deploy pin': the SuperNode then "
                                                     "refuses any app bundle whose party code differs from the pin")
    common(n, "the SuperNode")
    n.set_defaults(fn=cmd_deploy_supernode)

    o = dsub.add_parser("owner-keys", help="data owner: make this owner's SuperNode and ledger keys here; only "
                                           "<party>.public.json goes to the coordinator")
    o.add_argument("--party", required=True, help="this data owner's name (as agreed with the coordinator)")
    o.add_argument("--out", required=True, metavar="DIR", help="this owner's credentials directory (mode 0700)")
    o.add_argument("--force", action="store_true", help="replace existing keys (send the new public file)")
    o.set_defaults(fn=cmd_deploy_owner_keys)

    q = dsub.add_parser("pin", help="data owner: pin the party-side code (distmoe, clients) this SuperNode may run")
    q.add_argument("--out", required=True, metavar="DIR", help="where code-pin.json and bin/flwr-clientapp go")
    q.add_argument("--source", metavar="WHEEL|DIR", help="the reviewed code: a wheel or a directory holding "
                                                          "distmoe/ and clients/ (default: this Python's install)")
    q.add_argument("--force", action="store_true", help="replace an existing pin")
    q.add_argument("--cold", action="store_true", help="a fresh ClientApp process per message (Flower's way) "
                   "instead of the SuperNode's warm worker that forks one per message (docs/deploy.md §2.2)")
    q.set_defaults(fn=cmd_deploy_pin)

    r = dsub.add_parser("register", help="flwr supernode register: one data owner's public key at a time")
    r.add_argument("--credentials", required=True, metavar="DIR", help="directory made by 'distmoe credentials'")
    r.add_argument("--connection", default=dc.DEFAULT_CONNECTION, help="the flwr CLI's SuperLink connection name")
    r.add_argument("--party", action="append", help="register only this party (repeatable; default: all)")
    r.add_argument("--timeout", type=float, default=60.0, help="seconds per flwr call with --exec")
    common(r, "the flwr CLI")
    r.set_defaults(fn=cmd_deploy_register)

    k = dsub.add_parser("connection", help="the flwr CLI's TLS connection table for $FLWR_HOME/config.toml")
    k.add_argument("--credentials", required=True, metavar="DIR", help="directory made by 'distmoe credentials'")
    k.add_argument("--address", required=True, metavar="HOST:PORT", help="the SuperLink's address")
    k.add_argument("--name", default=dc.DEFAULT_CONNECTION, help="connection name (used by flwr run . NAME)")
    k.add_argument("--write", action="store_true", help="append it to FLWR_HOME/config.toml")
    k.add_argument("--flwr-home", metavar="DIR", help="the flwr CLI's FLWR_HOME (default: ~/.flwr)")
    k.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    k.set_defaults(fn=cmd_deploy_connection)

    w = dsub.add_parser("wait", help="coordinator: wait until a run has ended (its run.json says so; flwr run "
                                     "--stream can return before), exit 0 if it completed, 1 if not, 124 on --timeout")
    w.add_argument("run_dir", metavar="RUN_DIR", help="the run's run.dir (where its run.json is written)")
    w.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds (default: wait as long as it "
                                                               "takes)")
    w.add_argument("--poll", type=float, default=2.0, metavar="S", help="seconds between looks at run.json")
    w.set_defaults(fn=cmd_deploy_wait)
