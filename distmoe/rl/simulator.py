"""The ICEPOP seed's inference simulator: an optional approximation of the train/inference mismatch
``delta = logp_train(theta_old) - logp_infer(theta_old)`` (``docs/algorithms.md``, "The ICEPOP seed's inference
simulator"). It approximates the ratio IcePop corrects (Ring-1T, https://arxiv.org/abs/2510.18855); the simulator
itself is the ICEPOP seed's idea and has no paper. With ``N`` rollouts of ``T`` response tokens, ``L`` MoE layers,
``E`` experts, ``k`` = top-k::

    o          = mean over valid calibration tokens of clamp(z_infer - z_train, -30, 30)      [L, E]
    routes_sim = topk(z_train + o, k)                                                          [L, N, T, k]
    delta_hat  = MLP(features of the theta_old forward), Huber fit on calibration delta        [N, T]
    logp_old   = logp_infer + delta_hat                                                        [N, T]
    w          = exp(delta_hat) if |delta_hat| <= bound else 0   (per token, or per sequence  [N, T]
                 from the mean delta_hat over its valid tokens)
    L_LB,sim   = E * sum_e f_e P_e on z_train + o   (f_e: share of simulated top-k picks,     []
                 P_e: mean softmax(z_train + o), both pooled over layers and valid tokens)
    clip option: delta_hat := clamp(delta_hat, -bound, bound) first, then nothing is masked    [N, T]
    last layer : (w, b) = argmin |H w + b - delta|^2 + lam |w|^2, H = relu(W1 x_std + b1)      [h], []
                 (ridge on the buffer, first layer and standardisation fixed)
    route shift: mean_l 1/2 sum_e |u_le - u_le^fit|, u = share of the policy's top-k picks     []
                 on the last full fit's own calibration tokens (u^fit: at the fit; u: the policy now), so
                 only the policy's drift moves it: two different batches of 64 response tokens differ by
                 ~0.1-0.3 from sampling alone (measured), above the default threshold

Owns: ``InferenceSimulator`` (a route-offset table ``o [L, E]`` plus a small error MLP, calibrated on rollouts
sampled from the inference engine, with a bounded buffer of calibration tokens accumulated across steps, the
incremental refit of the MLP's last layer and the routing-shift measure). What it reads and is judged by lives in
``sim_measure.py`` (re-exported here): ``heldout_split`` (the stratified held-out prompts), ``expert_usage``,
``simulated_weights`` (IcePop-style weights from ``delta_hat``), ``lb_loss_simulated`` (the load-balance loss on
the simulated routing), ``compare`` / ``r2_score`` / ``auroc`` (the "approximation vs ground truth" metrics mode)
and ``capture`` (one teacher-forced pass recording log-probs, LM logits and router logits).

Conventions:

* ``delta := logp_train(theta_old) - logp_infer(theta_old) = log k`` (the sign of ``losses.mismatch_weights``).
* With ``logp_old := logp_infer + delta_hat`` the ratio ``exp(logp_new - logp_infer - delta_hat)`` equals the PPO
  ratio ``pi_train(theta) / pi_train(theta_old)`` exactly when ``delta_hat`` is exact.
* Weights: ``k_hat = exp(delta_hat)``; a token with ``|delta_hat| > bound`` gets weight 0 (masked, IcePop-style),
  never a silently clipped ``delta``; inside the bound the weight is ``k_hat``. With exact ``delta`` this is
  IcePop with bounds ``[exp(-bound), exp(bound)]``.
* ``delta_hat`` depends on theta_old only: computed once per batch from the theta_old forward, under
  ``no_grad``, detached, and cached by the caller for every PPO minibatch / epoch.
* The offset table is ``mean(clamp(z_infer - z_train, -30, 30))`` over valid calibration tokens, so an expert
  the engine prunes (router logit -inf) shows up as -30; the simulated routing is ``topk(z_train + o)``.

Limitation (measured, ``docs/algorithms.md``): pure numeric noise (bf16, int8) is not predictable (R^2 ~ 0); the
metrics mode detects that (``degraded``) and the caller falls back to the real recompute. The features need
the theta_old forward of the training model, so the simulator saves no forward pass here; it is a risk
model and a testbed, the recompute + IcePop stays the reference path.

Must not: update the policy or the engine, sample on its own (rollouts are passed in), or import Flower.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from distmoe.model.build import num_experts as experts_of
from distmoe.model.build import router_modules
from distmoe.model.router_rule import is_sigmoid
from distmoe.rl.rollout import Rollouts, engine_model
from distmoe.rl.sim_measure import (  # noqa: F401  (the functions callers import from here)
    FEATURE_CLAMP,
    OFFSET_CLAMP,
    TeacherForced,
    auroc,
    capture,
    compare,
    expert_usage,
    heldout_split,
    lb_loss_simulated,
    r2_score,
    simulated_weights,
    topk_sets,
)


@contextmanager
def _in_eval(policy: nn.Module) -> Iterator[None]:
    """``policy`` in eval mode within the block (the simulator's teacher-forced passes), its own mode after."""
    was = policy.training
    policy.eval()
    try:
        yield
    finally:
        policy.train(was)


@dataclass
class _Chunk:
    """Calibration tokens of one batch (valid response tokens only), the raw inputs of the features."""

    router: torch.Tensor  # [L, n, E] train router logits
    per_tok: torch.Tensor  # [n, 4] entropy, logp_train, max log-prob, relative position
    delta: torch.Tensor  # [n] logp_train - logp_infer
    diff: torch.Tensor | None  # [L, n, E] clamp(z_infer - z_train) (calibration batches only; None otherwise)

    @property
    def n(self) -> int:
        return int(self.delta.numel())


class InferenceSimulator:
    """Route-offset table ``offset [L, E]`` + error MLP predicting ``delta = logp_train_old - logp_infer``.

    Features per response token (``2L + 4``): per layer the top-k margin of the simulated logits ``z_train + o``
    (k-th minus (k+1)-th largest) and a "simulated flip" flag (top-k set of ``z_train + o`` differs from that of
    ``z_train``); then the train entropy, ``logp_train``, the max log-prob and the relative position ``t / T``.
    The MLP (``F -> hidden -> 1``, ReLU) is fitted with a Huber loss and Adam on standardised features.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, hidden: int = 32, bound: float = 0.5,
                 seed: int = 0, fit_steps: int = 300, lr: float = 1e-2, heldout_frac: float = 0.25,
                 r2_min: float = 0.1, auroc_min: float = 0.7, buffer_tokens: int = 0, ridge: float = 1e-3):
        if num_layers < 1 or num_experts < 2 or not 1 <= top_k < num_experts:
            raise ValueError(f"need num_layers >= 1 and 1 <= top_k < num_experts, got {num_layers}, "
                             f"{num_experts}, {top_k}")
        if not 0.0 <= heldout_frac < 1.0:
            raise ValueError(f"heldout_frac must be in [0, 1), got {heldout_frac}")
        self.num_layers, self.num_experts, self.top_k = int(num_layers), int(num_experts), int(top_k)
        self.hidden, self.bound, self.seed = int(hidden), float(bound), int(seed)
        self.fit_steps, self.lr, self.heldout_frac = int(fit_steps), float(lr), float(heldout_frac)
        self.r2_min, self.auroc_min = float(r2_min), float(auroc_min)
        self.offset = torch.zeros(self.num_layers, self.num_experts)  # [L, E]
        self.num_features = 2 * self.num_layers + 4
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.mlp = nn.Sequential(nn.Linear(self.num_features, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 1))
        for p in self.mlp.parameters():
            p.requires_grad_(False)
        self.feat_mean = torch.zeros(self.num_features)
        self.feat_std = torch.ones(self.num_features)
        self.calibrated = False
        self.calibrations = 0
        self.last_metrics: dict[str, float] = {"r2": math.nan, "auroc": math.nan, "degraded": 1.0}
        if buffer_tokens < 0:
            raise ValueError(f"buffer_tokens must be >= 0, got {buffer_tokens}")
        self.buffer_tokens, self.ridge = int(buffer_tokens), float(ridge)
        self.buffer: list[_Chunk] = []  # oldest first; bounded by buffer_tokens (0: the latest calibration only)
        self.usage_fit: torch.Tensor | None = None  # [L, E] the policy's expert usage at the last full fit
        self.fit_tokens: list[tuple[Rollouts, torch.Tensor]] = []  # the last full fit's (rollouts, [N, T] fit rows)
        self.refits = 0  # incremental last-layer refits

    @classmethod
    def for_model(cls, model: nn.Module, **kw) -> InferenceSimulator:
        if is_sigmoid(model):
            raise ValueError(f"rl.simulator: the inference simulator's route-offset table models a softmax router "
                             f"(the top-k of z + o); the {model.config.model_type!r} router is a sigmoid with a "
                             "group-limited choice, which it does not model: set rl.simulator = false")
        sim = cls(len(router_modules(model)), experts_of(model), int(model.config.num_experts_per_tok), **kw)
        return sim.to(next(model.parameters()).device)

    def to(self, device: torch.device) -> InferenceSimulator:
        """Keep the table, the feature statistics and the MLP on the policy's device."""
        self.offset, self.feat_mean, self.feat_std = (t.to(device) for t in (self.offset, self.feat_mean,
                                                                               self.feat_std))
        self.mlp = self.mlp.to(device)
        return self

    @property
    def degraded(self) -> bool:
        return bool(self.last_metrics.get("degraded", 1.0))

    def simulated_routes(self, router_train: torch.Tensor) -> torch.Tensor:
        """``[L, ..., E]`` train router logits -> ``[L, ..., k]`` sorted top-k of ``z_train + o``."""
        off = self.offset.reshape(self.num_layers, *([1] * (router_train.dim() - 2)), self.num_experts)
        return topk_sets(router_train + off, self.top_k)

    def _raw(self, tf: TeacherForced) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw feature inputs of a pass: router logits ``[L, N, T, E]`` and per-token ``[N, T, 4]``."""
        if tf.logits is None:
            raise ValueError("features need the LM logits (capture(..., lm_logits=True))")
        z = tf.router  # [L, N, T, E]
        if z.shape[0] != self.num_layers or z.shape[-1] != self.num_experts:
            raise ValueError(f"router logits {tuple(z.shape)} do not match [L={self.num_layers}, ..., "
                             f"E={self.num_experts}]")
        logq = torch.log_softmax(tf.logits, -1)  # [N, T, V]
        ent = -(logq.exp() * logq).sum(-1)  # [N, T]
        maxlp = logq.max(-1).values  # [N, T]
        t = tf.logp.shape[1]
        pos = (torch.arange(t, dtype=torch.float32, device=tf.logp.device) / max(t - 1, 1)).expand_as(tf.logp)  # [N, T]
        return z, torch.stack([ent, tf.logp, maxlp, pos], -1)  # [L, N, T, E], [N, T, 4]

    def _features_from(self, z: torch.Tensor, per_tok: torch.Tensor) -> torch.Tensor:
        """``[L, *B, E]`` router logits and ``[*B, 4]`` per-token inputs -> ``[*B, F]`` features (current offset)."""
        zs = z + self.offset.reshape(self.num_layers, *([1] * (z.dim() - 2)), self.num_experts)  # [L, *B, E]
        top = torch.topk(zs, self.top_k + 1, dim=-1).values  # [L, *B, k+1]
        margin = (top[..., self.top_k - 1] - top[..., self.top_k]).clamp(max=OFFSET_CLAMP)  # [L, *B]
        flip = (topk_sets(zs, self.top_k) != topk_sets(z, self.top_k)).any(-1).float()  # [L, *B]
        return torch.cat([torch.movedim(margin, 0, -1), torch.movedim(flip, 0, -1), per_tok], -1)  # [*B, F]

    def features(self, tf: TeacherForced) -> torch.Tensor:
        """``[N, T, F]`` features from a training-model pass (``capture`` with ``lm_logits=True``)."""
        return self._features_from(*self._raw(tf))

    @torch.no_grad()
    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self._standardise(x)).squeeze(-1).clamp(-OFFSET_CLAMP, OFFSET_CLAMP)

    def _standardise(self, x: torch.Tensor) -> torch.Tensor:
        """Standardised features, clamped to +-FEATURE_CLAMP so an unseen value (e.g. a flip flag that was
        constant in calibration) cannot make the MLP extrapolate without bound."""
        return ((x - self.feat_mean) / self.feat_std).clamp(-FEATURE_CLAMP, FEATURE_CLAMP)

    def calibrate(self, policy: nn.Module, engine, rollouts: Rollouts | list[Rollouts]) -> dict[str, float]:
        """Fit the offset table and the MLP on rollouts sampled **from the engine**; returns (and keeps in
        ``last_metrics``) the metrics mode on the held-out rows (the last ``heldout_frac`` of each batch).

        The true ``delta`` is the policy's teacher-forced ``logp_train`` minus the rollouts' ``logp_infer``;
        router logits come from teacher-forced passes of both models. Neither model is changed.
        """
        batches = [rollouts] if isinstance(rollouts, Rollouts) else list(rollouts)
        if not batches:
            raise ValueError("calibrate: no calibration rollouts")
        with _in_eval(policy):
            tfs = [capture(policy, ro, lm_logits=True) for ro in batches]
            infer = [capture(engine_model(engine), ro, lm_logits=False).router for ro in batches]  # [L, N, T, E]
        fit_rows, held_rows = [], []
        for ro in batches:
            n = ro.num_rollouts
            n_held = int(round(self.heldout_frac * n)) if n > 1 else 0
            fit_rows.append(torch.arange(n, device=ro.response_mask.device) < n - n_held)  # [N] bool
            held_rows.append(torch.arange(n, device=ro.response_mask.device) >= n - n_held)
        new: list[_Chunk] = []
        held: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (router [L, n, E], per_tok, delta)
        for tf, zi, ro, rf, rh in zip(tfs, infer, batches, fit_rows, held_rows, strict=True):
            z, per = self._raw(tf)  # [L, N, T, E], [N, T, 4]
            delta = tf.logp - ro.logp_infer  # [N, T]
            diff = (zi - tf.router).nan_to_num(nan=0.0).clamp(-OFFSET_CLAMP, OFFSET_CLAMP)  # [L, N, T, E]
            sf, sh = ro.response_mask & rf[:, None], ro.response_mask & rh[:, None]  # [N, T]
            new.append(_Chunk(router=z[:, sf], per_tok=per[sf], delta=delta[sf], diff=diff[:, sf]))
            held.append((z[:, sh], per[sh], delta[sh]))
        if sum(c.n for c in new) == 0:
            raise ValueError("calibrate: no valid response token in the calibration rows")
        if self.buffer_tokens == 0:
            self.buffer = []
        self._add(new)
        # offset table: every buffered calibration token with the engine's router logits
        self.offset = torch.cat([c.diff for c in self.buffer if c.diff is not None], 1).mean(1)  # [L, E]
        self.usage_fit = expert_usage(torch.cat([c.router for c in new], 1), None, self.top_k)  # [L, E]
        self.fit_tokens = [(ro, ro.response_mask & rf[:, None]) for ro, rf in zip(batches, fit_rows, strict=True)]
        # the MLP on delta, every buffered token, features at the new offset
        x_fit, y_fit = self._buffer_xy()  # [n, F], [n]
        self.feat_mean = x_fit.mean(0)
        std = x_fit.std(0, correction=0)
        self.feat_std = torch.where(std < 1e-3, torch.ones_like(std), std)  # constant features: centred only
        self._fit(x_fit, y_fit)
        self.calibrated = True
        self.calibrations += 1
        x_h = torch.cat([self._features_from(z, per) for z, per, _ in held])  # [n_h, F]
        y_h = torch.cat([d for _, _, d in held])  # [n_h]
        if y_h.numel() >= 2:
            pred = self._mlp(x_h)
            m = compare(pred, y_h, torch.ones_like(y_h, dtype=torch.bool), self.r2_min, self.auroc_min)
        else:  # no held-out slice: judge on the fit data (optimistic; documented)
            m = compare(self._mlp(x_fit), y_fit, torch.ones_like(y_fit, dtype=torch.bool), self.r2_min,
                        self.auroc_min)
        m["offset_abs_max"] = float(self.offset.abs().max())
        m["fit_tokens"] = float(y_fit.numel())
        m["heldout_tokens"] = float(y_h.numel())
        self.last_metrics = m
        return m

    def _add(self, chunks: list[_Chunk]) -> None:
        """Append to the buffer, then drop the oldest tokens beyond ``buffer_tokens`` (0: no bound)."""
        self.buffer.extend(c for c in chunks if c.n)
        if self.buffer_tokens == 0:
            return
        while len(self.buffer) > 1 and sum(c.n for c in self.buffer) - self.buffer[0].n >= self.buffer_tokens:
            self.buffer.pop(0)
        extra = sum(c.n for c in self.buffer) - self.buffer_tokens
        if extra > 0:  # the oldest remaining chunk keeps its newest tokens
            c = self.buffer[0]
            self.buffer[0] = _Chunk(router=c.router[:, extra:], per_tok=c.per_tok[extra:], delta=c.delta[extra:],
                                    diff=None if c.diff is None else c.diff[:, extra:])

    @property
    def buffered_tokens(self) -> int:
        return sum(c.n for c in self.buffer)

    def _buffer_xy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[n, F]`` (at the current offset) and targets ``[n]`` of every buffered token."""
        x = torch.cat([self._features_from(c.router, c.per_tok) for c in self.buffer])
        return x, torch.cat([c.delta for c in self.buffer])

    @torch.no_grad()
    def observe(self, tf: TeacherForced, ro: Rollouts) -> int:
        """Add a trained-on batch's valid tokens (its theta_old pass ``tf`` and true ``delta``) to the buffer;
        no engine router logits, so they inform the MLP, not the offset table. A no-op (0) without a buffer
        (``buffer_tokens == 0``); returns the tokens added."""
        if self.buffer_tokens == 0:
            return 0
        z, per = self._raw(tf)  # [L, N, T, E], [N, T, 4]
        sel = ro.response_mask.bool()  # [N, T]
        c = _Chunk(router=z[:, sel], per_tok=per[sel], delta=(tf.logp - ro.logp_infer)[sel], diff=None)
        self._add([c])
        return c.n

    @torch.no_grad()
    def refit_last(self) -> dict[str, float]:
        """Incremental recalibration: refit the MLP's last layer ``(w, b)`` by ridge regression on the buffer's
        hidden activations (first layer, standardisation and offset fixed). Returns the buffer's mean squared
        error before and after (``mse_before``, ``mse_after``) and the tokens used."""
        if not self.calibrated or not self.buffer:
            raise RuntimeError("InferenceSimulator.refit_last before calibrate")
        x, y = self._buffer_xy()  # [n, F], [n]
        before = float(((self._mlp(x) - y) ** 2).mean())
        first, last = self.mlp[0], self.mlp[2]
        h = torch.relu(first(self._standardise(x))).double()  # [n, h]
        a = torch.cat([h, torch.ones(h.shape[0], 1, dtype=h.dtype, device=h.device)], 1)  # [n, h+1]
        reg = self.ridge * h.shape[0] * torch.eye(a.shape[1], dtype=a.dtype, device=a.device)
        reg[-1, -1] = 0.0  # the bias is not shrunk
        theta = torch.linalg.solve(a.T @ a + reg, a.T @ y.double())  # [h+1]
        last.weight.copy_(theta[:-1].to(last.weight.dtype)[None])
        last.bias.copy_(theta[-1:].to(last.bias.dtype))
        self.refits += 1
        after = float(((self._mlp(x) - y) ** 2).mean())
        return {"mse_before": before, "mse_after": after, "tokens": float(y.numel())}

    @torch.no_grad()
    def route_shift(self, policy: nn.Module) -> float:
        """Mean over layers of the total-variation distance between ``policy``'s expert usage and the usage at
        the last full fit, both on that fit's calibration tokens (one teacher-forced pass; NaN before a fit).
        On the same tokens the measure is 0 until the policy's routing changes: no sampling noise."""
        if self.usage_fit is None or not self.fit_tokens:
            return math.nan
        with _in_eval(policy):
            z = torch.cat([capture(policy, ro, lm_logits=False).router[:, m] for ro, m in self.fit_tokens], 1)
        u = expert_usage(z, None, self.top_k)  # [L, E]
        return float(0.5 * (u - self.usage_fit.to(u.device)).abs().sum(-1).mean())

    @torch.no_grad()
    def evaluate(self, policy: nn.Module, ro: Rollouts) -> dict[str, float]:
        """The metrics mode on rollouts ``ro`` (e.g. of held-out prompts): ``compare`` of ``delta_hat`` with the
        true ``logp_train(theta_old) - logp_infer``."""
        with _in_eval(policy):
            tf = capture(policy, ro, lm_logits=True)
        pred = self.predict(policy, ro, captured=tf)  # [N, T]
        return compare(pred, tf.logp - ro.logp_infer, ro.response_mask, self.r2_min, self.auroc_min)

    def _fit(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.calibrations)
            mlp = nn.Sequential(nn.Linear(self.num_features, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 1))
        mlp = mlp.to(x.device)
        xn = self._standardise(x)
        opt = torch.optim.Adam(mlp.parameters(), lr=self.lr)
        huber = nn.HuberLoss(delta=1.0)
        with torch.enable_grad():
            for _ in range(self.fit_steps):
                opt.zero_grad(set_to_none=True)
                loss = huber(mlp(xn).squeeze(-1), y)
                loss.backward()
                opt.step()
        for p in mlp.parameters():
            p.grad = None
            p.requires_grad_(False)  # frozen between calibrations: nothing downstream can reach it
        self.mlp = mlp

    @torch.no_grad()
    def predict(self, policy: nn.Module, rollouts: Rollouts, captured: TeacherForced | None = None) -> torch.Tensor:
        """``delta_hat`` ``[N, T]`` (detached, 0 on padding) from the theta_old forward of ``policy``.

        Pass ``captured`` (a ``capture(policy, rollouts)`` of theta_old) to reuse a pass already made.
        """
        if not self.calibrated:
            raise RuntimeError("InferenceSimulator.predict before calibrate")
        if captured is None:
            with _in_eval(policy):
                captured = capture(policy, rollouts, lm_logits=True)
        pred = self._mlp(self.features(captured))  # [N, T]
        return torch.where(rollouts.response_mask, pred, torch.zeros_like(pred)).detach()

    def lb_loss(self, router_logits_train, mask: torch.Tensor | None) -> torch.Tensor:
        """``lb_loss_simulated`` with this simulator's offset table."""
        return lb_loss_simulated(router_logits_train, self.offset, mask, self.num_experts, self.top_k)
