"""The ClientApp handlers on real Flower ``Message`` s: decode, run, encode; failures become error
replies, never a hang or a crash. An error reply carries a fixed code of the closed table only; what went
wrong in detail (file and line, config key, a count of the party's examples) is in the party's own log."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from clients.app import evaluate, rl, sft, stats
from distmoe.model.base import base_fingerprint
from distmoe.model.build import build_model
from distmoe.model.trainable import apply_trainable, spec_of, trainable_state
from distmoe.party import service
from distmoe.wire import codec
from distmoe.wire.errors import REASON_TEXTS, ErrorCode, reason_text
from distmoe.wire.schema import EvalReply, ModelUpdate, RlInstruction, RouterStats, SftInstruction, StatsInstruction


@pytest.fixture
def tiny_plain(tiny) -> dict:
    """The tiny model in plaintext mode: these tests read plain replies; the secure flow is tested below."""
    return {**tiny, "privacy.mode": "plaintext"}


@pytest.fixture(autouse=True)
def task_identity():
    # Flower stamps run/node ids on every Message; outside a run we set them as the runtime does
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def _context(data_path: Path, run_config: dict, work: Path | None = None, party: str = "p0",
             node_id: int = 1) -> Context:
    nc = {"data-path": str(data_path), "party-name": party}
    if work is not None:
        nc["work-dir"] = str(work)
    return Context(run_id=7, node_id=node_id, node_config=nc, state=RecordDict(), run_config=run_config)


def _global(cfg_over: dict):
    from distmoe.config import parse_run_config

    cfg = parse_run_config(cfg_over)
    model, _ = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    spec = spec_of(model, cfg.model.trainable, base_fingerprint(cfg.model))
    return {k: v.numpy() for k, v in trainable_state(model).items()}, spec


def _instruction(payload, node_id: int = 1) -> object:
    """A Flower message as the coordinator sends it: the payload with the coordinator's ledger head."""
    content = codec.with_ledger_head(codec.encode(payload), 5, "ab" * 32)
    return codec.instruction_content(content, node_id, codec.message_type_of(payload))


def _code_only(out, code: ErrorCode, work: Path) -> str:
    """Assert the error reply is exactly ``code``'s table text (plus the ledger head); return the party log."""
    assert out.has_error() and out.error.code == int(code)
    text, head = codec.split_error(out.error.reason)
    assert head is not None  # anchored in the party's ledger
    assert text == reason_text(code) and text in REASON_TEXTS, out.error.reason
    assert not re.search(r"\d", text)  # no count, line number or length of the party's data
    return (work / "party.log").read_text()


def test_sft_and_stats_round_trip_through_flower_messages(synth_dirs, tiny_plain):
    run_config = {**tiny_plain, "train.local-steps": 2}
    weights, spec = _global(run_config)
    ctx = _context(synth_dirs[0], run_config)
    out = sft(_instruction(SftInstruction(round=1, task="lookup", weights=weights, base_hash=spec.base_hash,
                                          seed=1, anchor=None, anchor_version=0)), ctx)
    assert not out.has_error(), out.error.reason if out.has_error() else ""
    upd = codec.decode(out.content, ModelUpdate)
    assert upd.party == "p0" and upd.num_examples > 0
    assert set(upd.delta) == set(weights)
    assert any(np.abs(d).max() > 0 for d in upd.delta.values())

    out = stats(_instruction(StatsInstruction(round=2, task="lookup", weights=weights, base_hash=spec.base_hash)),
                ctx)
    st = codec.decode(out.content, RouterStats)
    assert np.allclose(st.sums.sum(1), st.sums.sum(1)[0])  # every row sums to the sequence count


def _sft_on_edited_data(src, tmp_path, run_config, index: int, line: str):
    """An SFT instruction answered by a party whose ``lookup.jsonl`` has line ``index`` replaced by ``line``."""
    data = tmp_path / "p0"
    shutil.copytree(src, data)
    lines = (data / "lookup.jsonl").read_text().splitlines()
    lines[index] = line
    (data / "lookup.jsonl").write_text("\n".join(lines) + "\n")
    weights, spec = _global(run_config)
    return sft(_instruction(SftInstruction(round=1, task="lookup", weights=weights, base_hash=spec.base_hash,
                                           seed=1, anchor=None, anchor_version=0)),
               _context(data, run_config, tmp_path / "work"))


def test_corrupt_party_file_reaches_the_server_as_a_code_the_line_stays_in_the_party_log(synth_dirs, tmp_path,
                                                                                           tiny_plain):
    out = _sft_on_edited_data(synth_dirs[0], tmp_path, tiny_plain, 4, '{"instruction": "k1", "output": ')
    log = _code_only(out, ErrorCode.DATA, tmp_path / "work")
    assert "lookup.jsonl:5" not in out.error.reason and "lookup.jsonl:5" in log and "DataError" in log


def test_base_model_mismatch_is_refused(synth_dirs, tiny_plain, tmp_path):
    weights, spec = _global(tiny_plain)
    other = {**tiny_plain, "run.seed": 3, "model.trainable": "router+experts"}
    w2, spec2 = _global(other)
    out = evaluate(_instruction(codec.EvalInstruction(round=1, tasks=("lookup",), new_task="lookup", weights=w2,
                                                      base_hash=spec.base_hash, ref_weights=None, anchor=None,
                                                      anchor_version=0)),
                   _context(synth_dirs[0], other, tmp_path))
    assert "frozen base model differs" in _code_only(out, ErrorCode.MODEL, tmp_path)
    assert spec2.base_hash != spec.base_hash


def test_bad_run_config_is_an_error_reply(synth_dirs, tiny_plain, tmp_path):
    weights, spec = _global(tiny_plain)
    out = stats(_instruction(StatsInstruction(round=1, task="", weights=weights, base_hash=spec.base_hash)),
                _context(synth_dirs[0], {**tiny_plain, "train.batch-size": 0}, tmp_path))
    assert "train.batch-size" in _code_only(out, ErrorCode.CONFIG, tmp_path)


# ------------------------------------------- attacks: data-derived text in an error reply
def test_rl_prompt_count_binary_search_learns_nothing(synth_dirs, tiny_plain, tmp_path):
    """The attack: a coordinator varies ``rl.prompts-per-step`` over runs and reads whether the party answers with
    an update or the ``data`` code (``prompts-per-step exceeds its K training prompts``): a binary search gave one
    party's exact prompt count. Now a party with fewer prompts draws them with replacement: the reply kind is the
    same whatever the private count."""
    small = tmp_path / "small"
    shutil.copytree(synth_dirs[0], small)
    lines = (small / "arith.jsonl").read_text().splitlines()
    (small / "arith.jsonl").write_text("\n".join(lines[:6]) + "\n")  # ~5 training prompts; the other party ~20
    seen = {}
    for name, data in (("small", small), ("large", synth_dirs[0])):
        for per_step in (2, 8):  # 8 lies between the two counts: it told them apart
            run_config = {**tiny_plain, "rl.prompts-per-step": per_step, "rl.steps": 1, "rl.group-size": 2,
                          "rl.max-new-tokens": 2}
            weights, spec = _global(run_config)
            out = rl(_instruction(RlInstruction(round=1, task="arith", weights=weights, base_hash=spec.base_hash,
                                                seed=1)), _context(data, run_config, tmp_path / f"w-{name}"))
            seen[name, per_step] = out.error.code if out.has_error() else "update"
            if not out.has_error():
                assert codec.decode(out.content, ModelUpdate).num_examples == per_step * 2  # P x G rollouts
    assert set(seen.values()) == {"update"}, seen


def test_max_seq_len_binary_search_learns_nothing(synth_dirs, tiny_plain, tmp_path):
    """The attack: a coordinator varies ``model.max-seq-len`` over runs and reads whether the party answers with an
    update or the ``data`` code: that told whether the party's longest answer needs that many tokens, a binary
    search its length. Now an answer that does not fit is left out (and a party with none left takes part with
    weight 0, as one without data for the task): the reply is an update whatever the longest answer."""
    dirs = {"short": synth_dirs[0]}
    for name, rows in (("one-long", set(range(6))), ("all-long", None)):
        data = tmp_path / name
        shutil.copytree(synth_dirs[0], data)
        lines = (data / "lookup.jsonl").read_text().splitlines()
        long = '{"instruction": "q%d", "output": "' + " ".join(["secret answer"] * (12 if rows else 30)) + '"}'
        lines = [long % k if rows is None or k in rows else line for k, line in enumerate(lines)]
        (data / "lookup.jsonl").write_text("\n".join(lines) + "\n")
        dirs[name] = data
    seen, weight = {}, {}
    for (name, data), n in itertools.product(dirs.items(), (96, 256)):  # one SFT round below, one above the long answer
        run_config = {**tiny_plain, "model.max-seq-len": n}
        weights, spec = _global(run_config)
        out = sft(_instruction(SftInstruction(round=1, task="lookup", weights=weights, base_hash=spec.base_hash,
                                              seed=1, anchor=None, anchor_version=0)),
                  _context(data, run_config, tmp_path / f"w-{name}-{n}"))
        seen[name, n] = out.error.code if out.has_error() else "update"
        weight[name, n] = None if out.has_error() else codec.decode(out.content, ModelUpdate).num_examples
    assert set(seen.values()) == {"update"}, seen  # the long answer fits only at 256:
    assert weight["one-long", 256] > weight["one-long", 96] > 0 and weight["all-long", 256] == 0  # all-long: weight 0
    run_config = {**tiny_plain, "model.max-seq-len": 96, "eval.max-new-tokens": 2, "data.eval-fraction": 0.5}
    w, spec = _global(run_config)
    held = {}
    for name in dirs:  # evaluation: the same (held-out answers that do not fit are left out)
        out = evaluate(_instruction(codec.EvalInstruction(round=2, tasks=("lookup",), new_task="lookup", weights=w,
                                                          base_hash=spec.base_hash, ref_weights=w, anchor=None,
                                                          anchor_version=0)),
                       _context(dirs[name], run_config, tmp_path / f"e-{name}"))
        assert not out.has_error(), out.error.reason
        held[name] = codec.decode(out.content, EvalReply).metrics["n/lookup"]
    assert held["all-long"] == 0 < held["short"] and held["one-long"] <= held["short"], held


def test_any_exception_message_does_not_leave_the_party(synth_dirs, tiny_plain, tmp_path, monkeypatch):
    """The generic path sent ``f"{type(exc).__name__}: {exc}"``: whatever a library put in the message."""
    def boom(cfg, node, instr, loaded=None):
        raise ValueError("row 17: 'patient 4711 has condition X' is not a valid label")

    monkeypatch.setitem(service._PLAIN, StatsInstruction, boom)
    weights, spec = _global(tiny_plain)
    out = stats(_instruction(StatsInstruction(round=1, task="lookup", weights=weights, base_hash=spec.base_hash)),
                _context(synth_dirs[0], tiny_plain, tmp_path))
    log = _code_only(out, ErrorCode.INTERNAL, tmp_path)
    assert "4711" not in out.error.reason and "ValueError" not in out.error.reason
    assert "patient 4711" in log and "Traceback" in log
    assert (tmp_path / "party.log").stat().st_mode & 0o077 == 0  # the party's log is private to it


def test_eval_reply_carries_only_aggregates(synth_dirs, tiny_plain):
    weights, spec = _global(tiny_plain)
    instr = codec.EvalInstruction(round=1, tasks=("lookup", "arith"), new_task="arith", weights=weights,
                                  base_hash=spec.base_hash, ref_weights=weights, anchor=None, anchor_version=0)
    out = evaluate(_instruction(instr), _context(synth_dirs[0], tiny_plain))
    rep = codec.decode(out.content, EvalReply)
    assert set(rep.metrics) == {"acc/lookup", "loss/lookup", "n/lookup", "acc/arith", "loss/arith", "n/arith",
                                "routing_kl", "load_cv", "top1_consistency"}
    assert rep.metrics["top1_consistency"] == 1.0


def test_secure_round_through_the_clientapp_messages(synth_dirs, tmp_path, tiny_plain):
    """Setup, key directory, a router-statistics round and unmask on real Flower Messages, with the
    coordinator's SecAgg server: only masked vectors and shares leave, and the sum decodes."""
    import os

    from clients.app import consistency, directory, setup, unmask
    from distmoe.config import parse_run_config
    from distmoe.ledger import verify_ledger
    from distmoe.privacy import secagg as sa
    from distmoe.privacy.dp import canary_seed
    from distmoe.privacy.plan import plan_privacy
    from distmoe.privacy.releases.stats import spec as stats_spec
    from distmoe.privacy.vectors import StatsLayout
    from distmoe.wire.schema import (
        ConsistencyRequestMsg,
        ConsistencyResponseMsg,
        DirectoryRequest,
        KeyAdvertReply,
        MaskedReply,
        SecureInstruction,
        SetupRequest,
        ShareKeysReply,
        UnmaskRequestMsg,
        UnmaskResponseMsg,
    )

    run_config = {k: v for k, v in tiny_plain.items() if k != "privacy.mode"}
    cfg = parse_run_config(run_config)
    z = plan_privacy(cfg.privacy, cfg.schedule).noise_multiplier
    weights, spec = _global(run_config)
    ids = {10: "p0", 11: "p1"}
    ctx = {n: _context(synth_dirs[i], run_config, tmp_path / name, name, n) for i, (n, name) in enumerate(ids.items())}
    params = sa.SecAggParams(os.urandom(16), 2, 64, 4096)
    server = sa.SecAggServer(params)

    def ask(handler, payload, expected):
        out = {}
        for n in ids:
            reply = handler(_instruction(payload(n) if callable(payload) else payload, n), ctx[n])
            assert not reply.has_error(), reply.error.reason
            assert codec.ledger_head(reply.content) is not None  # every reply carries the party's ledger head
            out[n] = codec.decode(reply.content, expected)
        return out

    adverts = ask(setup, SetupRequest(params.run_id, 2, 4096, 2, z, 0.0), KeyAdvertReply)
    d = server.register([sa.KeyAdvert(n, a.c_pk, a.sig_pk) for n, a in adverts.items()])
    keys = ask(directory, DirectoryRequest(d, 1, tuple(ids.items())), ShareKeysReply)
    server.add_share_keys([k.keys for k in keys.values()])
    sspec = stats_spec(cfg.privacy, z, 2, 4, 2, 2)
    starts = server.begin_round(1, StatsLayout(sspec).length)
    instr = StatsInstruction(round=1, task="lookup", weights=weights, base_hash=spec.base_hash)
    masked = ask(stats, lambda n: SecureInstruction(instr, starts[n], "router-stats"), MaskedReply)
    assert all(m.masked.y.dtype == np.uint64 and m.masked.y.shape == (StatsLayout(sspec).length,)
               for m in masked.values())
    checks = server.receive_masked(1, [m.masked for m in masked.values()])
    signed = ask(consistency, lambda n: ConsistencyRequestMsg(checks[n]), ConsistencyResponseMsg)
    req = server.receive_consistency(1, [s.response for s in signed.values()], min_contributors=2)
    assert server.contributors(1) == 2  # both parties had statistics to send
    resp = ask(unmask, UnmaskRequestMsg(req), UnmaskResponseMsg)
    res = server.finish(1, [r.response for r in resp.values()])
    seed = canary_seed(params.run_id, 1, next(iter(starts.values())).participants)  # the round's canary positions
    noisy, canaries = StatsLayout(sspec, seed).decode(res.total)
    rows = noisy.sum(1)  # each row ~ the number of sequences of both parties
    assert np.all(rows > 10) and abs(rows[0] - rows[1]) < 10 * sspec.aggregate_sigma() / sspec.scale
    assert canaries.shape == (cfg.privacy.noise_canaries,) and np.std(canaries) > 0.3 * sspec.aggregate_sigma()
    for name in ids.values():
        led = tmp_path / name / "ledger" / f"{name}.jsonl"
        assert verify_ledger(led, (led.with_suffix(".pub")).read_text().strip())
    # a round start that declares another ring width than the party's layout is refused before any work
    spent = {n: json.loads(next((tmp_path / ids[n] / "privacy").glob("*.accountant.json")).read_text())
             for n in ids}
    starts = server.begin_round(2, StatsLayout(sspec).length, 32)  # statistics always use 64 bits
    instr = StatsInstruction(round=2, task="lookup", weights=weights, base_hash=spec.base_hash)
    for n in ids:
        out = stats(_instruction(SecureInstruction(instr, starts[n], "router-stats"), n), ctx[n])
        assert "declared Z_2^32 for router-stats" in _code_only(out, ErrorCode.MODEL, tmp_path / ids[n])
        assert json.loads(next((tmp_path / ids[n] / "privacy").glob("*.accountant.json")).read_text()) == spent[n]


def test_the_cached_base_carries_nothing_from_one_message_to_the_next(synth_dirs, tiny_plain, tmp_path):
    """Simulation keeps a party's process: the second message reuses the prepared base, and must answer
    exactly as a fresh process would (the global weights are reloaded, gradients dropped)."""
    from distmoe.config import SimConfig, parse_node_config, parse_run_config
    from distmoe.model import base as base_mod
    from distmoe.party import work

    cfg = parse_run_config({**tiny_plain, "train.local-steps": 2})
    node = parse_node_config({"data-path": str(synth_dirs[0]), "work-dir": str(tmp_path / "w")}, SimConfig())
    weights, spec = _global({**tiny_plain, "train.local-steps": 2})
    instr = SftInstruction(round=1, task="lookup", weights=weights, base_hash=spec.base_hash, seed=1, anchor=None,
                           anchor_version=0)
    base_mod.clear_cache()
    first = work.run_sft(cfg, node, instr)
    cached = work.prepare_model(cfg, node, weights, spec.base_hash)[0]
    second = work.run_sft(cfg, node, instr)
    assert work.prepare_model(cfg, node, weights, spec.base_hash)[0] is cached
    for k in first.delta:
        np.testing.assert_array_equal(first.delta[k], second.delta[k])
    # evaluation against a reference: one model in memory, the reference's routing taken first
    # (arith: this party's lookup examples all fall on the training side of the keyed-hash split)
    ev = codec.EvalInstruction(round=2, tasks=("arith",), new_task="lookup", weights=weights, base_hash=spec.base_hash,
                               ref_weights=weights, anchor=None, anchor_version=0)
    assert work.run_eval(cfg, node, ev).metrics["top1_consistency"] == 1.0
    moved = {k: v + first.delta[k] for k, v in weights.items()}
    ev2 = dataclasses.replace(ev, weights=moved)
    assert work.run_eval(cfg, node, ev2).metrics["top1_consistency"] < 1.0
    base_mod.clear_cache()


def test_a_deployed_party_logs_its_own_loss_per_round_and_a_simulated_one_does_not(tmp_path, synth_dirs, tiny_plain,
                                                                                   capsys):
    """docs/deploy.md §3: a data owner sees its training progress in its SuperNode's log (``progress_stdout``, set
    by clients/app.py on a real SuperNode); in simulation stdout is the coordinator's terminal, so nothing."""
    from distmoe.config import SimConfig, parse_node_config, parse_run_config
    from distmoe.party import work

    cfg = parse_run_config({**tiny_plain, "train.local-steps": 2})
    node = parse_node_config({"data-path": str(synth_dirs[0]), "work-dir": str(tmp_path / "w")}, SimConfig())
    weights, spec = _global({**tiny_plain, "train.local-steps": 2})
    instr = SftInstruction(round=3, task="lookup", weights=weights, base_hash=spec.base_hash, seed=1, anchor=None,
                           anchor_version=0)
    work.prepare_model(cfg, node, weights, spec.base_hash)
    capsys.readouterr()
    work.run_sft(cfg, node, instr)
    assert "round 3" not in capsys.readouterr().out
    upd = work.run_sft(cfg, dataclasses.replace(node, progress_stdout=True), instr)
    (line,) = capsys.readouterr().out.splitlines()
    assert line == (f"distmoe party {node.party}: round 3 sft:lookup: loss {upd.metrics['loss_first']:.4f} -> "
                    f"{upd.metrics['loss_last']:.4f} over 2 steps ({upd.num_examples} examples)")


def test_a_party_with_public_balance_trains_with_it_and_names_an_unusable_prompt_file(tmp_path, synth_dirs,
                                                                                         tiny_plain):
    """routing.public-balance-coef at the party: the same round with it on moves the routers differently (the rest
    only through the shared gradient clip); a public-balance-path it cannot use is refused, naming file and line."""
    from distmoe.config import SimConfig, parse_node_config, parse_run_config
    from distmoe.model import base as base_mod
    from distmoe.party import work

    over = {**tiny_plain, "train.local-steps": 1}
    node = parse_node_config({"data-path": str(synth_dirs[0]), "work-dir": str(tmp_path / "w")}, SimConfig())
    weights, spec = _global(over)
    instr = SftInstruction(round=1, task="lookup", weights=weights, base_hash=spec.base_hash, seed=1, anchor=None,
                           anchor_version=0)
    base_mod.clear_cache()
    plain = work.run_sft(parse_run_config(over), node, instr)
    pub = work.run_sft(parse_run_config({**over, "routing.public-balance-coef": 10.0}), node, instr)
    diff = {k: float(np.abs(plain.delta[k] - pub.delta[k]).max()) for k in plain.delta}
    router = max(v for k, v in diff.items() if ".mlp.gate." in k)
    rest = max(v for k, v in diff.items() if ".mlp.gate." not in k)
    # only the routers get its gradient; the rest differ only through the shared clip norm (measured 3e-4 vs 3e-5)
    assert router > 5 * rest, (router, rest)
    # routing.public-balance-styles reaches the party's training and its bias settle: other public batches
    one = work.run_sft(parse_run_config({**over, "routing.public-balance-coef": 10.0,
                                         "routing.public-balance-styles": 1}), node, instr)
    assert any(not np.array_equal(one.delta[k], pub.delta[k]) for k in pub.delta)
    from distmoe.party.settle import run_settle
    from distmoe.wire.schema import SettleInstruction

    settle = {**over, "routing.balance": "aux+bias", "routing.balance-source": "public",
              "routing.balance-settle-steps": 5}
    w, sp = _global(settle)
    si = SettleInstruction(round=1, base_hash=sp.base_hash, weights=w)
    b12 = run_settle(parse_run_config(settle), node, si).bias
    b1 = run_settle(parse_run_config({**settle, "routing.public-balance-styles": 1}), node, si).bias
    assert b12.shape == b1.shape and not np.array_equal(b12, b1)
    bad = tmp_path / "public.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    cfg = parse_run_config({**over, "routing.public-balance-coef": 1.0, "routing.public-balance-path": str(bad)})
    with pytest.raises(work.PartyError, match=r"public-balance-path.*public.jsonl:2"):
        work.run_sft(cfg, node, instr)
    base_mod.clear_cache()


def test_setup_names_the_work_directory_and_ledger_in_the_party_log(synth_dirs, tmp_path, tiny_plain, capsys):
    """At setup the party's own log (the SuperNode's stdout) names its work directory and the ledger path, and
    the ledger is there."""
    import os

    from clients.app import setup
    from distmoe.config import parse_run_config
    from distmoe.privacy.plan import plan_privacy
    from distmoe.wire.schema import SetupRequest

    run_config = {k: v for k, v in tiny_plain.items() if k != "privacy.mode"}
    cfg = parse_run_config(run_config)
    z = plan_privacy(cfg.privacy, cfg.schedule).noise_multiplier
    work = tmp_path / "hospital-a" / "work"
    reply = setup(_instruction(SetupRequest(os.urandom(16), 2, 4096, 2, z, 0.0), 10),
                  _context(synth_dirs[0], run_config, work, "hospital-a", 10))
    assert not reply.has_error(), reply.error.reason
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "work directory" in x]
    ledger = work / "ledger" / "hospital-a.jsonl"
    assert line.startswith(f"distmoe party hospital-a: work directory {work} (ledger {ledger},")
    assert f"error detail {work / 'party.log'}" in line and ledger.is_file()
