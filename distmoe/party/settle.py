"""What a party computes for the bias settle: the received global model's routing bias, settled on the public
balance prompts (``routing.balance-settle-steps``; ``docs/algorithms.md``, Settling the bias).

``run_settle`` takes the instruction's global weights only: it loads the party's prepared base with them
(``distmoe.party.work.prepare_model``, fingerprint-checked), makes ``K`` bias-only updates on the public balance
batches from the first at the rates of ``routing.balance-settle-schedule``
(``train.public_balance.settle_bias``; the prompts from ``run.seed`` or
``routing.public-balance-path``, the same at every party) and returns the settled bias. It never opens the
party's data directory and never sees weights after local training, so its reply is a deterministic function of
public inputs, the same at every honest party on the same device type and precision: ``docs/privacy.md`` §3.

Must not: read the party's data, import ``flwr``, or return anything but a ``SettleReply``.
"""

from __future__ import annotations

import numpy as np
import torch

from distmoe.config import NodeConfig, RunConfig
from distmoe.model.balance import BalanceTracker, biases, has_bias, settle_rates
from distmoe.party.work import PartyError, prepare_model
from distmoe.train.public_balance import PublicBalance, PublicBalanceError, balance_prompts, settle_bias
from distmoe.wire.errors import ErrorCode
from distmoe.wire.schema import SettleInstruction, SettleReply


def run_settle(cfg: RunConfig, node: NodeConfig, instr: SettleInstruction) -> SettleReply:
    torch.set_num_threads(cfg.train.threads)
    model, tok, _ = prepare_model(cfg, node, instr.weights, instr.base_hash)
    r = cfg.routing
    if not has_bias(model):
        raise PartyError(f"party {node.party}: a bias settle for a model without a routing bias "
                         "(routing.balance must be \"bias\" or \"aux+bias\")", ErrorCode.CONFIG)
    try:
        prompts = balance_prompts(cfg.run.seed, r.public_balance_path, r.public_balance_styles)
        public = PublicBalance(model, tok, prompts, 0.0, r.public_balance_batch, cfg.model.max_seq_len)
    except PublicBalanceError as exc:
        raise PartyError(f"party {node.party}: {exc}", ErrorCode.MODEL) from None
    with BalanceTracker(model, r.balance_settle_rate, r.balance_count) as tracker:
        settle_bias(model, public, tracker,
                    settle_rates(r.balance_settle_steps, r.balance_settle_rate, r.balance_settle_schedule))
    bias = np.stack([b.detach().double().cpu().numpy() for b in biases(model)])  # [L, E]
    return SettleReply(party=node.party, bias=bias)
