"""What a party computes for the routing probe: the received global model's routing on the public probe prompts.

Both ways a probe is asked for take one path, ``_probe``: the stand-alone request (``run_probe``, a
``query.probe`` message: after the last round of a run and before a round that grows the model) and the request
carried on a phase instruction (``run_carried``: its ``probe`` field, the probe of the weights that instruction
carries, which are the previous round's global model; the party service calls it before any local work of that
instruction, so it measures the received weights exactly as a ``query.probe`` message would). ``_probe`` first
checks the request (``check_request``): the run must probe (``routing.probe-every`` > 0) and the prompts must be
the run's public probe set, the default set drawn from ``run.seed`` (``routing.probe-prompts`` of them) or, with
``routing.probe-path``, that file's prompts where the party can read it (a deployed party without the file checks
only the wire's bounds: the reply is still a function of public inputs and the weights it was sent). A request
that fails is refused (``PartyError``, code ``refused``, naming which request of which round and the first prompt
that differs) before the base is loaded or any forward pass runs. Only then does it take the instruction's global
weights and prompts: it loads the party's prepared base (``distmoe.party.work.prepare_model``: the same cached
base, fingerprint-checked) with those weights and runs ``distmoe.routing.probe.probe_routing``. It never opens
the party's data directory and never sees weights after local training, so its reply is a deterministic function
of public inputs: ``docs/privacy.md`` §3 (the probe). It returns the probe's arrays and their bounds (``[L, E]``
and ``[L, <= prompts x model.max-seq-len]`` from the party's own model), which the party's outbound guard checks
a carried probe against.

Must not: read the party's data, import ``flwr``, run the model on prompts that failed ``check_request``, or
return anything but the probe's arrays.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distmoe.config import NodeConfig, RunConfig
from distmoe.model.build import describe
from distmoe.party.work import Loaded, PartyError, prepare_model
from distmoe.routing.probe import ProbeError, default_probe_prompts, probe_routing, read_probe_file
from distmoe.wire.allow_list import ProbeBounds
from distmoe.wire.errors import ErrorCode
from distmoe.wire.schema import ProbeInstruction, ProbePart, ProbeReply


def run_probe(cfg: RunConfig, node: NodeConfig, instr: ProbeInstruction) -> ProbeReply:
    """A stand-alone probe request (``query.probe``): checked, then measured (module docstring)."""
    return _probe(cfg, node, instr, f"round {instr.round}: a stand-alone routing probe request (query.probe)")[0]


def run_carried(cfg: RunConfig, node: NodeConfig, instr, loaded: Loaded) -> tuple[ProbePart, ProbeBounds]:
    """The probe a phase instruction carries (``instr.probe``), on its global weights, before any local work; read-only
    on the instruction's own weights, so the phase work that follows with the same note (``loaded``: the message's)
    finds them loaded (``prepare_model``)."""
    reply, bounds = _probe(cfg, node, ProbeInstruction(instr.round, instr.base_hash, instr.probe, instr.weights),
                           f"round {instr.round}: a routing probe request carried on the phase instruction", loaded)
    return ProbePart(reply.routing, reply.top1), bounds


def _probe(cfg: RunConfig, node: NodeConfig, instr: ProbeInstruction, where: str, loaded: Loaded | None = None
           ) -> tuple[ProbeReply, ProbeBounds]:
    """The one path of every probe request: ``check_request`` before anything else, then the forward pass."""
    check_request(cfg, tuple(instr.prompts), where)
    torch.set_num_threads(cfg.train.threads)
    model, tok, _ = prepare_model(cfg, node, instr.weights, instr.base_hash, loaded, read_only=loaded is not None)
    routing, top1 = probe_routing(model, tok, tuple(instr.prompts), cfg.model.max_seq_len, cfg.eval.batch_size)
    ms = describe(model)
    bounds = ProbeBounds(ms.num_moe_layers, ms.num_experts, len(instr.prompts) * cfg.model.max_seq_len)
    return ProbeReply(party=node.party, routing=routing, top1=top1), bounds


def check_request(cfg: RunConfig, prompts: tuple[str, ...], where: str) -> None:
    """``PartyError`` (code ``refused``, naming ``where``) unless ``prompts`` are this run's public probe prompts
    (module docstring)."""
    r = cfg.routing
    if r.probe_every <= 0:
        raise PartyError(f"{where} in a run with routing.probe-every = 0: refused, nothing computed",
                         ErrorCode.REFUSED)
    try:
        if not r.probe_path:
            public, source = default_probe_prompts(cfg.run.seed, r.probe_prompts), (
                f"the default set of run.seed = {cfg.run.seed}, routing.probe-prompts = {r.probe_prompts}")
        elif Path(r.probe_path).is_file():
            public, source = read_probe_file(r.probe_path), f"routing.probe-path {Path(r.probe_path).name}"
        else:
            return
    except ProbeError as exc:
        raise PartyError(f"{where}: the run's probe prompts cannot be read here: {exc}", ErrorCode.CONFIG) from None
    if tuple(prompts) != public:
        first = next((i for i, (a, b) in enumerate(zip(prompts, public, strict=False)) if a != b),
                     min(len(prompts), len(public)))
        raise PartyError(f"{where}: {len(prompts)} prompts that are not the run's {len(public)} public probe prompts "
                         f"({source}; prompt {first + 1} differs): refused, nothing computed", ErrorCode.REFUSED)
