"""A DFlash drafter's configuration: its shape, the target layers it reads, its block and mask token,
with the published checkpoints' ``config.json`` keys (``to_hf_dict`` / ``from_hf_dict``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Qwen3Config


def spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` target layer ids spread evenly over [1, L − 3] (the DFlash default)."""
    if count == 1:
        return [num_target_layers // 2]
    lo, hi = 1, max(1, num_target_layers - 3)
    return [int(round(lo + i * (hi - lo) / (count - 1))) for i in range(count)]


@dataclass
class DrafterConfig:
    """Hyper-parameters of a DFlash drafter; serialised in the published config.json layout."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    draft_vocab_size: int | None = None  # Bastion extension: draft over a subset of the vocabulary
    refine_passes: int = 0  # Bastion extension: the engine's default refinement passes (DFlashDrafter.draft)
    extra: dict = field(default_factory=dict)

    def to_hf_dict(self) -> dict:
        """The config.json of published DFlash checkpoints (a Qwen3 config plus dflash keys)."""
        d = dict(self.extra)
        d.update(
            architectures=["DFlashDraftModel"], model_type="qwen3",
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings, block_size=self.block_size,
            num_target_layers=self.num_target_layers, hidden_act="silu", attention_bias=False,
            tie_word_embeddings=False,
            dflash_config={"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id},
        )
        if self.draft_vocab_size:
            d["draft_vocab_size"] = self.draft_vocab_size
        if self.refine_passes:
            d["refine_passes"] = self.refine_passes
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DrafterConfig":
        try:
            dflash = d.get("dflash_config") or {}
            n_layers = int(d["num_hidden_layers"])
            n_target = int(d["num_target_layers"])
            ids = dflash.get("target_layer_ids") or spread_layer_ids(n_target, n_layers)
            rope = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
            known = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
                     "max_position_embeddings", "block_size", "num_target_layers", "dflash_config",
                     "draft_vocab_size", "refine_passes"}
            return cls(
                hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=n_layers, num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d.get("num_key_value_heads", d["num_attention_heads"])),
                head_dim=int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]),
                vocab_size=int(d["vocab_size"]), target_layer_ids=[int(i) for i in ids],
                mask_token_id=int(dflash["mask_token_id"]) if "mask_token_id" in dflash else int(d["mask_token_id"]),
                num_target_layers=n_target, block_size=int(d.get("block_size", 16)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(rope),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                draft_vocab_size=int(d["draft_vocab_size"]) if d.get("draft_vocab_size") else None,
                refine_passes=int(d.get("refine_passes", 0)),
                extra={k: v for k, v in d.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"drafter config is missing or has a bad field: {exc}") from None

    def qwen3(self) -> Qwen3Config:
        return Qwen3Config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )
