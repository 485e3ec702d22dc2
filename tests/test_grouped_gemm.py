"""The grouped experts op against the per-expert loop it replaced: values and every gradient, in
float64, with experts that get no slots; and torch's custom-op checks (fake kernel, autograd
registration, compile-time tracing)."""

import pytest
import torch

from fived.model.grouped_gemm import expert_loop, grouped_swiglu


def _weights(n_experts, dim, hidden, gen):
    shapes = [(n_experts, dim, hidden), (n_experts, dim, hidden), (n_experts, hidden, dim)]
    return [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 7, 0], [4, 4, 4, 4]])
def test_matches_the_loop(counts):
    gen = torch.Generator().manual_seed(sum(counts))
    x = torch.randn(sum(counts), 8, generator=gen, dtype=torch.float64, requires_grad=True)
    ws = _weights(4, 8, 12, gen)
    got = grouped_swiglu(x, *ws, torch.tensor(counts))
    want = expert_loop(x, *ws, counts)
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, [x, *ws], grad), torch.autograd.grad(want, [x, *ws], grad)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_custom_op_checks():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(
        torch.ops.fived.grouped_swiglu.default, (x, *_weights(4, 8, 12, gen), torch.tensor([3, 0, 5, 2]))
    )
