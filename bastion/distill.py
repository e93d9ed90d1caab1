"""The self-distillation objective of the drafter: batches of anchor blocks and their loss.

A batch holds r sequences of the target's own replies with A random anchors each: context = the
target's features of tokens < a, block = [x_a, MASK × (B−1)], labels = x_{a+1..a+B−1}
(:func:`make_batch`). :func:`train_step` runs the drafter over all blocks of a row at once (the
blocks packed with :func:`block_mask`) and returns the depth-weighted cross-entropy, optionally
mixed with the target's own distributions (``kd``) and weighted by the expected acceptance length
(``accept``). ``bastion.train`` drives it (``fit``) and holds the command line.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .drafter import DFlashDrafter
from .target import Target


class Batch(NamedTuple):
    """One training batch of r rows, A anchors each, blocks of B tokens, sequences padded to L."""

    feats: torch.Tensor | None  # [r, L, k·h] context features (None: computed live from ids)
    valid: torch.Tensor         # [r, L] bool: real tokens
    block_ids: torch.Tensor     # [r, A·B] anchor token then MASK × (B−1), per block
    block_pos: torch.Tensor     # [r, A·B] positions a..a+B−1
    labels: torch.Tensor        # [r, A·(B−1)] next tokens x_{a+1..a+B−1} (−100 = ignore)
    anchor_pos: torch.Tensor    # [r, A]
    ids: torch.Tensor           # [r, L] token ids (0 at padding)

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(None if t is None else t.to(device, non_blocking=True) for t in self))


def make_batch(records: list[dict], rows: int, anchors: int, block: int, mask_id: int, rng: random.Random) -> Batch:
    """Pick `rows` sequences and `anchors` anchors in each response; pad to the longest sequence.
    Records without "feats" give ``feats=None`` (features come from the target, ``live_features``).

    Two kinds of records carry text the target did not necessarily write itself, and keep a label at
    depth k of anchor a only while the text is still the continuation the drafter must predict:
    - "agree" [n] bool (replies written by another dtype's copy of the target, ``traindata``): labels
      are the text's tokens x_{a+k}, kept iff tokens a+1..a+k all agree with the target's greedy choice;
    - "greedy" [n] int (any text, ``traindata.make_text``: g_t = the target's greedy choice after
      tokens ≤ t): labels are g_{a+k−1}, kept iff tokens a+1..a+k−1 of the text equal the target's
      choices before them — the depth-1 label always, and one label past the text's first departure
      from the greedy path (what the target itself would have written there)."""
    picks = [records[rng.randrange(len(records))] for _ in range(rows)]
    L = max(len(r["ids"]) for r in picks)
    with_feats = all("feats" in r for r in picks)
    feats = torch.zeros(rows, L, picks[0]["feats"].shape[1]) if with_feats else None
    ids = torch.zeros(rows, L, dtype=torch.long)
    valid = torch.zeros(rows, L, dtype=torch.bool)
    # labels read at their own positions (x_t, or g_{t−1} for "greedy"); past the end of a sequence −100
    lab_src = torch.full((rows, L + block), -100, dtype=torch.long)
    anchor_pos = torch.zeros(rows, anchors, dtype=torch.long)
    # disagreements counted through each position (constant past the end), read at a label's position
    # ("agree") or the one before it ("greedy"): a label is lost where that count exceeds the anchor's
    checked = any("agree" in r or "greedy" in r for r in picks)
    lost_lab = torch.zeros(rows, L + block, dtype=torch.long) if checked else None
    lost_anc = torch.zeros(rows, L + block, dtype=torch.long) if checked else None
    for i, r in enumerate(picks):
        n = len(r["ids"])
        ids[i, :n] = r["ids"].long()
        valid[i, :n] = True
        if "greedy" in r:
            g = r["greedy"].long()
            lab_src[i, 1:n] = g[:n - 1]
            agree = torch.ones(n, dtype=torch.bool)
            agree[1:] = ids[i, 1:n] == g[:n - 1]
            cnt = torch.cumsum(~agree, 0)
            lost_anc[i, :n], lost_anc[i, n:] = cnt, cnt[-1]
            lost_lab[i, 1:n + 1], lost_lab[i, n + 1:] = cnt, cnt[-1]
        else:
            lab_src[i, :n] = ids[i, :n]
            if "agree" in r:
                cnt = torch.cumsum(~r["agree"], 0)
                lost_anc[i, :n], lost_anc[i, n:] = cnt, cnt[-1]
                lost_lab[i] = lost_anc[i]
        if feats is not None:
            feats[i, :n] = r["feats"].float()
        lo, hi = max(r["prompt_len"] - 1, 0), n - 2
        for j in range(anchors):
            anchor_pos[i, j] = rng.randint(lo, hi) if hi >= lo else lo
    offsets = torch.arange(block)
    block_pos = (anchor_pos[:, :, None] + offsets).reshape(rows, anchors * block)
    block_ids = torch.full((rows, anchors, block), mask_id, dtype=torch.long)
    block_ids[:, :, 0] = ids.gather(1, anchor_pos)
    at = (anchor_pos[:, :, None] + 1 + offsets[:block - 1]).reshape(rows, -1)
    labels = lab_src.gather(1, at)
    if checked:
        since = lost_lab.gather(1, at) - lost_anc.gather(1, anchor_pos).repeat_interleave(block - 1, dim=1)
        labels = labels.masked_fill(since > 0, -100)
    return Batch(feats, valid, block_ids.reshape(rows, anchors * block), block_pos, labels, anchor_pos, ids)


def reveal_prefixes(batch: Batch, share: float, rng: random.Random) -> Batch:
    """``batch`` with a revealed prefix in a ``share`` of its blocks: block [x_a, MASK × (B−1)] becomes
    [x_a, y_1..y_j, MASK × (B−1−j)] with y the block's labels (what the drafter must draft there), and
    those j labels are dropped. j ∈ [1, B−2] is drawn with P(j) ∝ 1/j: refinement passes reveal one,
    two, three drafted tokens most often. A block whose first j labels are not all kept (−100: past
    the reply's end, or past a departure from the target's own choices) stays as it was.

    Why: the first pass's marginal at depth d averages over every token the depths before it might
    hold, so a chain's deep tokens often do not follow its own earlier ones. Trained on revealed
    prefixes, the drafter redrafts depths j+1.. conditioned on t_1..t_j (``DFlashDrafter.draft(refine=…)``).
    """
    r, AB = batch.block_ids.shape
    A = batch.anchor_pos.shape[1]
    B = AB // A
    if share <= 0 or B < 3:
        return batch
    ids = batch.block_ids.view(r, A, B).clone()
    lab = batch.labels.view(r, A, B - 1).clone()
    lengths, weights = list(range(1, B - 1)), [1.0 / j for j in range(1, B - 1)]
    for i in range(r):
        for a in range(A):
            if rng.random() >= share:
                continue
            j = rng.choices(lengths, weights)[0]
            if bool((lab[i, a, :j] == -100).any()):
                continue
            ids[i, a, 1:1 + j] = lab[i, a, :j]
            lab[i, a, :j] = -100
    return batch._replace(block_ids=ids.view(r, AB), labels=lab.view(r, A * (B - 1)))


def live_features(target: Target, batch: Batch) -> Batch:
    """The batch with ``feats`` computed by the target from its ids (on the target's device)."""
    feats = target.batch_features(batch.ids, batch.valid.long())
    return batch._replace(feats=feats.float().clone())  # clone: a normal tensor, not an inference one


def noisy_features(feats: torch.Tensor, sigma: float, width: int, seed: int) -> torch.Tensor:
    """``feats`` [r, L, k·h] with Gaussian noise of σ times each layer's own scale added: for every
    token and each of the k layers' h columns, x + σ·rms(x)·ε, ε ~ N(0, I), drawn from a generator
    seeded with ``seed`` (so a resumed run draws the same noise at the same step).

    Why: held out, the drafter is limited by how it generalises, not by what it can fit (the model
    card: 30 minutes on 3,000 replies it had seen lifted their chain τ 2.33 → 2.66 and dropped the
    eval suite's 1.86 → 1.74). Noise on the context features (as EAGLE trains its feature
    regressor) makes the drafter read them as a neighbourhood rather than a point. The scale is per
    layer because the target's residual stream grows with depth (the feature layers' RMS differ
    several-fold)."""
    if sigma <= 0:
        return feats
    r, L, kh = feats.shape
    x = feats.view(r, L, kh // width, width).float()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    gen = torch.Generator(device=feats.device).manual_seed(seed)
    eps = torch.randn(x.shape, generator=gen, device=feats.device, dtype=torch.float32)
    return (x + sigma * rms * eps).to(feats.dtype).view(r, L, kh)


def block_mask(valid: torch.Tensor, anchor_pos: torch.Tensor, block: int, dtype) -> torch.Tensor:
    """Additive mask [r, 1, A·B, L + A·B]: block j sees context < a_j and its own B tokens."""
    r, L = valid.shape
    A = anchor_pos.shape[1]
    cols = torch.arange(L, device=valid.device)
    ctx_ok = (cols[None, None, :] < anchor_pos[:, :, None].to(valid.device)) & valid[:, None, :]   # [r, A, L]
    ctx_ok = ctx_ok.repeat_interleave(block, dim=1)                                        # [r, A·B, L]
    own = torch.block_diag(*[torch.ones(block, block, dtype=torch.bool, device=valid.device)] * A)
    ok = torch.cat([ctx_ok, own[None].expand(r, -1, -1)], dim=2)
    mask = torch.zeros(ok.shape, dtype=dtype, device=valid.device).masked_fill(~ok, torch.finfo(dtype).min)
    return mask[:, None]


def train_step(drafter: DFlashDrafter, target: Target, batch: Batch, gamma: float, bf16: bool = False,
               loss_depths: int | None = None, kd: float = 0.0, accept: float = 0.0):
    """Weighted block cross-entropy of one batch; returns (loss, per-depth top-1 accuracy, mean
    accepted chain length under teacher forcing). ``bf16`` runs the matrix products under autocast
    on the batch's device (about 2× faster on CPUs with AVX512-BF16, far more on a GPU); weights and
    the loss stay in fp32. A batch without features gets them from the target first. ``kd`` α > 0
    mixes in the target's own distributions (see :func:`_train_step`)."""
    with torch.autocast(batch.valid.device.type, dtype=torch.bfloat16, enabled=bf16):
        if batch.feats is None:
            batch = live_features(target, batch)
        return _train_step(drafter, target, batch, gamma, loss_depths, kd, accept)


def target_distributions(drafter: DFlashDrafter, target: Target, batch, depths: int) -> torch.Tensor:
    """The target's next-token log-probabilities over the draft vocabulary (all of it without one)
    for every label of the batch's blocks: float32 [r, A·D, V_d], depth k's label x_{a+k} drawn from
    the target's distribution at position a + k − 1.

    The features hold the outputs of the drafter's last feature layer (the last h columns), so only
    the layers after it run (:meth:`Target.finish_from`): on the embedded target 2 of 30 layers.
    """
    feats, valid, _, _, _, anchor_pos, _ = batch
    h = target.hidden_size
    # float32 even under the step's bf16 autocast: in bf16 the argmax of these distributions missed
    # 3% of the greedy labels in the draft vocabulary, in float32 none (self13 shards, 1,000 labels)
    with torch.no_grad(), torch.autocast(valid.device.type, enabled=False):
        final = target.finish_from(feats[..., -h:].float(), drafter.cfg.target_layer_ids[-1], valid)
        r, A = anchor_pos.shape
        at = (anchor_pos[:, :, None] + torch.arange(depths, device=valid.device)).reshape(r, A * depths)
        hid = final.gather(1, at.clamp(max=final.shape[1] - 1)[:, :, None].expand(-1, -1, final.shape[-1]))
        vocab = drafter.draft_vocab
        logits = target.lm_head(hid) if vocab is None else target.lm_head(hid, vocab)
        return torch.log_softmax(logits.float(), dim=-1)


def acceptance_weights(label_logq: torch.Tensor) -> torch.Tensor:
    """Per-label weights [..., D] whose weighted cross-entropy has the gradient of the expected
    accepted chain length (the weights are constants: computed without gradient).

    With P_d = Π_{k≤d} q_k(y_k), the probability that a chain sampled from the drafter's marginals
    matches the labels through depth d, E[L] = Σ_d P_d and ∂E[L]/∂log q_j(y_j) = Σ_{d≥j} P_d =: w_j.
    So Σ_j w_j · CE_j with w held fixed has the gradient of −E[L]: a label counts as much as the chain
    that rides on it — depth j of a block whose depth 1 is hopeless counts for little, and a depth the
    drafter almost has counts most. ``label_logq`` [..., D]: log q_k(y_k), −inf where a label cannot be
    hit (outside the draft vocabulary, past the end of the reply: the chain ends there)."""
    with torch.no_grad():
        p = torch.exp(torch.cumsum(label_logq.detach().float(), dim=-1))          # P_d
        return torch.flip(torch.cumsum(torch.flip(p, [-1]), dim=-1), [-1])        # Σ_{d≥j} P_d


def _train_step(drafter: DFlashDrafter, target: Target, batch, gamma: float, loss_depths: int | None,
                kd: float = 0.0, accept: float = 0.0):
    """``loss_depths`` D ≤ B−1 trains only depths 1..D: the LM head over V dominates the cost, and
    deep depths carry little weight in the acceptance length, so this buys more anchors per second.

    Loss per label: (1 − α)·CE(greedy label) + α·CE(p_target), α = ``kd``, where the second term is
    −Σ_v p(v) log q(v) with p the target's own next-token distribution at that position (over the
    draft vocabulary, renormalised). The greedy label says only which token won; p also says by how
    much and what came second — more signal per stored token when data, not steps, is the limit.

    ``accept`` β mixes the greedy-label term's fixed depth weights exp(−(k−1)/γ) with the expected
    acceptance length's (:func:`acceptance_weights`): (1 − β)·CE_decay + β·CE_accept, each a weighted
    mean over the batch's labels."""
    feats, valid, block_ids, block_pos, labels, anchor_pos, _ = batch
    dev = valid.device
    B = block_ids.shape[1] // anchor_pos.shape[1]  # the batch's block length (≤ the drafter's, see fit)
    D = min(loss_depths or B - 1, B - 1)
    r, L = valid.shape
    ctx_pos = torch.arange(L, device=dev)[None].expand(r, -1)
    ctx_kv = drafter.context_kv(feats, ctx_pos)
    x = target.embed(block_ids).detach()
    hidden = drafter.blocks(x, block_pos, ctx_kv, block_mask(valid, anchor_pos, B, x.dtype))
    A = anchor_pos.shape[1]
    hidden = hidden.view(r, A, B, -1)[:, :, 1:1 + D].reshape(r, A * D, -1)
    lab = labels.view(r, A, B - 1)[:, :, :D]
    ok = lab != -100
    vocab = drafter.draft_vocab
    if vocab is None:
        logits = target.lm_head(hidden).float()
        col = lab
    else:  # logits over the draft vocabulary; labels outside it cannot be hit (no loss, counted as misses)
        logits = target.lm_head(hidden, vocab).float()
        inv = torch.full((target.vocab_size,), -100, dtype=torch.long, device=dev)
        inv[vocab] = torch.arange(len(vocab), device=dev)
        col = torch.where(ok, inv[lab.clamp(min=0)], -100)
    ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), col.reshape(-1), reduction="none").view(r, A, D)
    trained = col != -100
    w = torch.exp(-torch.arange(D, dtype=torch.float32, device=dev) / gamma)
    loss = (ce * trained * w).sum() / (trained * w).sum().clamp(min=1e-9)
    if accept > 0:
        # ce = −log q(y) where trained; a label that cannot be hit ends the chain
        wa = acceptance_weights(torch.where(trained, -ce, float("-inf")))
        loss = (1.0 - accept) * loss + accept * (ce * trained * wa).sum() / (trained * wa).sum().clamp(min=1e-9)
    if kd > 0:
        logp = target_distributions(drafter, target, batch, D).view(r, A, D, -1)
        soft = -(logp.exp() * torch.log_softmax(logits.view(r, A, D, -1), dim=-1)).sum(-1)
        soft_loss = (soft * ok * w).sum() / (ok * w).sum().clamp(min=1e-9)
        loss = (1.0 - kd) * loss + kd * soft_loss
    with torch.no_grad():
        hit = (logits.argmax(-1).view(r, A, D) == col) & trained
        acc = (hit.sum((0, 1)) / ok.sum((0, 1)).clamp(min=1)).tolist()
        # expected accepted length of the chain: first miss ends the block
        run = torch.cumprod(hit.float(), dim=2).sum(2).mean().item()
    return loss, acc, run
