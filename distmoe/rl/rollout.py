"""Rollouts for GRPO: sample G responses per prompt from the inference engine, record the engine's
own per-token log-probs, recompute them under the training model, and compare routing.

Owns: ``generate_rollouts`` (pure sampling: ``do_sample=True, top_k=0, top_p=1.0``, temperature
applied once, log-probs from the post-processor ``scores``, never from raw ``logits``), the
response mask (ends after the first eos, which is included; later tokens are padding),
``train_logprobs`` (teacher-forced log-probs under the training model with the same temperature and
the same position ids as ``generate``) and ``routing_disagreement``.

Must not: compute rewards, advantages or losses, update any model, or import Flower.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from distmoe.data.template import collate_prompts
from distmoe.model.build import router_modules
from distmoe.model.device import autocast_for, device_of
from distmoe.model.router import topk_experts
from distmoe.rl.replay import RouteRecorder, replay_routes


@dataclass
class Rollouts:
    sequences: torch.Tensor  # [N, P+T] left-padded prompt + response (pad after eos)
    attention_mask: torch.Tensor  # [N, P+T] 1 on prompt tokens and on every generated position
    prompt_len: int  # P (prompts are left-padded to this length)
    response: torch.Tensor  # [N, T] sampled response tokens
    logp_infer: torch.Tensor  # [N, T] float32 log pi_infer(token) from the engine's scores
    response_mask: torch.Tensor  # [N, T] bool, True up to and including the first eos
    texts: list[str]  # N decoded responses (valid tokens, special tokens skipped)
    prompt_index: torch.Tensor  # [N] which input prompt each row samples (row i -> i // G)
    group_size: int
    temperature: float
    # [L, N, P+T, k] long: the experts the engine's routers used while generating (``record_routes=True``);
    # -1 where the engine routed nothing (the last position). Used by routing replay (``replay.py``).
    engine_routes: torch.Tensor | None = None

    @property
    def num_rollouts(self) -> int:
        return int(self.sequences.shape[0])

    @property
    def position_ids(self) -> torch.Tensor:
        """[N, P+T] positions as ``generate`` assigns them with left padding (cumsum of the mask)."""
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_mask_from_tokens(response: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """[N, T] tokens -> [N, T] bool mask: True up to and including the first eos of each row."""
    if eos_token_id is None:
        return torch.ones_like(response, dtype=torch.bool)
    is_eos = (response == eos_token_id).long()  # [N, T]
    eos_before = is_eos.cumsum(-1) - is_eos  # [N, T] number of eos strictly before t
    return eos_before == 0


def engine_model(engine) -> nn.Module:
    """The module an ``InferenceEngine`` generates with (a plain model is its own engine)."""
    return engine.model if hasattr(engine, "model") and isinstance(engine.model, nn.Module) else engine


@torch.no_grad()
def generate_rollouts(engine, tokenizer, prompts: list[list[int]], group_size: int, max_new_tokens: int,
                      temperature: float | None = None, seed: int = 0, record_routes: bool = False) -> Rollouts:
    """Sample ``group_size`` responses per prompt from ``engine`` (an ``InferenceEngine`` or a model).

    Rows are prompt-major: rows ``i*G .. i*G+G-1`` are prompt ``i``. ``temperature`` defaults to the
    engine's. The global RNG state is restored afterwards (sampling uses a forked RNG seeded with
    ``seed``), so the same seed, engine and prompts give identical rollouts. ``record_routes=True`` also
    records, with forward hooks on the engine's routers, the experts every generation forward used
    (``Rollouts.engine_routes``; recording changes no number).
    """
    if group_size < 1 or max_new_tokens < 1:
        raise ValueError(f"group_size and max_new_tokens must be >= 1, got {group_size}, {max_new_tokens}")
    if temperature is None:
        temperature = float(getattr(engine, "temperature", 1.0))
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    model = engine_model(engine)
    model.eval()
    rows = [list(p) for p in prompts for _ in range(group_size)]
    batch = collate_prompts(rows, tokenizer.pad_token_id)
    dev = device_of(model)
    ids, mask = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)  # [N, P]
    plen = int(ids.shape[1])
    eos = tokenizer.eos_token_id
    recorder = RouteRecorder(model) if record_routes else None
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), autocast_for(model), \
            (recorder if recorder is not None else nullcontext()):
        torch.manual_seed(seed)
        go = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                            temperature=float(temperature), max_new_tokens=int(max_new_tokens),
                            output_scores=True, return_dict_in_generate=True,
                            eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    seqs = go.sequences  # [N, P+T]
    routes = None if recorder is None else recorder.assemble(int(seqs.shape[0]), plen, int(seqs.shape[1]))
    response = seqs[:, plen:]  # [N, T]
    scores = torch.stack(go.scores, 1).float()  # [N, T, V] post-processor scores (temperature applied)
    logp = torch.log_softmax(scores, -1).gather(-1, response[..., None]).squeeze(-1)  # [N, T]
    rmask = response_mask_from_tokens(response, eos)  # [N, T]
    logp = torch.where(rmask, logp, torch.zeros_like(logp))  # padding rows of scores are meaningless
    full_mask = torch.cat([mask, torch.ones_like(response)], 1)  # [N, P+T]
    texts = [tokenizer.decode(r[m].tolist(), skip_special_tokens=True) for r, m in zip(response, rmask, strict=True)]
    index = torch.arange(len(prompts), device=dev).repeat_interleave(group_size)  # [N]
    return Rollouts(sequences=seqs, attention_mask=full_mask, prompt_len=plen, response=response,
                    logp_infer=logp.float(), response_mask=rmask, texts=texts, prompt_index=index,
                    group_size=group_size, temperature=float(temperature), engine_routes=routes)


def train_logprobs(model: nn.Module, rollouts: Rollouts, temperature: float | None = None,
                   grad: bool = False, replay: bool = False, router_logits: bool = False):
    """Teacher-forced ``log pi_train(response token)`` ``[N, T]`` float32 (0 on padding).

    Same temperature as the rollout (logits / T before log_softmax) and the same position ids as
    ``generate``, so with the ``exact`` profile in fp32 the difference to ``logp_infer`` is ~1e-6.
    ``grad=True`` keeps the graph (for the policy-gradient step). ``replay=True`` runs the pass with the
    engine's recorded experts (``replay.replay_routes``; needs ``rollouts.engine_routes``).
    ``router_logits=True`` returns ``(logp, router_logits)`` with the model's router logits, L x ``[N*(P+T), E]``
    (with the graph when ``grad``), e.g. for a load-balance loss.
    """
    temp = rollouts.temperature if temperature is None else float(temperature)
    plen = rollouts.prompt_len
    if replay and rollouts.engine_routes is None:
        raise ValueError("train_logprobs(replay=True): the rollouts carry no engine routes "
                         "(generate_rollouts(..., record_routes=True))")
    with torch.set_grad_enabled(grad), replay_routes(model, rollouts.engine_routes if replay else None), \
            autocast_for(model):
        out = model(input_ids=rollouts.sequences, attention_mask=rollouts.attention_mask,
                    position_ids=rollouts.position_ids, use_cache=False, output_router_logits=router_logits)
        logits = out.logits[:, plen - 1:-1].float() / temp  # [N, T, V] position P-1+t predicts token t
        logp = torch.log_softmax(logits, -1).gather(-1, rollouts.response[..., None]).squeeze(-1)  # [N, T]
    logp = logp * rollouts.response_mask.to(logp.dtype)
    if router_logits:
        return logp, tuple(out.router_logits)
    return logp


def _record_routes(model: nn.Module, rollouts: Rollouts) -> list[torch.Tensor]:
    """Teacher-forced pass; per MoE layer the chosen experts ``[N, P+T, k]`` (after any prune hook)."""
    routers = router_modules(model)
    if not routers:
        raise ValueError("routing_disagreement: model has no top-k router modules")
    top_k = int(model.config.num_experts_per_tok)
    got: dict[int, torch.Tensor] = {}
    handles = []
    for li, (_, mod) in enumerate(routers):
        def hook(_mod, _inp, out, li=li):
            if isinstance(out, tuple) and len(out) == 3:
                got[li] = out[2].detach()  # [N*(P+T), k] the router's own choice
            else:
                logits = out[0] if isinstance(out, tuple) else out
                got[li] = topk_experts(logits.detach(), top_k)  # [N*(P+T), k]
        handles.append(mod.register_forward_hook(hook))  # registered last: sees pruned routes
    try:
        with torch.no_grad(), autocast_for(model):
            model(input_ids=rollouts.sequences, attention_mask=rollouts.attention_mask,
                  position_ids=rollouts.position_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    n, s = rollouts.sequences.shape
    return [got[li].reshape(n, s, -1) for li in range(len(routers))]


def routing_disagreement(policy: nn.Module, engine, rollouts: Rollouts) -> list[float]:
    """Per MoE layer: share of valid response tokens whose top-k expert SET differs between models.

    Tokens are the positions whose outputs produce the response log-probs (``P-1+t`` for every valid
    response token ``t``). ``engine`` may be an ``InferenceEngine`` or a model.
    """
    a = _record_routes(policy, rollouts)
    b = _record_routes(engine_model(engine), rollouts)
    plen, t = rollouts.prompt_len, rollouts.response.shape[1]
    valid = rollouts.response_mask  # [N, T]
    n_valid = int(valid.sum())
    out = []
    for ra, rb in zip(a, b, strict=True):
        sa = torch.sort(ra[:, plen - 1:plen - 1 + t], -1).values  # [N, T, k]
        sb = torch.sort(rb[:, plen - 1:plen - 1 + t], -1).values  # [N, T, k]
        differ = (sa != sb).any(-1) & valid  # [N, T]
        out.append(float(differ.sum()) / max(n_valid, 1))
    return out
