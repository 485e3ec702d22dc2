import copy
import dataclasses

import pytest
import torch

from fived.config import model_preset
from fived.model.init import init_weights
from fived.model.transformer import MoE, build_model
from fived.parallel.checkpointing import apply_activation_checkpointing

F64 = torch.float64


def _model(name="tiny", seed=0, **changes):
    cfg = dataclasses.replace(model_preset(name), **changes)
    model = build_model(cfg, device="cpu", dtype=torch.float64)
    init_weights(model, seed)
    return model


def test_forward_shapes_and_meta_build():
    model = _model()
    tokens = torch.randint(0, 256, (2, 16))
    assert model(tokens).shape == (2, 16, 256)
    meta = build_model(model_preset("llama3-405b"))
    assert all(p.device.type == "meta" for p in meta.parameters())


def test_init_depends_only_on_seed_and_name():
    a, b, c = _model(seed=3), _model(seed=3), _model(seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_init_ignores_wrappers():
    """Activation-checkpoint wrappers rename parameters; the canonical name (and values) stay."""
    plain = _model(seed=1)
    cfg = model_preset("tiny")
    wrapped = build_model(cfg, device="cpu", dtype=torch.float64)
    apply_activation_checkpointing(wrapped, "full")
    init_weights(wrapped, 1)
    for pa, pb in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 16))
    ref = _model("tiny-moe")
    ckpt = copy.deepcopy(ref)
    apply_activation_checkpointing(ckpt, mode)
    for m in (ref, ckpt):
        m(tokens).square().mean().backward()
    for pa, pb in zip(ref.parameters(), ckpt.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-12, atol=1e-14)


def _moe_by_hand(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token top-k mixture, the definition the vectorised dispatch must match."""
    probs = torch.softmax(moe.router(x), dim=-1)
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            w, e = probs[b, s].topk(moe.top_k)
            w = w / w.sum()
            for wk, ek in zip(w, e):
                ex = moe.experts
                h = torch.nn.functional.silu(x[b, s] @ ex.w1[ek]) * (x[b, s] @ ex.w3[ek])
                out[b, s] += wk * (h @ ex.w2[ek])
    return out + moe.shared(x)


def test_moe_dispatch_matches_definition():
    moe = _model("tiny-moe").layers["0"].feed_forward
    x = torch.randn(3, 8, 64, dtype=F64)
    torch.testing.assert_close(moe(x), _moe_by_hand(moe, x), rtol=1e-12, atol=1e-12)


def test_moe_aux_loss_is_per_sequence():
    """The batch's statistic is the sum of each sequence's own: it cannot depend on how the batch is split."""
    moe = _model("tiny-moe").layers["1"].feed_forward
    x = torch.randn(4, 8, 64, dtype=F64)
    moe(x)
    whole = moe.last_aux_loss
    parts = []
    for i in range(4):
        moe(x[i : i + 1])
        parts.append(moe.last_aux_loss)
    torch.testing.assert_close(whole, torch.stack(parts).sum(), rtol=1e-13, atol=0)


def test_aux_loss_gradient_reaches_router():
    moe = _model("tiny-moe").layers["1"].feed_forward
    x = torch.randn(2, 8, 64, dtype=F64)
    moe.aux_loss_scale = 0.0
    moe(x).sum().backward()
    g0 = moe.router.weight.grad.clone()
    moe.router.weight.grad = None
    moe.aux_loss_scale = 1.0
    moe(x).sum().backward()
    assert not torch.allclose(moe.router.weight.grad, g0)


def test_capacity_factor_drops_deterministically():
    moe = _model("tiny-moe").layers["0"].feed_forward
    x = torch.randn(2, 16, 64, dtype=F64)
    dropless = moe(x)
    moe.capacity_factor = 0.5
    dropped_a, dropped_b = moe(x), moe(x)
    assert torch.equal(dropped_a, dropped_b)
    assert not torch.allclose(dropped_a, dropless)
    moe.capacity_factor = 100.0  # capacity above any load: nothing is dropped
    torch.testing.assert_close(moe(x), dropless)


def test_tied_embeddings_share_one_tensor():
    model = _model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
