"""labs.cpu_matmul: bf16 products through fp32 on a CPU without bf16 arithmetic give bf16's product, faster."""
import torch

from labs import cpu_matmul


def _reference(a, b):
    """What a bf16 GEMM computes: exact fp32 products, summed in fp32, rounded once to bf16 (fp64 sums here)."""
    return (a.double() @ b.double()).to(torch.bfloat16)


def test_products_in_the_mode_are_bf16_rounded_fp32_products():
    torch.manual_seed(0)
    a, b = torch.randn(32, 300).bfloat16(), torch.randn(300, 48).bfloat16()
    with cpu_matmul.Bf16MatmulsInFp32():
        got = a @ b
        linear = torch.nn.functional.linear(a, b.t().contiguous(), torch.zeros(48, dtype=torch.bfloat16))
        batched = torch.bmm(a[None], b[None])[0]
    assert got.dtype == linear.dtype == batched.dtype == torch.bfloat16
    expected = _reference(a, b)
    one_ulp = expected.float().abs() * 2**-7
    for result in (got, linear, batched):
        assert ((result.float() - expected.float()).abs() <= one_ulp + 1e-6).all()


def test_the_mode_leaves_autograd_and_other_dtypes_alone():
    """Below autograd: the backward's products are caught too, the gradients are bf16 and match the bf16 reference,
    and an fp32 product is untouched (bit for bit)."""
    torch.manual_seed(1)
    x = torch.randn(16, 64).bfloat16().requires_grad_()
    w = torch.randn(151, 64).bfloat16().requires_grad_()
    with cpu_matmul.Bf16MatmulsInFp32():
        (x @ w.t()).float().square().sum().backward()
        f32 = torch.randn(8, 8)
        assert torch.equal(f32 @ f32, torch.mm(f32, f32))
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (x2 @ w2.t()).float().square().sum().backward()         # PyTorch's own bf16 path
    assert torch.allclose(x.grad.float(), x2.grad.float(), rtol=2**-6, atol=1e-2)
    assert torch.allclose(w.grad.float(), w2.grad.float(), rtol=2**-6, atol=1e-2)


def test_a_rank_enters_the_mode_only_on_a_cpu_without_native_bf16():
    native = cpu_matmul.native_bf16_matmul()
    assert isinstance(cpu_matmul.as_a_rank(torch.device("cpu")), cpu_matmul.Bf16MatmulsInFp32) is not native
    assert not isinstance(cpu_matmul.as_a_rank(torch.device("meta")), cpu_matmul.Bf16MatmulsInFp32)
    assert cpu_matmul.enter_if_needed(torch.device("meta")) is False
