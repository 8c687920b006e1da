"""
Benchmarks. Each measures ours and a baseline side by side in the same run and prints, as its last line,
one JSON object with the figures and `ratio`.

    python bench.py logprobs     # chunked vs naive token logprobs: peak extra memory
    python bench.py capture      # agents through the capture server vs calling the engine directly
    python bench.py train        # our FSDP2+EP trainer vs transformers' Qwen3MoeForCausalLM under FSDP2 (GPU)
    python bench.py async        # streaming rollout pool vs synchronous generate-then-train
    python bench.py sync         # trainer -> engine weight broadcast vs raw NCCL broadcast (2 GPUs)
"""
import json
import sys

# -----------------------------------------------------------------------------
# each benchmark is one function bench_NAME() returning a dict with at least "ratio"

# -----------------------------------------------------------------------------
# logprobs: chunked token logprobs (loss.token_logprobs) vs the naive full-logits computation


def _int_options(args, **defaults):
    """--key=value overrides of integer defaults; an unknown key is an error."""
    out = dict(defaults)
    for arg in args:
        key, _, value = arg.lstrip("-").partition("=")
        if key not in out:
            sys.exit(f"unknown option {arg!r}; options: {', '.join('--%s=%s' % kv for kv in defaults.items())}")
        out[key] = int(value)
    return out


def _peak_extra_bytes(logprob_fn, T, V, D, chunk_size, with_entropy, fake):
    """Peak bytes alive at once during forward + backward of logprob_fn, beyond its inputs.

    How it is measured: a TorchDispatchMode sees every op's outputs while active; it adds the bytes of each new
    storage to a live counter and subtracts them when a weakref finalizer reports the storage freed, keeping the
    maximum. Everything the computation allocates is counted: intermediates, tensors autograd saves for backward,
    the outputs, and the gradients (hidden.grad, weight.grad: the same for both methods). CPU torch has no caching
    allocator, so live storage bytes are what the allocator holds. With fake=True the inputs are FakeTensorMode
    tensors (shapes, no data): the same ops run and are counted without allocating, so sizes that would not fit in
    this machine's RAM (naive at T=32768, V=151936 needs ~95 GB) are measured by the same code; the caller checks
    on a smaller size that fake and real give the same figure."""
    import contextlib
    import weakref

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.current, self.peak = {}, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()  # the same Python object for every view of one storage
                    if id(storage) not in self.live:
                        self.live[id(storage)] = storage.nbytes()
                        self.current += storage.nbytes()
                        self.peak = max(self.peak, self.current)
                        weakref.finalize(storage, self._free, id(storage))
            return out

        def _free(self, key):
            self.current -= self.live.pop(key)

    with FakeTensorMode() if fake else contextlib.nullcontext():
        gen = None if fake else torch.Generator().manual_seed(0)
        hidden = (torch.randn(T, D, generator=gen) / D ** 0.5).requires_grad_()  # (T, D)
        weight = torch.randn(V, D, generator=gen).requires_grad_()  # (V, D)
        targets = torch.randint(0, V, (T,), generator=gen)  # (T,)
        tracker = LiveBytes()
        with tracker:
            logprobs, entropy = logprob_fn(hidden, weight, targets, 1.0, chunk_size, with_entropy)
            objective = logprobs.sum() + (entropy.sum() if with_entropy else 0)
            objective.backward()
            result = None if fake else (logprobs.detach(), hidden.grad, weight.grad)
        del logprobs, entropy, objective
    return tracker.peak, result


def bench_logprobs(*args):
    """Peak extra memory of token logprobs + entropy, forward and backward, chunked vs naive, for a long sequence
    with Qwen3's vocabulary (measured on fake tensors), then a real-tensor check at check_T tokens: the same
    peaks as the fake measurement there, and chunked values and gradients equal to naive."""
    import torch
    from loss import naive_token_logprobs, token_logprobs
    opt = _int_options(args, T=32768, V=151936, D=64, chunk_size=1024, with_entropy=1, check_T=512)
    shape = (opt["V"], opt["D"], opt["chunk_size"], bool(opt["with_entropy"]))
    naive, _ = _peak_extra_bytes(naive_token_logprobs, opt["T"], *shape, fake=True)
    chunked, _ = _peak_extra_bytes(token_logprobs, opt["T"], *shape, fake=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    check_naive, want = _peak_extra_bytes(naive_token_logprobs, opt["check_T"], *shape, fake=False)
    check_chunked, got = _peak_extra_bytes(token_logprobs, opt["check_T"], *shape, fake=False)
    fake_check = (_peak_extra_bytes(naive_token_logprobs, opt["check_T"], *shape, fake=True)[0],
                  _peak_extra_bytes(token_logprobs, opt["check_T"], *shape, fake=True)[0])
    mb = 2 ** 20
    print(f"T={opt['T']} V={opt['V']} D={opt['D']}: naive {naive / mb:.0f} MB, chunked ({opt['chunk_size']} tokens) "
          f"{chunked / mb:.0f} MB extra at peak; full fp32 logits alone are {opt['T'] * opt['V'] * 4 / mb:.0f} MB")
    return dict(T=opt["T"], V=opt["V"], D=opt["D"], chunk_size=opt["chunk_size"], with_entropy=bool(opt["with_entropy"]),
                naive_peak_extra_mb=round(naive / mb, 1), chunked_peak_extra_mb=round(chunked / mb, 1),
                check_T=opt["check_T"], check_naive_mb=round(check_naive / mb, 1),
                check_chunked_mb=round(check_chunked / mb, 1),
                check_fake_equals_real=fake_check == (check_naive, check_chunked),
                check_max_abs_diff=max((a - b).abs().max().item() for a, b in zip(got, want)),
                ratio=round(chunked / naive, 4))


def main():
    names = sorted(k[len("bench_"):] for k in globals() if k.startswith("bench_"))
    if len(sys.argv) < 2 or sys.argv[1] not in names:
        sys.exit(f"usage: python bench.py NAME [--key=value ...], NAME one of: {', '.join(names)}")
    result = globals()["bench_" + sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
