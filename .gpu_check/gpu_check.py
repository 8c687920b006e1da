import sys, time, torch
sys.path.insert(0, ".")
print(torch.__version__, torch.cuda.is_available(), flush=True)
from model import experts_loop, experts_grouped_mm
torch.manual_seed(0)
E, D, H, r, N = 16, 2048, 768, 8, 16384
dev = "cuda"
counts = torch.distributions.Multinomial(N, torch.ones(E)).sample().long().to(dev)
x = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
scale = torch.rand(N, device=dev, dtype=torch.bfloat16)
W = [torch.randn(E, H, D, device=dev, dtype=torch.bfloat16) * 0.02, torch.randn(E, H, D, device=dev, dtype=torch.bfloat16) * 0.02,
     torch.randn(E, D, H, device=dev, dtype=torch.bfloat16) * 0.02]
A = [torch.randn(E, r, w.shape[2], device=dev, dtype=torch.bfloat16) * 0.02 for w in W]
B = [torch.randn(E, w.shape[1], r, device=dev, dtype=torch.bfloat16) * 0.02 for w in W]
lora = (2.0, tuple(zip(A, B)))
for t in W + A + B: t.requires_grad_(True)
ref = experts_loop(x.float(), counts, scale.float(), *[w.float() for w in W], (2.0, tuple((a.float(), b.float()) for a, b in zip(A, B))))
got = experts_grouped_mm(x, counts, scale, *W, lora)
print("max rel err grouped+lora vs fp32 loop", ((got.float() - ref).abs().max() / ref.abs().max()).item(), flush=True)
g = torch.randn_like(got)
gs = torch.autograd.grad(got, A + B, g)
gr = torch.autograd.grad(experts_loop(x.float(), counts, scale.float(), *[w.float() for w in W], (2.0, tuple((a.float(), b.float()) for a, b in zip(A, B)))), A + B, g.float())
print("grad rel err", max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(gs, gr)), flush=True)
def bench(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n
fwdbwd = lambda l: (lambda: experts_grouped_mm(x, counts, scale, *W, l).backward(g))
Wf = [w.detach().requires_grad_(False) for w in W]
full = bench(lambda: experts_grouped_mm(x, counts, scale, *W, None).backward(g))
lo = bench(lambda: experts_grouped_mm(x, counts, scale, *Wf, lora).backward(g))
print(f"grouped experts fwd+bwd, N={N} E={E} D={D} H={H}: full FT {full*1e3:.2f} ms, LoRA r={r} (base frozen) {lo*1e3:.2f} ms, ratio {lo/full:.3f}", flush=True)
