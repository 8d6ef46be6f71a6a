"""What a party computes for the routing probe: the received global model's routing on the public probe prompts.

``run_probe`` takes the instruction's global weights and prompts only: it loads the party's prepared base
(``distmoe.party.work.prepare_model``: the same cached base, fingerprint-checked) with those weights and runs
``distmoe.routing.probe.probe_routing``. It never opens the party's data directory and never sees weights after
local training (it is its own message, answered from the instruction alone), so its reply is a deterministic
function of public inputs: ``docs/privacy.md`` §3 (the probe).

Must not: read the party's data, import ``flwr``, or return anything but a ``ProbeReply``.
"""

from __future__ import annotations

import torch

from distmoe.config import NodeConfig, RunConfig
from distmoe.party.work import prepare_model
from distmoe.routing.probe import probe_routing
from distmoe.wire.schema import ProbeInstruction, ProbeReply


def run_probe(cfg: RunConfig, node: NodeConfig, instr: ProbeInstruction) -> ProbeReply:
    torch.set_num_threads(cfg.train.threads)
    model, tok, _ = prepare_model(cfg, node, instr.weights, instr.base_hash)
    routing, top1 = probe_routing(model, tok, tuple(instr.prompts), cfg.model.max_seq_len, cfg.eval.batch_size)
    return ProbeReply(party=node.party, routing=routing, top1=top1)
