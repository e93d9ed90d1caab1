"""What a request asks for: the strategy and its settings (:class:`GenerationConfig`), and the tokens
that end a reply (:func:`stop_token_ids`). Plain data, no model: the engine, the app, the benchmark
and the command line all read the same settings."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .verify import SamplingParams

if TYPE_CHECKING:
    from .costprofile import CostProfile

STRATEGIES = ("ar", "chain", "fixed", "bastion")


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how. ``budget`` (draft nodes, root excluded) is used by 'fixed';
    'bastion' grows up to ``max_nodes`` draft nodes and stops by the throughput rule."""

    strategy: str = "bastion"
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    budget: int = 32
    max_nodes: int = 128
    min_nodes: int = 0
    lookahead: int = 8
    skip_draft: bool = True  # bastion: the n = 0 option, see DraftGate
    draft: bool = True       # bastion: False never drafts, the copy sources alone (what the drafter adds, measured apart)
    calibrate: bool = True   # fixed/bastion: rank candidates by calibrated acceptance g(q), see calibration.py
    lookup: bool = True      # bastion: add a prompt-lookup branch when it pays, see lookup.py
    lookup_ngram: int = 3    # longest context suffix matched
    lookup_tokens: int = 10  # most tokens proposed (by prompt lookup and by the datastore)
    datastore: bool = True   # bastion: add the datastore's proposal when the engine has one, see datastore.py
    condition: bool = True   # bastion at T = 0: re-weight each node's children by the datastore's n-grams (datastore.NgramPrior)
    pad_rows: bool = True    # run each verification as the cheapest row count >= its size (RowPadding)
    adaptive_depth: bool = True  # bastion: draft only the depths recent trees reach, see DraftDepth
    couple: bool = True      # drafting strategies at T > 0: rank candidates by the target's own Gumbel draws, see coupling.py
    node_cost: bool = False  # price the host's build + commit time per tree node in the throughput rule (hostcost.py)
    refine: int | None = None  # drafting strategies: refinement passes per draft (DFlashDrafter.draft); None: the drafter's own
    # size trees with another host's measured costs instead of this one's calibration (a what-if; costprofile.py)
    cost_profile: CostProfile | None = None

    def validate(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if not self.draft and self.strategy != "bastion":
            raise ValueError(f"draft=False (the copy sources alone) needs strategy 'bastion', got {self.strategy!r}")
        if self.refine is not None and (self.refine < 0 or (self.refine and self.strategy == "ar")):
            raise ValueError(f"refine must be >= 0, and only drafting strategies refine, got {self.refine} with {self.strategy!r}")
        if self.lookup_ngram < 1 or self.lookup_tokens < 1:
            raise ValueError(f"lookup_ngram and lookup_tokens must be >= 1, got {self.lookup_ngram}, {self.lookup_tokens}")
        self.sampling.validate()

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    def setting(self) -> GenerationConfig:
        """This config less what only names one request (its length and seed): the key under which the
        latency model keeps a setting's own draft and host times (``LatencyModel.overheads``). Made once
        per config (the round loop asks several times a round; a ``replace`` costs ~7 µs)."""
        key = self.__dict__.get("_setting")
        if key is None:
            key = replace(self, max_new_tokens=0, seed=0)
            object.__setattr__(self, "_setting", key)  # a cache, not a field: eq, hash and replace ignore it
        return key

    def builder(self) -> GenerationConfig:
        """The setting less ``node_cost``: the key of the host's per-node line (``hostcost.HostCosts``) —
        the same trees cost the same to build and commit whether or not the rule prices them."""
        key = self.__dict__.get("_builder")
        if key is None:
            key = replace(self.setting(), node_cost=False)
            object.__setattr__(self, "_builder", key)
        return key


def stop_token_ids(tokenizer, model_config=None) -> set[int]:
    """EOS ids of the generation config and tokenizer, plus chat end-of-turn tokens in the vocabulary."""
    ids: set[int] = set()
    for source in (getattr(model_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>"):
            if tok in vocab:
                ids.add(vocab[tok])
    return ids
