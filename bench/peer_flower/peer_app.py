"""The plain-Flower peer of distmoe's SFT rounds: what a user would otherwise run with Flower alone.

A ServerApp that runs Flower's built-in ``FedAvg`` strategy (Message API, ``flwr.serverapp.strategy``) for
``num-server-rounds`` rounds with no client-side evaluation, and a ClientApp whose ``train`` handler loads the
received ``ArrayRecord`` into the model, runs ``local-steps`` AdamW steps of ``batch-size`` sequences with the
plain ``transformers`` loss (``model(input_ids, attention_mask, labels).loss``), clips the gradient norm and
replies with the whole state dict and ``num-examples``. No secure aggregation, ledger, guard, checkpoint or probe.

What it shares with distmoe, so that the two differ only in what distmoe adds: the tiny Qwen3-MoE built from
the same ``model.*`` defaults and seed (bit-identical initial weights: the ServerApp logs their
``hash_tensors`` digest), the same party data files (``data-root/<party>/<task>.jsonl``, the party of
partition ``i`` being the ``i``-th directory in name order, as ``distmoe simulate --data`` assigns them) and the
same token ids (distmoe's chat-template encoding and batch order, ``distmoe.data.template``). Like distmoe's
parties on the Simulation Engine, each ClientApp process keeps the built model and the encoded data between
messages.

Per-round times come from Flower's own round log lines (``[ROUND k/N]``, ``Strategy execution finished``):
``round-log`` names a file where the ServerApp adds a handler to Flower's logger that writes each line with its
timestamp (``bench/peer_flower.py`` reads it). Each reply's ``handler-s`` (seconds in the ``train`` handler) shows in
Flower's ``Aggregated MetricRecord`` line as the example-weighted mean over the parties.

Must not: be imported by distmoe (benchmark only).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import FLOWER_LOGGER, log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from distmoe.config import parse_run_config
from distmoe.data.party import load_party
from distmoe.data.template import batch_iterator, collate, encode_fitting
from distmoe.model.build import build_model, hash_tensors

server = ServerApp()
client = ClientApp()
_CACHE: dict = {}  # per ClientApp process: the model and each partition's encoded training set


def _defaults():
    return parse_run_config({})


@server.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    if rc["round-log"]:
        handler = logging.FileHandler(str(rc["round-log"]))
        handler.setFormatter(logging.Formatter("%(created).6f %(message)s"))
        FLOWER_LOGGER.addHandler(handler)
    torch.manual_seed(0)
    model, _ = build_model(_defaults().model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    log(logging.INFO, "peer: initial weights sha256 %s (%d tensors)", hash_tensors(state), len(state))
    n = len(grid.get_node_ids()) or 3
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(state), num_rounds=int(rc["num-server-rounds"]),
                   train_config=ConfigRecord({"lr": float(rc["lr"])}))


def _setup(context: Context):
    rc = context.run_config
    pid = int(context.node_config["partition-id"])
    if "model" not in _CACHE:
        torch.set_num_threads(int(rc["threads"]))
        _CACHE["model"] = build_model(_defaults().model)
    model, tok = _CACHE["model"]
    key = ("data", pid)
    if key not in _CACHE:
        cfg = _defaults()
        parties = sorted(p for p in Path(str(rc["data-root"])).iterdir() if p.is_dir())
        data = load_party(parties[pid], cfg.data)
        _, encoded, _ = encode_fitting(tok, data.train(str(rc["task"])), cfg.model.max_seq_len)
        _CACHE[key] = encoded
    return model, tok, _CACHE[key], pid


@client.train()
def train(msg: Message, context: Context) -> Message:
    rc = context.run_config
    t0 = time.perf_counter()
    model, tok, encoded, pid = _setup(context)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    rnd = int(msg.content["config"].get("server-round", 0))
    seed = 1000 * rnd + pid
    torch.manual_seed(seed)
    model.train()
    # ``fused``: torch's fused AdamW kernel, which distmoe's parties use on the CPU and CUDA (the same update to
    # rounding); off by default: torch's default implementation, what a plain app gets
    opt = torch.optim.AdamW(model.parameters(), lr=float(msg.content["config"]["lr"]), weight_decay=0.0,
                            fused=bool(rc.get("fused", False)) or None)
    losses = []
    for raw in batch_iterator(encoded, int(rc["batch-size"]), int(rc["local-steps"]), seed):
        batch = collate(raw, tok.pad_token_id)  # input_ids, attention_mask, labels: [B, T]
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"], use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(rc["grad-clip"]))
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"train_loss": losses[-1], "num-examples": len(encoded),
                                                   "handler-s": time.perf_counter() - t0})})
    return Message(content=content, reply_to=msg)
