"""The benchmark's strategies: names such as ``bastion:nods:refine2@b`` parsed into :class:`Strategy`.

A name is an engine strategy (``ar``, ``chain``, ``fixed:N``, ``bastion``), a Bastion variant with one
part switched off or changed (:data:`BASTION_VARIANTS`), or a transformers baseline, then suffixes:
``:nopad``, ``:nocouple``, ``:refineN`` (drafting strategies), ``:minN`` (Bastion: at least N draft
nodes a round, the draft gate off — the trees of a host where verification is cheap), and last ``@b``
(run on the second drafter). Bad names raise :class:`BenchError` naming what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .config import GenerationConfig

ENGINE_STRATEGIES = ("ar", "chain", "bastion")  # and fixed:N
HF_BASELINES = ("hf_generate", "hf_prompt_lookup")


class BenchError(ValueError):
    """Bad input to the harness: reported in one line, exit code 2."""


@dataclass(frozen=True)
class Strategy:
    """A benchmarked decoder: an engine strategy (``budget`` used by 'fixed') or 'hf' for generate()."""

    name: str
    kind: str
    budget: int = 32
    skip_draft: bool = True  # bastion's draft gate; 'bastion:always' drafts every round (the paper's loop)
    calibrate: bool = True   # calibrated surrogate; 'bastion:raw' ranks by the drafter's own q
    lookup: bool = True      # bastion's prompt-lookup branch; 'bastion:nolookup' leaves it out
    datastore: bool = True   # bastion's datastore branch; 'bastion:nods' leaves it out
    condition: bool = True   # bastion's n-gram re-weighting of each node's children; 'bastion:nocond' leaves it out
    pad_rows: bool = True    # row padding (RowPadding); 'NAME:nopad' (bastion:nopad, fixed:16:nopad, ...) runs trees as they are
    adaptive_depth: bool = True  # bastion's draft depth policy (DraftDepth); 'bastion:fulldepth' drafts the whole block
    node_cost: bool = False  # 'bastion:nodecost' prices the host's work per tree node (hostcost.py)
    couple: bool = True      # noise-coupled drafting at T > 0 (coupling.py); 'NAME:nocouple' leaves it out
    draft: bool = True       # 'bastion:copies' never drafts: prompt lookup and the datastore alone
    drafter_b: bool = False  # 'NAME@b' runs on the second engine, the one of --drafter-b
    refine: int | None = None  # 'NAME:refineN' (N = 1 without a number): N refinement passes per draft; None: the drafter's
    min_nodes: int = 0       # 'bastion:minN': at least N draft nodes a round (GenerationConfig.min_nodes; the gate off)

    def config(self, max_new_tokens: int, temperature: float, seed: int) -> GenerationConfig:
        return GenerationConfig(strategy=self.kind, budget=self.budget, max_new_tokens=max_new_tokens,
                                temperature=temperature, seed=seed, skip_draft=self.skip_draft,
                                calibrate=self.calibrate, lookup=self.lookup, datastore=self.datastore,
                                condition=self.condition, pad_rows=self.pad_rows, adaptive_depth=self.adaptive_depth,
                                node_cost=self.node_cost, couple=self.couple, draft=self.draft, refine=self.refine,
                                min_nodes=self.min_nodes)


# (suffix, Strategy field, who may carry it): ':refineN' and ':minN' take a number, the others switch a part off
SUFFIXES = ((":nopad", "pad_rows", "drafting strategies pad their trees"),
            (":nocouple", "couple", "drafting strategies draft coupled"),
            (":refine", "refine", "drafting strategies refine"),
            (":min", "min_nodes", "bastion's drafted trees have a minimum size"))

NUMERIC = ("refine", "min_nodes")


def _may_carry(s: Strategy, attr: str) -> bool:
    """Whether strategy ``s`` takes the suffix that sets ``attr``: every drafting strategy, but passes
    refine a draft (not the copies alone) and a least tree size is Bastion's drafted trees only."""
    if s.kind in ("hf", "ar"):
        return False
    if attr in NUMERIC and not s.draft:
        return False
    return attr != "min_nodes" or s.kind == "bastion"


# bastion with one part switched off or changed (what each buys, measured in the same run)
BASTION_VARIANTS = {"bastion:always": dict(skip_draft=False), "bastion:raw": dict(calibrate=False),
                    "bastion:nolookup": dict(lookup=False), "bastion:nods": dict(datastore=False),
                    "bastion:nocond": dict(condition=False),
                    "bastion:drafter": dict(lookup=False, datastore=False, condition=False),
                    "bastion:copies": dict(draft=False), "bastion:fulldepth": dict(adaptive_depth=False),
                    "bastion:nodecost": dict(node_cost=True)}


def parse_strategies(text: str, hf_baselines: bool = False) -> list[Strategy]:
    """'ar,chain,fixed:32,bastion' → strategies, AR first, duplicates dropped; BenchError on a bad name."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BenchError("--strategies is empty")
    found: dict[str, Strategy] = {"ar": Strategy("ar", "ar")}
    for name in names + (list(HF_BASELINES) if hf_baselines else []):
        s = _strategy(name)
        found.setdefault(s.name, s)
    return list(found.values())


def _strategy(name: str) -> Strategy:
    if name.endswith("@b") and name != "@b":
        s = _strategy(name[:-len("@b")])
        if s.kind in ("hf", "ar"):
            raise BenchError(f"strategy {name!r}: only drafting strategies run on --drafter-b")
        return replace(s, name=f"{s.name}@b", drafter_b=True)
    for suffix, attr, what in SUFFIXES:
        base, found, n = name.rpartition(suffix)
        numeric = attr in NUMERIC
        if not (found and base and (n == "" or (numeric and n.isascii() and n.isdigit()))):
            continue
        s = _strategy(base)
        if not _may_carry(s, attr):
            raise BenchError(f"strategy {name!r}: only {what}")
        if attr == "min_nodes" and not (n and 0 < int(n) <= GenerationConfig.max_nodes):
            raise BenchError(f"strategy {name!r}: the fewest draft nodes must be an integer in [1, "
                             f"{GenerationConfig.max_nodes}], as in bastion:min64")
        return replace(s, name=f"{s.name}{suffix}{n}", **{attr: (int(n or 1) if numeric else False)})
    if name in ENGINE_STRATEGIES:
        return Strategy(name, name)
    if name in HF_BASELINES:
        return Strategy(name, "hf")
    if name in BASTION_VARIANTS:
        return Strategy(name, "bastion", **BASTION_VARIANTS[name])
    kind, _, budget = name.partition(":")
    if kind == "fixed":
        if not (budget.isascii() and budget.isdigit() and int(budget) > 0):
            raise BenchError(f"strategy {name!r}: the budget must be a positive integer, as in fixed:32")
        return Strategy(f"fixed:{int(budget)}", "fixed", int(budget))
    raise BenchError(f"unknown strategy {name!r}; choose from ar, chain, fixed:N, bastion, {', '.join(BASTION_VARIANTS)}, {', '.join(HF_BASELINES)} (drafting ones may end in :nopad, :nocouple or :refineN, bastion ones in :minN, and then in @b)")
