"""A base with general competence for the tiny default model: a centralised multi-task warm-up over every
synthetic family, on public data generated from a fixed seed, cached as a checkpoint.

A continual run that starts from random weights forgets everything (the whole model was task A); a
pretrained LLM forgets partially. ``build_base`` gives the default model such a base before the
continual tasks: ``model.warmup-steps`` optimizer steps of the ordinary local SFT loop
(``distmoe.train.sft.train_sft``: ``train.batch-size``, ``train.lr*``, the routing balance of
``routing.*``, no anchor; its batches are already public, so a routing bias counts them and the public balance
of ``routing.public-balance-*`` is not added) on a shuffled mix of all ``TASK_FAMILIES``,
``WARMUP_EXAMPLES`` examples per family and synthetic party window, generated with
``generate(task, party, n, seed + PUBLIC_SEED_OFFSET)``.
The data is public and synthetic, never a party's: the lookup family draws its fact table from that
offset seed, so the base knows the format of every family and the arithmetic facts, not the parties'
lookup table. It runs once, at the coordinator (or ``distmoe base build``), before any party is contacted.

The result is a checkpoint directory ``<cache>/base-<key>/round-0`` written by
``distmoe.checkpoint.save_checkpoint`` (``trainable.safetensors`` with every weight, ``model/`` a Hugging
Face directory loadable with ``model.path``, ``manifest.json`` with hashes and ``base`` = what built it);
``key`` is a SHA-256 over the model, train and routing sections, the steps, the seed and ``FORMAT``,
so another config or seed gets another base, and the same ones reuse it (the directory verifies
against its manifest, or it is rebuilt). A run starts from it like from any checkpoint
(``run.init-from``; ``model.warmup-steps`` does it automatically).

Must not: read party data, talk to parties, or write outside the cache directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
from pathlib import Path

import torch

from distmoe.checkpoint import CheckpointError, save_checkpoint, verify_checkpoint
from distmoe.config import RunConfig
from distmoe.data.formats import parse_line
from distmoe.data.synth import TASK_FAMILIES, generate
from distmoe.data.template import encode_example
from distmoe.model.build import build_model, describe, hash_tensors
from distmoe.model.trainable import apply_trainable, trainable_state
from distmoe.train.sft import train_sft

FORMAT = 1  # of the base; part of the key
PUBLIC_SEED_OFFSET = 1_000_003  # the warm-up data's seed is run.seed + this: never a party's data seed
WARMUP_PARTIES = 3  # synthetic party windows mixed into the warm-up (all lookup keys, all string operations)
WARMUP_EXAMPLES = 200  # per family and window


class BaseError(RuntimeError):
    """A base cannot be built or used."""


def base_key(cfg: RunConfig, steps: int) -> str:
    """What identifies a base: the model, train and routing sections, the steps, the seed, ``FORMAT``."""
    parts = {"format": FORMAT, "steps": steps, "seed": cfg.run.seed, "families": list(TASK_FAMILIES),
             "examples": WARMUP_EXAMPLES, "parties": WARMUP_PARTIES,
             "model": dataclasses.asdict(cfg.model), "train": dataclasses.asdict(cfg.train),
             "routing": dataclasses.asdict(cfg.routing)}
    parts["model"].pop("warmup_cache", None)  # where it is kept does not change it
    for volatile in ("threads", "device", "micro_batch_size", "gradient_checkpointing"):  # same result
        parts["train"].pop(volatile, None)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def warmup_examples(seed: int, max_len: int, tok) -> list[tuple[list[int], list[int]]]:
    """The encoded warm-up mix (public synthetic data from ``seed + PUBLIC_SEED_OFFSET``), shuffled."""
    data_seed = seed + PUBLIC_SEED_OFFSET
    out = []
    for task in TASK_FAMILIES:
        for party in range(WARMUP_PARTIES):
            for i, obj in enumerate(generate(task, party, WARMUP_EXAMPLES, data_seed)):
                out.append(encode_example(tok, parse_line(obj, f"warm-up {task}/{party}:{i}"), max_len))
    random.Random(f"distmoe-warmup:{data_seed}").shuffle(out)
    return out


def base_dir(cache: Path, cfg: RunConfig, steps: int) -> Path:
    return Path(cache) / f"base-{base_key(cfg, steps)[:20]}" / "round-0"


def build_base(cfg: RunConfig, steps: int, cache: Path, log=print) -> Path:
    """The cached base checkpoint for ``cfg`` after ``steps`` warm-up steps (built when missing or broken)."""
    if steps < 1:
        raise BaseError(f"model.warmup-steps: {steps} (must be >= 1 to build a base)")
    if cfg.model.path or cfg.model.trainable == "lora":
        raise BaseError("model.warmup-steps: the warm-up gives the tiny default model a base (model.path = \"\", "
                        f"model.trainable all or router+experts); got model.path = {cfg.model.path!r}, "
                        f"model.trainable = {cfg.model.trainable!r}; a checkpoint is already a base")
    target = base_dir(cache, cfg, steps)
    if target.is_dir():
        try:
            verify_checkpoint(target)
            log(f"base: using the cached warm-up base {target}")
            return target
        except CheckpointError as exc:
            log(f"base: cached base {target} is unusable ({exc}); rebuilding it")
            shutil.rmtree(target, ignore_errors=True)
    model, tok = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    spec = describe(model)
    encoded = warmup_examples(cfg.run.seed, cfg.model.max_seq_len, tok)
    train = dataclasses.replace(cfg.train, local_steps=steps)
    log(f"base: warm-up of the tiny model, {steps} steps on {len(encoded)} public synthetic examples "
        f"({', '.join(TASK_FAMILIES)}) ...")
    torch.set_num_threads(cfg.train.threads)
    # the warm-up's own batches are the public mix: a routing bias counts them (balance-source "public" names the
    # public balance batch of a party's step, which the warm-up has no need of), and no public balance is added
    routing = dataclasses.replace(cfg.routing, balance_source="party", public_balance_coef=0.0)
    res = train_sft(model, encoded, tok.pad_token_id, train, routing, spec.num_experts, spec.top_k,
                    None, cfg.run.seed + PUBLIC_SEED_OFFSET)
    weights = trainable_state(model)
    meta = {"base": {"format": FORMAT, "key": base_key(cfg, steps), "steps": steps, "seed": cfg.run.seed,
                     "data_seed": cfg.run.seed + PUBLIC_SEED_OFFSET, "families": list(TASK_FAMILIES),
                     "loss_first": res.summary()["loss_first"], "loss_last": res.summary()["loss_last"]},
            "trainable": cfg.model.trainable, "layout": "model"}

    def write_model(d: Path) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no shard progress bar in the run log
        model.save_pretrained(d / "model")
        tok.save_pretrained(d / "model")

    save_checkpoint(target.parent, 0, weights, hash_tensors(weights), write_model=write_model, meta=meta, keep=1)
    log(f"base: written to {target} (task loss {res.summary()['loss_first']:.3f} -> "
        f"{res.summary()['loss_last']:.3f})")
    return target
