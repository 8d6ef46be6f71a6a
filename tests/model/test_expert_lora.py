"""Unit tests: expert LoRA on the routed tokens only (``distmoe.model.expert_lora``) against peft's own
``target_parameters`` forward, on a fabricated checkpoint of every supported family."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distmoe.config import parse_run_config
from distmoe.model import expert_lora
from distmoe.model.build import SUPPORTED_FAMILIES, build_model
from distmoe.model.fabricate import write_checkpoint
from distmoe.model.trainable import apply_trainable


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("expert-lora")
    return {f: write_checkpoint(f, base / f, seed=4) for f in SUPPORTED_FAMILIES}


def _adapted(path, **over):
    cfg = parse_run_config({"model.path": str(path), "model.trainable": "lora", **over})
    model = apply_trainable(build_model(cfg.model)[0], cfg.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every adapter away from its no-op start (lora_B = 0 would hide a wrong B layout)
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), grads


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_routed_expert_lora_equals_peft_on_every_family(family, checkpoints):
    model = _adapted(checkpoints[family])
    stacks = expert_lora.expert_wrappers(model)
    assert stacks and all(type(w) is expert_lora.RoutedExpertsLoRA for w in stacks)  # the lora default path
    ids = torch.randint(5, 300, (3, 11), generator=torch.Generator().manual_seed(1))
    logits, grads = _step(model, ids)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)  # the frozen base: no gradient
    assert expert_lora.install(model, routed=False) == len(stacks)  # peft's own target_parameters forward
    ref_logits, ref_grads = _step(model, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=2e-6)
    assert grads.keys() == ref_grads.keys() and any(".experts." in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        assert ref_grads[name].abs().max() > 0, name  # every adapter, the experts' included, is trained


class _Shapes(TorchDispatchMode):
    """The shape of every tensor an operator allocates while active (views of its inputs are not counted)."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values())
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_no_expert_stack_sized_tensor_is_built_in_a_training_step(family, checkpoints):
    model = _adapted(checkpoints[family])
    stacks = {tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 3 and not p.requires_grad}
    assert stacks
    ids = torch.randint(5, 300, (2, 7), generator=torch.Generator().manual_seed(2))
    with _Shapes() as routed:
        _step(model, ids)
    assert not stacks & routed.shapes  # neither W + BA nor a gradient of W, for any expert stack
    expert_lora.install(model, routed=False)
    with _Shapes() as peft_path:
        _step(model, ids)
    assert stacks <= peft_path.shapes  # the detector sees peft's materialised W + BA


def test_routed_expert_lora_in_bfloat16_under_autocast(checkpoints):
    from distmoe.model.device import Runtime

    cfg = parse_run_config({"model.path": str(checkpoints["mixtral"]), "model.trainable": "lora"})
    rt = Runtime(device=torch.device("cpu"), dtype=torch.bfloat16)
    model = apply_trainable(build_model(cfg.model, rt=rt)[0], cfg.model)
    g = torch.Generator().manual_seed(1)  # not the global generator: the bf16 error depends on the draw
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float().normal_(0, 0.1, generator=g)
    ids = torch.randint(5, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, grads = _step(model, ids)
    expert_lora.install(model, routed=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, ref_grads = _step(model, ids)
    assert (logits.float() - ref.float()).abs().max() < 0.05 * ref.float().abs().max()
    name = next(n for n in grads if ".experts." in n and "lora_A" in n)
    assert grads[name].dtype == torch.float32 and torch.isfinite(grads[name]).all()
    cos = torch.nn.functional.cosine_similarity(grads[name].flatten(), ref_grads[name].flatten(), dim=0)
    assert cos > 0.98


def test_disabled_adapters_fall_back_to_the_base(checkpoints):
    model = _adapted(checkpoints["olmoe"])
    ids = torch.randint(5, 300, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
        base = build_model(parse_run_config({"model.path": str(checkpoints["olmoe"])}).model)[0]
        torch.testing.assert_close(plain, base(input_ids=ids).logits)
    assert (adapted - plain).abs().max() > 1e-3


def test_grouped_matmul_loop_equals_native():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, 6, generator=g, requires_grad=True)
    w = torch.randn(3, 6, 4, generator=g, requires_grad=True)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)  # expert 1 gets no rows
    native = expert_lora.grouped_matmul(x, w, offs)
    expert_lora._NO_GROUPED.add(("cpu", torch.float32))
    try:
        loop = expert_lora.grouped_matmul(x, w, offs)
    finally:
        expert_lora._NO_GROUPED.discard(("cpu", torch.float32))
    ref = torch.cat([x[:4] @ w[0], x[4:] @ w[2]])
    torch.testing.assert_close(native, ref)
    torch.testing.assert_close(loop, ref)


@pytest.mark.parametrize("loop", [False, True])
def test_routed_lora_function_gradients(loop):
    """The adapter node's hand-written backward (dx, dA, dB, and the base output's gradient passed through)
    against autograd through the plain per-group formula, over torch's grouped product and over the per-group
    loop, with an empty group."""
    g = torch.Generator().manual_seed(6)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)  # group 1 gets no rows
    shapes = [(7, 5), (7, 4), (3, 2, 4), (3, 2, 5)]  # base out [S, out], x [S, in], A [G, r, in], B^T [G, r, out]
    leaves = [torch.randn(*s, generator=g, requires_grad=True) for s in shapes]
    base, x, a, b_t = leaves
    weights = torch.randn(7, 5, generator=g)
    ref = base + 1.5 * torch.cat([x[:3] @ a[0].T @ b_t[0], x[3:] @ a[2].T @ b_t[2]])
    ref_grads = torch.autograd.grad((ref * weights).sum(), leaves)
    if loop:
        expert_lora._NO_GROUPED.add(("cpu", torch.float32))
    try:
        out = expert_lora._RoutedLoRA.apply(base * 1.0, x, a, b_t, offs, 1.5)  # * 1.0: the node adds in place
        grads = torch.autograd.grad((out * weights).sum(), leaves)
    finally:
        expert_lora._NO_GROUPED.discard(("cpu", torch.float32))
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert grads[2][1].abs().max() == 0 and grads[3][1].abs().max() == 0  # the empty group's factors: no gradient
