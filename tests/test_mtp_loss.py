"""MTP training (mtp_loss_coef, train.mtp_loss) in-process: the head's loss by hand, the packing rule, and the policy
gradient left unchanged.

    .venv/bin/python -m pytest tests/test_mtp_loss.py -q
"""
import torch
import torch.nn.functional as F

import checkpoint
import lora
import train
from model import Transformer
from test_lora import init_adapters
from test_train import HYBRID


def model_and_rows():
    torch.manual_seed(0)
    m = Transformer(HYBRID)
    m.init_weights(0, std=0.2)
    rows = [torch.randint(0, HYBRID.vocab_size, (n,)).tolist() for n in (9, 6)]  # two segments of 9 and 6 tokens
    mb = train.collate([dict(token_ids=r, action_mask=[1] * len(r), behavior_logprobs=[0.0] * len(r),
                             token_versions=[0] * len(r), routed_experts=None) for r in rows], [1.0, -1.0])
    return m, rows, mb


def test_mtp_loss_by_hand():
    """Position t of a row: the MTP layer over [norm(embedding of token t+1), norm(trunk's final hidden at t)], then
    lm_head, scored on token t+2; the mean over every t with token t+2 in the row (7 + 4 positions), computed one
    row at a time without padding."""
    m, rows, mb = model_and_rows()
    hidden = m.hidden_states(mb["input_ids"])
    got = train.mtp_loss(m, hidden, mb, train.mtp_mask(mb).sum())
    nll, off = [], []
    for r in rows:
        ids = torch.tensor([r])
        h = m.hidden_states(ids)
        x = m.mtp.fc(torch.cat([m.mtp.pre_fc_norm_embedding(m.model.embed_tokens(ids[:, 1:])),
                                m.mtp.pre_fc_norm_hidden(h[:, :-1])], -1))
        cos, sin, _ = m.positions  # of this row's n tokens: the MTP runs at positions 0 .. n - 2
        x, _ = m.mtp.layers[0](x, cos[:-1], sin[:-1])
        logits = m.lm_head(m.mtp.norm(x))[0, :-1]  # position t predicts token t + 2
        nll.append(F.cross_entropy(logits, ids[0, 2:], reduction="none"))
        off.append(F.cross_entropy(logits, ids[0, 1:-1], reduction="none"))  # the control: t + 1
    assert [len(n) for n in nll] == [7, 4]
    assert torch.allclose(got, torch.cat(nll).mean(), atol=1e-5), (got, torch.cat(nll).mean())
    # control: the same mean over both rows with the target one token off (t + 1) is far from it
    assert (got - torch.cat(off).mean()).abs() > 1e-2  # 3.6e-2 measured where 1e-5 is allowed


def test_packed_rows_never_predict_across_a_segment_boundary():
    _, _, mb = model_and_rows()
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]])
    mask = train.mtp_mask(dict(mb, segment_ids=seg))
    assert mask[0].tolist() == [1, 1, 0, 1, 1, 1, 1]  # position 2 -> token 4 would cross from segment 0 into 1
    assert train.mtp_mask(mb)[0].tolist() == [1] * 7 and train.mtp_mask(mb)[1].tolist() == [1] * 4 + [0] * 3


def test_the_policy_gradient_is_unchanged_and_only_mtp_learns():
    """The gradient of a policy objective (sum of the trainer's logprobs) with and without the MTP loss: every
    parameter outside mtp.* has the same gradient bit for bit, mtp.* get one from the MTP loss alone. Control: the
    same loss with lm_head not detached changes lm_head's gradient, which the check sees."""
    m, _, mb = model_and_rows()
    cfg = dict(temperature=1.0, logprob_chunk_size=16, logprob_keep_logits=False)

    def grads(with_mtp, leak=False):
        m.zero_grad()
        logprobs, _, mtp = train.microbatch_logprobs(m, mb, cfg, mtp_tokens=train.mtp_mask(mb).sum())
        if leak:  # the MTP loss through a live lm_head
            h = m.mtp_hidden(m.hidden_states(mb["input_ids"]), mb["targets"])[:, :-1]
            mtp = -F.log_softmax(m.lm_head(h), -1).gather(-1, mb["targets"][:, 1:, None]).sum() / 11
        ((logprobs * mb["real"]).sum() + (0.5 * mtp if with_mtp else 0)).backward()
        return {n: p.grad.clone() if p.grad is not None else None for n, p in m.named_parameters()}
    base, joint, leak = grads(False), grads(True), grads(True, leak=True)
    trunk = [n for n in base if not n.startswith("mtp.")]
    assert all(torch.equal(base[n], joint[n]) for n in trunk)
    assert all(base[n] is None for n in base if n.startswith("mtp."))
    assert all(joint[n] is not None and joint[n].abs().sum() > 0 for n in joint if n.startswith("mtp."))
    assert not torch.equal(base["lm_head.weight"], leak["lm_head.weight"])  # the control: a leak is seen


def test_lora_leaves_everything_the_drafter_reads_unchanged():
    """Why a LoRA run syncs nothing to the engine's drafter: the drafter reads mtp.* and the trunk's embeddings and
    lm_head (its input hidden states the engine's target computes, adapters included), and lora.apply puts no adapter
    on any of them, on every target there is, and freezes them. After AdamW steps on a policy objective plus the MTP
    loss each is bit for bit what it was while the adapters moved (and plan.check_config refuses mtp_loss_coef under
    LoRA, which would train nothing). Control: full fine-tuning, the same steps, moves every one of them."""
    cfg = dict(temperature=1.0, logprob_chunk_size=16, logprob_keep_logits=False)
    reads = lambda n: n.startswith("mtp.") or n in ("model.embed_tokens.weight", "lm_head.weight")  # noqa: E731

    def stepped(lora_rank):
        m, _, mb = model_and_rows()
        lora.apply(m, dict(lora_rank=lora_rank, lora_alpha=16.0, param_dtype="float32",
                           lora_targets=",".join(lora.TARGETS + lora.GDN_TARGETS)))
        init_adapters(m, 0)
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(2):
            opt.zero_grad()
            logprobs, _, mtp = train.microbatch_logprobs(m, mb, cfg, mtp_tokens=train.mtp_mask(mb).sum())
            ((logprobs * mb["real"]).sum() + mtp).backward()
            opt.step()
        return {n: (before[n], p.detach()) for n, p in m.named_parameters()}
    adapted, full = stepped(8), stepped(0)
    drafter = [n for n in adapted if reads(n)]
    assert len(drafter) >= 10 and not [n for n in drafter if lora.is_adapter(n)], drafter
    assert [n for n in drafter if not torch.equal(*adapted[n])] == []
    assert any(lora.is_adapter(n) and not torch.equal(*adapted[n]) for n in adapted)
    assert [n for n in drafter if torch.equal(*full[n])] == []  # the control


def test_mtp_loss_coef_through_the_train_step(tmp_path):
    """train.train_step on the sharded model (one gloo rank), mtp_loss_coef 0.5 against 0: the step
    logs the MTP loss that train.mtp_loss gives on the plain model, the mtp.* weights move, and
    every other weight takes the same step bit for bit (no clipping: its norm would count the MTP
    gradients); with 0 (the control) no mtp_loss is logged and mtp.* stay as they were."""
    from test_train import trainer_config
    device = train.init_distributed()[2]  # a gloo group of one rank
    m, _, mb = model_and_rows()
    m.save_pretrained(str(tmp_path))
    with torch.no_grad():
        by_hand = train.mtp_loss(m, m.hidden_states(mb["input_ids"]), mb, train.mtp_mask(mb).sum())
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    after, logged = {}, {}
    for coef in (0.0, 0.5):
        cfg = trainer_config(mtp_loss_coef=coef, grad_clip=1e9)
        model = train.build_model(cfg, train.build_meshes(1, 1, device.type), device,
                                  weights_path=str(tmp_path))
        metrics = train.train_step(model, train.build_optimizer(model, cfg), [dict(mb)], cfg,
                                   train.loss_config(cfg), policy_version=0)
        logged[coef] = metrics.get("mtp_loss")
        after[coef] = dict(checkpoint.full_parameters(model))
    assert logged[0.0] is None and abs(logged[0.5] - by_hand.item()) < 1e-5, (logged, by_hand)
    head = [n for n in before if n.startswith("mtp.")]
    assert head and all(torch.equal(after[0.0][n], before[n]) for n in head)
    assert all(not torch.equal(after[0.5][n], before[n]) for n in head)
    assert all(torch.equal(after[0.5][n], after[0.0][n]) for n in before if n not in head)
    assert not all(torch.equal(after[0.0][n], before[n]) for n in before if n not in head)
