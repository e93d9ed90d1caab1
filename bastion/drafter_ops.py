"""Drafters made for training: a new one initialised from the target's last layers, a copy grown by
layers or widened by feature layers, the element-wise mean of warm-started runs, the draft
vocabulary a drafter may propose (``build_draft_vocab``) and its widening by a request's own tokens."""

from __future__ import annotations

from dataclasses import replace

import torch

from .drafter import DFlashDrafter, DrafterConfig
from .target import Target


def new_drafter(target: Target, layers: int, layer_ids: list[int], block_size: int, mask_token_id: int) -> DFlashDrafter:
    """A drafter shaped like the target's layers, initialised from the target's last `layers` layers."""
    c = target.config
    cfg = DrafterConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=layers,
                        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                        vocab_size=target.vocab_size, target_layer_ids=layer_ids, mask_token_id=mask_token_id,
                        num_target_layers=c.num_hidden_layers, block_size=block_size,
                        rms_norm_eps=float(c.rms_norm_eps),
                        rope_theta=float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 1e4)),
                        max_position_embeddings=c.max_position_embeddings)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for mine, theirs in zip(drafter.layers, target.model.get_decoder().layers[-layers:]):
            _copy_layer(mine, theirs)
        drafter.norm.weight.copy_(target.model.get_decoder().norm.weight)
    return drafter


@torch.no_grad()
def _copy_layer(mine: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """A drafter layer's attention and MLP projections and norms from a target layer of the same shapes."""
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(mine.self_attn, name).weight.copy_(getattr(theirs.self_attn, name).weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mine.mlp, name).weight.copy_(getattr(theirs.mlp, name).weight)
    mine.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
    mine.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)


def grow_drafter(drafter: DFlashDrafter, target: Target, layers: int) -> DFlashDrafter:
    """``drafter`` with layers appended (before the final norm) up to ``layers``, computing exactly what
    it computed before: each new layer's attention and MLP weights are the target's (its last layers,
    as in :func:`new_drafter`) except ``o_proj`` and ``down_proj``, which start at zero, so both of its
    residual branches add nothing until training moves them (their gradients are not zero: they see
    the branch inputs). The trained layers, ``fc``, the norms and the draft vocabulary are kept."""
    have = drafter.cfg.num_hidden_layers
    if layers < have:
        raise ValueError(f"--layers {layers}: the --init drafter already has {have} layers (a drafter is only grown)")
    if layers == have:
        return drafter
    if layers - have > target.num_layers:
        raise ValueError(f"--layers {layers}: {layers - have} new layers, the target has only {target.num_layers} to start them from")
    grown = DFlashDrafter(replace(drafter.cfg, num_hidden_layers=layers))
    grown.set_draft_vocab(drafter.draft_vocab.cpu() if drafter.draft_vocab is not None else None)
    missing, unexpected = grown.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(tuple(f"layers.{i}." for i in range(have, layers))) for k in missing)
    with torch.no_grad():
        for mine, theirs in zip(grown.layers[have:], target.model.get_decoder().layers[-(layers - have):]):
            _copy_layer(mine, theirs)
            mine.self_attn.o_proj.weight.zero_()  # both residual branches start at zero
            mine.mlp.down_proj.weight.zero_()
    return grown.to(drafter.fc.weight.device, drafter.fc.weight.dtype)


def widen_features(drafter: DFlashDrafter, extra: list[int]) -> DFlashDrafter:
    """``drafter`` reading the target layers ``extra`` as well (appended to ``target_layer_ids``),
    computing exactly what it computed before: ``fc`` [h, k·h] gains zero columns for the new
    features, so they add nothing until training moves them (their gradients are not zero)."""
    ids = list(drafter.cfg.target_layer_ids)
    if not extra or sorted(set(extra)) != list(extra) or extra[0] <= ids[-1] or extra[-1] >= drafter.cfg.num_target_layers:
        raise ValueError(f"--add-feature-layers {extra}: give ascending layer ids after the drafter's last "
                         f"feature layer {ids[-1]} and below the target's {drafter.cfg.num_target_layers} layers")
    wide = DFlashDrafter(replace(drafter.cfg, target_layer_ids=ids + list(extra)))
    wide.set_draft_vocab(drafter.draft_vocab.cpu() if drafter.draft_vocab is not None else None)
    state = drafter.state_dict()
    w = state.pop("fc.weight")
    missing, unexpected = wide.load_state_dict(state, strict=False)
    assert missing == ["fc.weight"] and not unexpected, (missing, unexpected)
    with torch.no_grad():
        wide.fc.weight.zero_()
        wide.fc.weight[:, :w.shape[1]] = w
    return wide.to(drafter.fc.weight.device, drafter.fc.weight.dtype)


def extend_features(target: Target, feats: torch.Tensor, stored: list[int], wanted: list[int],
                    valid: torch.Tensor) -> torch.Tensor:
    """Features [r, L, len(wanted)·h] from stored ones [r, L, len(stored)·h] when ``wanted`` is
    ``stored`` followed by later layers: those are computed from the last stored layer's outputs by
    the target's layers in between (:meth:`Target.layers_from`, float32, no gradient)."""
    extra = wanted[len(stored):]
    if wanted[:len(stored)] != stored:
        raise ValueError(f"the drafter reads target layers {wanted}; the data holds {stored}, not a prefix of them")
    if not extra:
        return feats
    h = target.hidden_size
    dt = torch.promote_types(feats.dtype, torch.float32)  # at least float32 (shards keep float16)
    with torch.no_grad(), torch.autocast(valid.device.type, enabled=False):
        outs = target.layers_from(feats[..., -h:].to(dt), stored[-1], valid, extra)
    return torch.cat([feats.to(dt), *[o.to(dt) for o in outs]], dim=-1)


def average_drafters(drafters: list[DFlashDrafter]) -> DFlashDrafter:
    """The element-wise mean of drafters of one lineage (a "model soup": warm-started runs of the
    same drafter land in one basin, and their mean cancels part of each run's checkpoint noise — the
    shipped drafter is the mean of runs 13, 16, 17 and 18; the model card has what it measured). Configs
    and draft vocabularies must be equal; the mean is taken in float64 and returned in the first
    drafter's dtype."""
    if not drafters:
        raise ValueError("average: no drafters given")
    first = drafters[0]
    for i, d in enumerate(drafters[1:], 2):
        if d.cfg != first.cfg:
            diff = [f for f in first.cfg.__dataclass_fields__ if getattr(d.cfg, f) != getattr(first.cfg, f)]
            raise ValueError(f"average: drafter {i} differs from drafter 1 in {', '.join(diff)}")
        same_vocab = (d.draft_vocab is None) == (first.draft_vocab is None) and \
            (d.draft_vocab is None or torch.equal(d.draft_vocab.cpu(), first.draft_vocab.cpu()))
        if not same_vocab:
            raise ValueError(f"average: drafter {i} has another draft vocabulary than drafter 1")
    out = DFlashDrafter(first.cfg)
    out.set_draft_vocab(first.draft_vocab.cpu() if first.draft_vocab is not None else None)
    states = [d.state_dict() for d in drafters]
    mean = {k: (sum(st[k].double() for st in states) / len(states)) if v.is_floating_point() else v
            for k, v in states[0].items()}
    out.load_state_dict(mean)
    return out.to(first.fc.weight.dtype).eval()


def build_draft_vocab(records: list[dict], size: int, vocab_size: int, always: set[int] = frozenset()) -> torch.Tensor:
    """The ``size`` target ids a drafter may propose: ``always`` (e.g. stop tokens), then the most frequent
    tokens of the training sequences (responses counted twice: they are what gets drafted), then the
    lowest unused ids (BPE merges in order, so low ids are the common pieces). Sorted ascending."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"--draft-vocab {size} must be in [1, {vocab_size}]")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        ids = r["ids"].long()
        counts.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float64))
        resp = ids[r["prompt_len"]:]
        counts.index_add_(0, resp, torch.ones(len(resp), dtype=torch.float64))
    # the order of preference: forced ids, then by count, ties broken by low id
    score = counts - torch.arange(vocab_size, dtype=torch.float64) / (2.0 * vocab_size)
    for i in always:
        if 0 <= i < vocab_size:
            score[i] = float("inf")
    return torch.sort(torch.topk(score, size).indices).values


def request_vocab(base: torch.Tensor | None, prompt_ids: list[int]) -> tuple[torch.Tensor | None, set[int]]:
    """A drafter's draft vocabulary ``base`` widened by the prompt's tokens, and its members as a set
    (None and an empty set: the drafter drafts over the full vocabulary).

    A small static vocabulary misses the rare words a reply copies from its prompt (names, topic
    words), and each miss ends a round's accepted path; adding the request's own tokens costs a
    few rows of the LM head.
    """
    if base is None:
        return None, set()
    members = set(base.tolist())
    return widen_vocab(base, members, prompt_ids), members


def widen_vocab(vocab: torch.Tensor, members: set[int], ids: list[int]) -> torch.Tensor:
    """vocab with the ids it lacks appended; ``members`` (vocab as a set) is updated in place."""
    extra = list(dict.fromkeys(i for i in ids if i not in members))
    if not extra:
        return vocab
    members.update(extra)
    return torch.cat([vocab, torch.tensor(extra, dtype=vocab.dtype, device=vocab.device)])
