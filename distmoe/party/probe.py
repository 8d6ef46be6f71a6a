"""What a party computes for the routing probe: the received global model's routing on the public probe prompts.

``run_probe`` takes the instruction's global weights and prompts only: it loads the party's prepared base
(``distmoe.party.work.prepare_model``: the same cached base, fingerprint-checked) with those weights and runs
``distmoe.routing.probe.probe_routing``. It never opens the party's data directory and never sees weights after
local training, so its reply is a deterministic function of public inputs: ``docs/privacy.md`` §3 (the probe).

``run_carried`` answers the probe carried on a phase instruction (its ``probe`` field: the probe of the weights
that instruction carries, which are the previous round's global model): the party service calls it before any
local work of that instruction, so it measures the received weights exactly as a ``query.probe`` message would.
It first checks the request (``check_request``): the run must probe (``routing.probe-every`` > 0) and the prompts
must be the run's public probe set, the default set drawn from ``run.seed`` (``routing.probe-prompts`` of them)
or, with ``routing.probe-path``, that file's prompts where the party can read it (a deployed party without the
file checks only the wire's bounds: the reply is still a function of public inputs and the weights it was sent).
It returns the probe's arrays and their bounds (``[L, E]`` and ``[L, <= prompts x model.max-seq-len]`` from the
party's own model), which the party's outbound guard checks the reply against.

Must not: read the party's data, import ``flwr``, or return anything but the probe's arrays.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distmoe.config import NodeConfig, RunConfig
from distmoe.model.build import describe
from distmoe.party.work import PartyError, prepare_model
from distmoe.routing.probe import ProbeError, default_probe_prompts, probe_routing, read_probe_file
from distmoe.wire.allow_list import ProbeBounds
from distmoe.wire.errors import ErrorCode
from distmoe.wire.schema import ProbeInstruction, ProbePart, ProbeReply


def run_probe(cfg: RunConfig, node: NodeConfig, instr: ProbeInstruction) -> ProbeReply:
    return _probe(cfg, node, instr)[0]


def _probe(cfg: RunConfig, node: NodeConfig, instr: ProbeInstruction) -> tuple[ProbeReply, ProbeBounds]:
    torch.set_num_threads(cfg.train.threads)
    model, tok, _ = prepare_model(cfg, node, instr.weights, instr.base_hash)
    routing, top1 = probe_routing(model, tok, tuple(instr.prompts), cfg.model.max_seq_len, cfg.eval.batch_size)
    ms = describe(model)
    bounds = ProbeBounds(ms.num_moe_layers, ms.num_experts, len(instr.prompts) * cfg.model.max_seq_len)
    return ProbeReply(party=node.party, routing=routing, top1=top1), bounds


def check_request(cfg: RunConfig, prompts: tuple[str, ...]) -> None:
    """``PartyError`` (code ``refused``) unless ``prompts`` are this run's public probe prompts (module docstring)."""
    r = cfg.routing
    if r.probe_every <= 0:
        raise PartyError("a carried routing probe in a run with routing.probe-every = 0: refused", ErrorCode.REFUSED)
    try:
        if not r.probe_path:
            public = default_probe_prompts(cfg.run.seed, r.probe_prompts)
        elif Path(r.probe_path).is_file():
            public = read_probe_file(r.probe_path)
        else:
            return
    except ProbeError as exc:
        raise PartyError(f"the run's probe prompts cannot be read here: {exc}", ErrorCode.CONFIG) from None
    if tuple(prompts) != public:
        raise PartyError(f"a carried routing probe of {len(prompts)} prompts that are not the run's {len(public)} "
                         "public probe prompts: refused, nothing computed", ErrorCode.REFUSED)


def run_carried(cfg: RunConfig, node: NodeConfig, instr) -> tuple[ProbePart, ProbeBounds]:
    """The probe a phase instruction carries (``instr.probe``), on its global weights, before any local work."""
    check_request(cfg, instr.probe)
    reply, bounds = _probe(cfg, node, ProbeInstruction(instr.round, instr.base_hash, instr.probe, instr.weights))
    return ProbePart(reply.routing, reply.top1), bounds
