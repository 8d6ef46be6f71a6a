"""How much of a run's reported load CV is the probe's sampling noise (the load-balance target of the default run).

The run's load CV is the top-1 expert-load CV on the public routing probe (``routing.probe-prompts`` prompts,
``distmoe.routing.metrics.load_cv``: the mean over MoE layers of std/mean of the ``[E]`` top-1 counts). On the
default 16 prompts a layer routes about 210 tokens, ~27 per expert of 8, so even a router that sends every token to
an independent uniformly random expert reads a CV of about ``sqrt((E - 1) / N)`` = 0.18, and a real router, whose
choice is a function of the token (the chat template's tokens appear in every prompt), reads more. This script
loads a finished run's kept checkpoints and measures, for the final model (and the model kept before the last
task):

- the run's own probe (reproduces the run's last ``load_cv``: a check that the model and bias are loaded as the run
  used them);
- ``--draws`` further probe sets of the same size, drawn with other seeds (``run.seed + 1000 + j``): the spread of
  the reported figure for one fixed model;
- one large probe of ``--large`` prompts (at most 256): the load CV with the sampling noise mostly gone;
- the same with the chat template's tokens left out (the longest common prefix and suffix of the prompts' ids:
  identical in every prompt, hence routed as one block of identical choices): how much of the CV is the template's;
- the floor of each size: the mean CV of i.i.d. uniform expert choices for the same token counts (Monte Carlo,
  2,000 draws), the least any router can read on that many tokens.

    python bench/probe_size.py runs/probe-size/default-warm-public-bias-s0 runs/probe-size/default-aux-layer-s0

Needs run directories whose checkpoints were kept (``bench/continual_anchor.py`` without ``--prune``). Prints
one JSON line per run and model, and with ``--out`` writes them to a JSONL file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def floor_cv(tokens: int, experts: int, layers: int, rng: np.random.Generator, draws: int = 2000) -> float:
    """Mean over ``draws`` of the load CV (mean over ``layers``) of ``tokens`` i.i.d. uniform choices of ``experts``."""
    c = rng.multinomial(tokens, [1.0 / experts] * experts, size=(draws, layers)).astype(np.float64)  # [D, L, E]
    return float((c.std(-1) / c.mean(-1)).mean())


def cv_of(top1: np.ndarray, experts: int) -> float:
    """``[L, N]`` first choices -> the run's load CV (``routing.metrics.load_cv``)."""
    c = np.stack([np.bincount(t, minlength=experts) for t in top1]).astype(np.float64)  # [L, E]
    return float((c.std(-1) / np.maximum(c.mean(-1), 1e-8)).mean())


def template_mask(tok, prompts: tuple[str, ...], max_len: int) -> np.ndarray:
    """``[N]`` True where a probe token is part of the chat template every prompt shares: the longest common
    prefix and suffix of the prompts' token ids (same order as ``probe_routing``'s ``T``)."""
    from distmoe.data.template import chat_ids

    ids = [chat_ids(tok, [{"role": "user", "content": p}], add_generation_prompt=True)[-max_len:] for p in prompts]
    pre = 0
    while all(len(x) > pre for x in ids) and len({x[pre] for x in ids}) == 1:
        pre += 1
    suf = 0
    while all(len(x) > pre + suf for x in ids) and len({x[-1 - suf] for x in ids}) == 1:
        suf += 1
    return np.concatenate([np.r_[np.ones(pre, bool), np.zeros(len(x) - pre - suf, bool), np.ones(suf, bool)]
                           for x in ids])


def measure(run_dir: Path, draws: int, large: int) -> list[dict]:
    import run_checkpoints as rc

    from distmoe.coordinator.phases.probe import prompts_for
    from distmoe.routing.probe import default_probe_prompts, probe_routing

    cfg = rc.run_config(run_dir)
    probes = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if line and json.loads(line).get("event") == "probe"]
    ckpts = {r: (man.get("kept", ""), d) for r, (man, d) in rc.kept(run_dir).items()}
    if not ckpts or not (ckpts[max(ckpts)][1] / "model").is_dir():
        sys.exit(f"{run_dir}: no kept final checkpoint (run without --prune)")
    before = [(r, d) for r, (kept, d) in sorted(ckpts.items()) if kept.startswith("before task")]
    models = {"final": (max(ckpts), ckpts[max(ckpts)][1])}
    if before:
        models["before last task"] = before[-1]
    n = cfg.routing.probe_prompts
    sets = {"run probe": prompts_for(cfg)}
    sets.update({f"draw {j}": default_probe_prompts(cfg.run.seed + 1000 + j, n) for j in range(draws)})
    sets["large"] = default_probe_prompts(cfg.run.seed + 2000, large)
    rng = np.random.default_rng(0)
    out = []
    for name, (rnd, d) in models.items():
        model, tok = rc.model_at(cfg, d)
        experts = None
        res = {"run": run_dir.name, "model": name, "round": rnd}
        for sname, prompts in sets.items():
            r, top1 = probe_routing(model, tok, prompts, cfg.model.max_seq_len, cfg.eval.batch_size)
            experts = r.shape[1]
            res[f"cv {sname}"] = round(cv_of(top1, experts), 4)
            res[f"tokens {sname}"] = int(top1.shape[1])
            if sname in ("run probe", "large"):
                tmpl = template_mask(tok, prompts, cfg.model.max_seq_len)  # [N]
                res[f"template share {sname}"] = round(float(tmpl.mean()), 4)
                res[f"cv content only {sname}"] = round(cv_of(top1[:, ~tmpl], experts), 4)
        for sname in ("run probe", "large"):
            res[f"floor {sname}"] = round(floor_cv(res[f"tokens {sname}"], experts, top1.shape[0], rng), 4)
        draw_cvs = [res[f"cv draw {j}"] for j in range(draws)]
        if draw_cvs:
            res["cv draws mean"] = round(float(np.mean(draw_cvs)), 4)
            res["cv draws std"] = round(float(np.std(draw_cvs, ddof=1)), 4) if len(draw_cvs) > 1 else None
        if name == "final" and probes:
            res["run's last probe load_cv"] = round(float(probes[-1]["load_cv"]), 4)
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories with kept checkpoints")
    ap.add_argument("--draws", type=int, default=8, help="further probe sets of the run's probe size")
    ap.add_argument("--large", type=int, default=256, help="prompts in the large probe (at most 256)")
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    args = ap.parse_args()
    lines = []
    for run in args.runs:
        for res in measure(run, args.draws, args.large):
            print(json.dumps(res), flush=True)
            lines.append(json.dumps(res))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
