"""Unit tests: fabricated checkpoints of every supported family (load, describe, router capture, what the
routing code assumes of each router), the refused families, and the checkpoint tokenizer's edge cases."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from distmoe.data.formats import Example
from distmoe.data.template import IGNORE_INDEX, chat_ids, encode_example, fold_system
from distmoe.model.build import (
    FAMILIES,
    REFUSED_FAMILIES,
    SUPPORTED_FAMILIES,
    ModelError,
    build_model,
    describe,
    load_checkpoint,
    router_modules,
    topk_weighting,
)
from distmoe.model.fabricate import EOS, PAD, build_bpe_tokenizer, corpus, write_checkpoint
from distmoe.model.router import RouterRecorder, forward_with_router, topk_experts
from distmoe.model.router_rule import CORRECTION_BIAS, routing_of
from distmoe.rl.replay import replay_weights
from distmoe.routing.losses import anchor_kl, aux_load_balance_loss

ROOT = Path(__file__).resolve().parents[2]
MOE_LAYERS = {"deepseek_v2": (1,), "deepseek_v3": (1,)}  # the first layer dense (first_k_dense_replace = 1)
EXPERTS = {"deepseek_v3": 8, "glm4_moe": 8}  # fabricated: 4 experts, 8 for the grouped sigmoid routers
SIGMOID = ("deepseek_v3", "glm4_moe")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ckpt")
    return {f: write_checkpoint(f, base / f, seed=3) for f in SUPPORTED_FAMILIES}


def _ids(tok, texts):
    rows = [tok.encode(t) for t in texts]
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), tok.pad_token_id, dtype=torch.long)  # [B, S]
    mask = torch.zeros_like(ids)  # [B, S]
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def _example(messages):
    return Example(messages=tuple((m["role"], m["content"]) for m in messages))


# ------------------------------------------------------------------------------------------ families
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_fabricated_checkpoint_loads_describes_and_routes(family, checkpoints, cfg):
    path = checkpoints[family]
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
    assert (path / "chat_template.jinja").exists()
    model, tok = build_model(cfg.model, str(path))
    spec = describe(model)
    assert spec.family == family == json.loads((path / "config.json").read_text())["model_type"]
    assert spec.moe_layers == MOE_LAYERS.get(family, (0, 1))
    e = EXPERTS.get(family, 4)
    assert (spec.num_experts, spec.top_k, spec.vocab_size) == (e, 2, len(tok))
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())

    ids, mask = _ids(tok, ["Compute\n3+4", "Reverse\nabc"])
    n = ids.numel()
    with torch.no_grad(), RouterRecorder(model) as rec:
        out = forward_with_router(model, ids, mask)
    assert out.logits.shape == (*ids.shape, len(tok))
    assert [tuple(z.shape) for z in out.router_logits] == [(n, e)] * spec.num_moe_layers
    for li, z in enumerate(out.router_logits):  # captured: the routing logits, softmax of which is the distribution
        raw = rec.calls[li][0]
        torch.testing.assert_close(torch.nn.functional.logsigmoid(raw) if family in SIGMOID else raw, z)
        want = torch.sigmoid(raw) / torch.sigmoid(raw).sum(-1, keepdim=True) if family in SIGMOID else raw.softmax(-1)
        torch.testing.assert_close(z.softmax(-1), want)

    # what distmoe's routing code assumes of every supported router: the chosen experts are the top-k of
    # softmax(z) over the E experts (a sigmoid router: its group-limited top-k of sigmoid(z) plus its correction
    # bias), and the weights are softmax(z)[I] (sigmoid(z)[I]), renormalised and scaled as the family's RouterRule
    # says (routing replay and prune-k re-derive them so)
    norm, scale = topk_weighting(model)
    rule = routing_of(model)
    hidden = torch.randn(n, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    for _, router in router_modules(model):
        with torch.no_grad():
            z, w, idx = router(hidden)
        if family in SIGMOID:
            bias = getattr(router, CORRECTION_BIAS)
            assert bias.abs().sum() > 0  # fabricated non-zero: it changes choices
            assert torch.equal(idx.sort(-1).values, rule.choose(z, bias).sort(-1).values)
            assert not torch.equal(idx.sort(-1).values, rule.choose(z).sort(-1).values)  # without it: another choice
            assert not torch.equal(idx.sort(-1).values, topk_experts(z, spec.top_k).sort(-1).values)
            torch.testing.assert_close(w, rule.weights(z, idx), rtol=0, atol=0)  # bit for bit
        else:
            assert torch.equal(idx.sort(-1).values, topk_experts(z, spec.top_k).sort(-1).values)
            torch.testing.assert_close(w.float(), replay_weights(z, idx, norm, scale).float())
            torch.testing.assert_close(w.float(), rule.weights(z, idx).float())

    # the routing losses are finite and differentiable through the routers
    anchor = torch.full((spec.num_moe_layers, e), 1.0 / e)  # [L, E]
    kl = anchor_kl(out.router_logits, mask, anchor, "batch")
    aux = aux_load_balance_loss(out.router_logits, e, 2, mask)
    assert torch.isfinite(kl) and kl >= 0 and torch.isfinite(aux)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "qwen2_moe", "deepseek_v3", "glm4_moe"])
def test_prune_engine_weighs_the_remaining_top_k_as_the_family_does(family, checkpoints):
    from distmoe.rl.engines import InferenceEngine

    model, _ = load_checkpoint(checkpoints[family])
    spec = describe(model)
    usage = torch.arange(spec.num_experts, dtype=torch.float).repeat(spec.num_moe_layers, 1)  # [L, E]: drop 0
    engine = InferenceEngine(model, "prune-1", usage=usage)
    norm, _ = topk_weighting(model)
    hidden = torch.randn(16, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    for _, router in router_modules(engine.model):
        with torch.no_grad():
            _z, w, idx = router(hidden)
        assert not (idx == 0).any()  # the least-used expert is never chosen
        if family in SIGMOID:  # exactly the family's own router with expert 0's correction bias at -inf
            own = copy.deepcopy(router)
            own._forward_hooks.clear()
            with torch.no_grad():
                getattr(own, CORRECTION_BIAS)[0] = float("-inf")
                _, w_own, idx_own = own(hidden)
            assert torch.equal(idx.sort(-1).values, idx_own.sort(-1).values)
            order, order_own = idx.argsort(-1), idx_own.argsort(-1)
            torch.testing.assert_close(w.gather(-1, order), w_own.gather(-1, order_own), rtol=0, atol=0)
            torch.testing.assert_close(w.float().sum(-1), torch.full((16,), 2.5))  # renormalised, times 2.5
        elif norm:  # a renormalising family (Mixtral, GPT-OSS) still renormalises after pruning
            torch.testing.assert_close(w.float().sum(-1), torch.ones(16))
        else:
            assert (w.float().sum(-1) < 1).all()


def test_router_rules_say_how_each_family_weighs_its_top_k(checkpoints):
    assert set(FAMILIES) == set(SUPPORTED_FAMILIES)
    got = {f: topk_weighting(load_checkpoint(p)[0]) for f, p in checkpoints.items()}
    # fabricated: qwen3_moe renormalises (norm_topk_prob), qwen2_moe/olmoe do not; mixtral and gpt_oss always do
    assert got == {"qwen3_moe": (True, 1.0), "qwen2_moe": (False, 1.0), "mixtral": (True, 1.0),
                   "olmoe": (False, 1.0), "flex_olmo": (False, 1.0), "gpt_oss": (True, 1.0),
                   "deepseek_v2": (False, 1.0), "deepseek_v3": (True, 2.5), "glm4_moe": (True, 2.5)}


def test_fabrication_is_deterministic(tmp_path):
    a = write_checkpoint("mixtral", tmp_path / "a", seed=1)
    b = write_checkpoint("mixtral", tmp_path / "b", seed=1)
    c = write_checkpoint("mixtral", tmp_path / "c", seed=2)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_shape_overrides_config_fields(tmp_path):
    path = write_checkpoint("qwen3_moe", tmp_path / "q", shape={"num_experts": 8, "num_hidden_layers": 3})
    spec = describe(load_checkpoint(path)[0])
    assert spec.num_experts == 8 and spec.moe_layers == (0, 1, 2)


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("family", ["deepseek_v32", "dots1", "phimoe", "dbrx", "ernie4_5_moe"])
def test_refused_family_names_itself_and_why(family, tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model(family).save_pretrained(tmp_path)  # config.json only: refused before any weight is read
    with pytest.raises(ModelError) as err:
        load_checkpoint(tmp_path)
    msg = str(err.value)
    assert repr(family) in msg and REFUSED_FAMILIES[family] in msg and str(tmp_path) in msg
    with pytest.raises(ModelError, match="refused"):
        write_checkpoint(family, tmp_path / "x")


def test_refusal_reasons_for_other_sigmoid_routers():
    for family in ("deepseek_v32", "glm4_moe_lite", "dots1", "minimax_m2", "lfm2_moe", "llama4"):
        assert "sigmoid" in REFUSED_FAMILIES[family] and "not" in REFUSED_FAMILIES[family]
    assert {"deepseek_v3", "glm4_moe"} <= set(SUPPORTED_FAMILIES)
    assert not set(REFUSED_FAMILIES) & set(SUPPORTED_FAMILIES)


def test_unknown_architecture_is_refused_with_the_supported_list(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"'llama' is not a supported MoE family .*qwen3_moe.*deepseek_v2"):
        load_checkpoint(tmp_path)


def test_deepseek_v2_group_limited_routing_is_refused(tmp_path):
    path = write_checkpoint("deepseek_v2", tmp_path / "d", shape={"topk_method": "group_limited_greedy",
                                                                  "n_group": 2, "topk_group": 1})
    with pytest.raises(ModelError, match="topk_method = 'greedy'.*'group_limited_greedy'"):
        load_checkpoint(path)


def test_docs_table_matches_the_code():
    page = (ROOT / "docs" / "checkpoints.md").read_text()
    supported = re.findall(r"^\| `(\w+)` \| supported", page, re.M)
    refused = dict(re.findall(r"^\| `(\w+)` \| refused \| (.+?) \|$", page, re.M))
    assert tuple(supported) == SUPPORTED_FAMILIES
    assert refused == REFUSED_FAMILIES


# ------------------------------------------------------------------------------------------ tokenizer
def test_bpe_tokenizer_is_real_byte_level_and_covers_the_synthetic_tasks():
    tok = build_bpe_tokenizer()
    assert tok.is_fast and len(tok) == 512 and tok.eos_token == EOS and tok.pad_token == PAD
    for text in corpus()[:50] + ["Uppercase\nxyz", "k59 code?", "é → ü"]:  # bytes outside the corpus too
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert tok.unk_token_id not in ids
    assert len(tok.encode("Calculate", add_special_tokens=False)) == 1  # merges were learned
    assert build_bpe_tokenizer().get_vocab() == tok.get_vocab()


def test_corpus_has_the_words_of_every_synthetic_task():
    from distmoe.data import synth

    text = "\n".join(corpus())
    words = [*synth.ARITH_PHRASINGS, *(name for name, _ in synth.STRING_OPS), synth.SYSTEM_PROMPT,
             *(ph.split("{k}")[0].strip() or ph.split("{k}")[1].strip() for ph in synth.LOOKUP_PHRASINGS)]
    assert all(w in text for w in words), [w for w in words if w not in text]
    tok = build_bpe_tokenizer()
    for task in synth.TASK_FAMILIES:  # every example is a few tokens, not one per byte
        for obj in synth.generate(task, 0, 20, 0):
            text = json.dumps(obj)
            assert len(tok.encode(text, add_special_tokens=False)) < len(text)


def test_chatml_prompt_masking_with_the_bpe_tokenizer():
    tok = build_bpe_tokenizer()
    ex = Example(messages=(("system", "Answer with the result only."), ("user", "Compute\n3+4"), ("assistant", "7")))
    ids, labels = encode_example(tok, ex, 64)
    sup = [i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX]
    assert tok.decode(sup) == "7" + EOS  # the answer and the end token; the template's trailing newline is not
    assert tok.decode(ids).startswith("<|im_start|>system\nAnswer")


def test_missing_pad_token_pads_with_eos(tmp_path):
    path = write_checkpoint("olmoe", tmp_path / "p", pad_token=False)
    assert "pad_token" not in json.loads((path / "tokenizer_config.json").read_text()) or \
        json.loads((path / "tokenizer_config.json").read_text())["pad_token"] is None
    _, tok = load_checkpoint(path)
    assert tok.pad_token == EOS and tok.pad_token_id == tok.eos_token_id


def test_missing_chat_template_is_a_clear_error_and_the_named_file_fixes_it(tmp_path):
    path = write_checkpoint("qwen2_moe", tmp_path / "t", chat_template=None)
    assert not (path / "chat_template.jinja").exists()
    with pytest.raises(ModelError, match=r"no chat template.*chat_template\.jinja") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)
    from distmoe.model.fabricate import CHATML_TEMPLATE

    (path / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    _, tok = load_checkpoint(path)
    assert chat_ids(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True)


def test_template_rejecting_the_system_role_gets_it_folded_into_the_first_user_turn(tmp_path):
    path = write_checkpoint("mixtral", tmp_path / "s", system_role=False)
    _, tok = load_checkpoint(path)
    system = {"role": "system", "content": "Answer with the result only."}
    user, answer = {"role": "user", "content": "Sort\ncab"}, {"role": "assistant", "content": "abc"}
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="System role not supported"):  # the template itself refuses
        tok.apply_chat_template([system, user], tokenize=False)
    folded = [{"role": "user", "content": "Answer with the result only.\n\nSort\ncab"}, answer]
    assert fold_system([system, user, answer]) == folded
    ids, labels = encode_example(tok, _example([system, user, answer]), 64)
    want, want_labels = encode_example(tok, _example(folded), 64)
    assert (ids, labels) == (want, want_labels)
    assert chat_ids(tok, [user], add_generation_prompt=True) == chat_ids(tok, [user], True)  # no system: as is


def test_fold_system_without_a_user_turn():
    assert fold_system([{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]) == \
        [{"role": "user", "content": "S"}, {"role": "assistant", "content": "A"}]
    assert fold_system([{"role": "user", "content": "U"}]) == [{"role": "user", "content": "U"}]
