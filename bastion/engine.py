"""The round loop: one generator serves every strategy (ar, chain, fixed, bastion).

Each round: draft → build → verify → accept → commit (DESIGN.md section 2). ``generate`` yields a
:class:`Step` per round; :meth:`Engine.run` drains it into a :class:`GenerationResult`. Because the
baselines differ only in how the tree is built, every other line (and its cost) is shared.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from .calibration import AcceptanceCalibrator
from .config import GenerationConfig, stop_token_ids
from .coupling import DraftNoise, coupled_logq
from .drafter import DFlashDrafter
from .drafter_ops import request_vocab, widen_vocab
from .datastore import NgramPrior
from .draft_policy import DraftGate, depth_policy, plain_rate, refine_passes
from .expansion import (BudgetRule, Expansion, Rerank, best_first_from_topk, chain_from_topk, extend_with_copy,
                        topk_tensors)
from .kernels import get_kernels
from .kernels.reference import GumbelRows
from .hardware import ModelSpec, hardware_for
from .hostcost import HostCosts
from .latency import LatencyModel, RowPadding
from .loading import freeze_heap
from .lookup import CopySources, LookupStats
from .probe import (PROBE_CONTEXT, PROBE_REPEATS, PROBE_ROWS, PROBE_SIZES, Timer, probe_latency,
                    tune_drafter_products, tune_wide_rows)
from .records import GenerationResult, StageTimes, Step
from .round_state import Draft, Plan, Request
from .target import Target
from .textstream import TextStream
from .threads import ThreadGovernor
from .tree import DraftTree
from .verify import Acceptance, accept

TOPK_RECORDED = 16  # drafter candidates per depth kept in each Step, so a viewer can re-plan the tree


class Engine:
    """Speculative decoding over a :class:`Target` with an optional DFlash drafter.

    ``freeze`` (default on) moves everything alive at construction out of the garbage collector's
    scans: see :func:`freeze_heap`.
    """

    def __init__(self, target: Target, drafter: DFlashDrafter | None = None, kernels: str = "auto",
                 latency: LatencyModel | None = None, stop_ids: set[int] | None = None, datastore=None,
                 freeze: bool = True, adapt_threads: bool = True):
        self.target = target
        self.drafter = drafter
        self.datastore = datastore  # bastion.datastore.Datastore or None
        self.prior = NgramPrior(datastore) if datastore is not None else None
        if datastore is not None and datastore.vocab_size != target.vocab_size:
            raise ValueError(f"the datastore was built for a vocabulary of {datastore.vocab_size} tokens; "
                             f"the target has {target.vocab_size}")
        self.kernels = get_kernels(kernels, target.device)
        if drafter is not None:
            target.set_feature_layers(drafter.cfg.target_layer_ids)
        self.latency = latency or LatencyModel(ModelSpec.from_config(target.config, dtype=target.dtype),
                                               hardware_for(target.device, target.dtype))
        self.stop_ids = stop_ids if stop_ids is not None else stop_token_ids(target.tokenizer, target.model.generation_config)
        self.timer = Timer(target.device)
        # one calibrator per acceptance rule: T = 0 and each (T, top-k, top-p) accept differently
        self.calibrators: dict[tuple, AcceptanceCalibrator] = {}
        self.lookup_stats: dict[tuple, LookupStats] = {}
        self.host = HostCosts()  # per kind of tree: build + commit seconds as a + b·n (hostcost.py)
        self.padding: RowPadding | None = None  # measured by probe_latency
        self.wide_rows: int | None = None  # the row counts whose exact products run 512 bits wide (probe.tune_wide_rows)
        # on a CPU, fewer threads while another process holds a core (bastion.threads); kept across
        # requests — contention outlives them — and made at the first request, from torch's count then
        self.adapt_threads = adapt_threads and target.device.type == "cpu"
        self.threads: ThreadGovernor | None = None
        if freeze:
            freeze_heap()

    @staticmethod
    def _rule_key(cfg: GenerationConfig) -> tuple:
        return (cfg.temperature, cfg.top_k or 0, cfg.top_p or 1.0) if cfg.temperature > 0 else (0.0, 0, 1.0)

    def calibrator(self, cfg: GenerationConfig) -> AcceptanceCalibrator:  # coupled confidences (coupling.py): their own
        return self.calibrators.setdefault((*self._rule_key(cfg), cfg.couple and cfg.temperature > 0),
                                           AcceptanceCalibrator())

    def lookup_rates(self, cfg: GenerationConfig, source: str = "lookup") -> LookupStats:
        """Acceptance rates r(n, d) of a copy source ("lookup" or "datastore") under cfg's sampling rule."""
        return self.lookup_stats.setdefault((source, *self._rule_key(cfg)), LookupStats())

    def copy_sources(self, cfg: GenerationConfig, prompt_ids: list[int]) -> CopySources | None:
        """Bastion's copy-based sources for one request (None: none is on)."""
        names = [name for name, on in (("lookup", cfg.lookup), ("datastore", cfg.datastore and self.datastore is not None))
                 if on and cfg.strategy == "bastion"]
        if not names:
            return None
        return CopySources(prompt_ids, cfg.lookup_tokens, {n: self.lookup_rates(cfg, n) for n in names},
                           cfg.lookup_ngram, self.datastore)

    # ----------------------------------------------------------------- helpers
    def rows(self, cfg: GenerationConfig, n: int) -> int:
        """The row count an n-node tree is verified as (n, or more rows when that is cheaper)."""
        return self.padding.rows(n) if cfg.pad_rows and self.padding is not None else n

    def cost(self, cfg: GenerationConfig, context: int) -> Callable[[int], float]:
        """n ↦ predicted verify seconds of an n-node tree at this context, padding included (plus the
        host's b·n with ``cfg.node_cost``: :meth:`overhead` then leaves T_o's share that grows with n out)."""
        if cfg.cost_profile is not None:  # another host's measured costs, v(n) + b·n (costprofile.py)
            return cfg.cost_profile.cost
        b = (self.host.line(cfg.builder()) or (0.0, 0.0))[1] if cfg.node_cost else 0.0
        return lambda n: self.latency.predict(self.rows(cfg, n), context) + b * n

    def overhead(self, cfg: GenerationConfig, drafting: bool = True) -> float:
        """The round's time that :meth:`cost` leaves out: T_d (when drafting) + T_o, or + a with ``cfg.node_cost``."""
        if cfg.cost_profile is not None:  # its T_d + a
            return cfg.cost_profile.overhead(drafting)
        t_d, t_o = self.latency.overheads(cfg.setting())  # this setting's own (the benchmark runs several)
        t_o = (self.host.line(cfg.builder()) or (t_o,))[0] if cfg.node_cost else t_o  # T_o until its first round
        return (t_d if drafting else 0.0) + t_o

    def _texts(self, req: Request, ids: list[int], final: bool) -> list[str]:
        """Each new token's text (``TextStream``: a split character comes whole with its last token), or its id."""
        return req.text.pieces(ids, final) if req.text is not None else [str(i) for i in ids]

    def _rule(self, cfg: GenerationConfig) -> BudgetRule:
        adaptive = cfg.strategy == "bastion"
        return BudgetRule("adaptive" if adaptive else "fixed", cfg.budget, cfg.max_nodes if adaptive else cfg.budget,
                          self.drafter.block_size - 1, cfg.min_nodes, cfg.lookahead)

    def _build(self, cfg: GenerationConfig, root: int, topk: tuple[list, list] | None, context: int,
               raw: list[list[float]] | None = None, before_root: int | None = None,
               calib: AcceptanceCalibrator | None = None) -> Expansion:
        """The tree of this round: root only (ar), the argmax path (chain) or best-first (fixed, bastion).
        ``topk`` holds the (possibly calibrated) log confidences and ids, ``raw`` the drafter's log q;
        ``before_root`` is the committed token before the root and ``calib`` the request's calibrator
        (Bastion's n-gram re-weighting needs both)."""
        if topk is None:
            c1 = self.cost(cfg, context)(1)
            return Expansion(DraftTree.root_only(root), stop_reason="autoregressive: root only", root_cost=c1)
        vals, ids = topk
        if cfg.strategy == "chain":
            return chain_from_topk(root, vals, ids, raw)
        rerank = None
        if self._conditions(cfg):
            rerank = Rerank(raw or vals, ids, self.prior, calib.scalar() if cfg.calibrate and calib else None)
        return best_first_from_topk(root, vals, ids, self._rule(cfg), self.cost(cfg, context),
                                    self.overhead(cfg), raw, rerank, before_root)

    def _conditions(self, cfg: GenerationConfig) -> bool:
        """Whether cfg's trees re-weight each node's children by the datastore's n-grams. Greedy only:
        the datastore holds greedy replies, and at T = 1 the re-weighted trees accepted a little less
        (two runs of 6 prompts, τ 1.67 → 1.65 and 1.71 → 1.67; bench/NOTES.md)."""
        return cfg.strategy == "bastion" and cfg.condition and self.prior is not None and cfg.temperature == 0

    def probe_latency(self, max_rows: int = PROBE_ROWS, sizes: tuple[int, ...] = PROBE_SIZES,
                      context: int = PROBE_CONTEXT, repeats: int = PROBE_REPEATS) -> None:
        """Measure the target's row costs (:func:`probe.probe_latency`): the row-padding table this
        engine verifies with, and anchors of C(n) fed to its latency model — after choosing, per row
        count, the faster of the native products' two equivalent paths (:func:`probe.tune_wide_rows`),
        and the drafter's faster products (:func:`probe.tune_drafter_products`)."""
        self.wide_rows = tune_wide_rows(self.target, self.kernels, self.timer, max_rows, context)
        tune_drafter_products(self.drafter, self.target)
        self.padding = probe_latency(self.target, self.kernels, self.timer, self.latency, max_rows, sizes,
                                     context, repeats)

    def prepare(self, cfg: GenerationConfig) -> None:
        """One-time work a run needs before its clock starts: a drafting run on an engine that has not
        measured its row costs, or a Bastion run whose latency model cannot tell C(n)'s slope, probes
        them (:meth:`probe_latency`) — once per engine: the latency model keeps the probe's timings and
        feeds them in again at the host's present speed (:meth:`LatencyModel.reanchor`) when a long
        AR run has pushed them out of its window, instead of a new probe (~12 s of the embedded target
        on a 2-core AVX2 CPU, paid each time by whoever waits); a run that re-weights children builds the
        datastore's count tables. ``generate`` calls this itself; a caller that times or snapshots the
        engine around ``generate`` (the app) calls it first. AR probes nothing, but its one-row steps
        take the faster product path as every other strategy's do (:func:`probe.tune_wide_rows` for
        one row, ~0.2 s once per target): on a Zen 4 the default 512-bit path made an AR-only engine's
        steps ~10% slower than the same steps in an engine that had probed."""
        if cfg.strategy == "ar":
            self.wide_rows = tune_wide_rows(self.target, self.kernels, self.timer, max_rows=1)
            return
        slope_lost = cfg.strategy == "bastion" and not self.latency.slope_identified()
        if self.unprobed(cfg) or (slope_lost and not self.latency.reanchor()):
            self.probe_latency()
        if self._conditions(cfg):
            self.datastore.prepare_successors()

    def unprobed(self, cfg: GenerationConfig) -> bool:
        """Whether :meth:`prepare` will probe for ``cfg`` because this engine never measured its row
        costs (a drafting run that pads rows; the command line says so before the seconds it takes)."""
        return cfg.strategy != "ar" and cfg.pad_rows and self.padding is None

    # ----------------------------------------------------------------- the loop
    def generate(self, prompt_ids: list[int], cfg: GenerationConfig) -> Iterator[Step]:
        """Yield one Step per round until a stop token, max_new_tokens or the context limit."""
        cfg.validate()
        if cfg.strategy != "ar" and self.drafter is None:
            raise ValueError(f"strategy {cfg.strategy!r} needs a drafter")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        limit = self.target.max_positions
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the model's context is {limit}")
        if self.drafter is not None and self.target.feature_layers != list(self.drafter.cfg.target_layer_ids):
            # another engine on the same target (bench --drafter-b) may have set its drafter's layers
            self.target.set_feature_layers(self.drafter.cfg.target_layer_ids)
        self.prepare(cfg)  # before the clock starts: one-time calibration, not decode time
        caller_threads = torch.get_num_threads()
        if self.adapt_threads and self.threads is None and caller_threads > 1:
            self.threads = ThreadGovernor(caller_threads)
        governor = self.threads if self.adapt_threads else None
        try:
            if governor is not None:
                torch.set_num_threads(governor.current)
            yield from self._rounds(prompt_ids, cfg, governor)
        finally:  # the caller's thread count back, however the run ends (a closed generator too)
            if governor is not None:
                torch.set_num_threads(caller_threads)

    def _rounds(self, prompt_ids: list[int], cfg: GenerationConfig,
                governor: ThreadGovernor | None) -> Iterator[Step]:
        """The round loop of :meth:`generate` (inputs checked, engine prepared).

        Each round, in the paper's order: draft the block's marginals (:meth:`_draft`), grow and size
        the tree and merge the copy sources (:meth:`_plan`), verify it in one target forward, accept
        and commit (:meth:`_accept`), then cut the round's tokens at a stop (:meth:`_emit`) and feed
        the measured times back to the latency model and the thread governor (:meth:`_learn`).
        """
        req = self._begin(prompt_ids, cfg, governor)
        t_start, paused = time.perf_counter(), 0.0
        while True:
            times = StageTimes()
            prefix = self.target.cache_len  # = committed − 1: every committed token but the root
            drafting = req.dcache is not None and (req.gate is None or req.gate.draft_now())
            draft = self._draft(req, times) if drafting else None
            plan = self._plan(req, draft, prefix, times)
            with self.timer(times, "verify"):
                out = self.target.forward_tree(plan.tokens, plan.mask, plan.pos)
            acc = self._accept(req, draft, plan, out, prefix, times)
            new, finish = self._emit(req, plan.tree, acc)
            predicted, threads = self._learn(req, plan, prefix, times, drafting)
            step = self._record(req, draft, plan, acc, new, finish, predicted, threads, times,
                                time.perf_counter() - t_start - paused)
            t_yield = time.perf_counter()
            yield step
            # the consumer's time between rounds (drawing, streaming) is not decode time
            paused += time.perf_counter() - t_yield
            if finish:
                return
            # the round's tokens join the context only now: the Step's context_len is the count before them
            req.committed += len(new)
            req.before_root = new[-2] if len(new) > 1 else req.root
            req.root = acc.bonus
            req.index += 1

    def _begin(self, prompt_ids: list[int], cfg: GenerationConfig, governor: ThreadGovernor | None) -> Request:
        """Prefill the prompt (all but its last token, the first round's root) and set up the
        request's state: the drafter's context cache, draft vocabulary, calibrator, copy sources,
        draft gate and depth, and the sampled draws' noise rows."""
        target, drafter, params = self.target, self.drafter, cfg.sampling
        t_prefill = time.perf_counter()
        prefill = target.prefill(torch.tensor(prompt_ids[:-1], dtype=torch.long, device=target.device))
        # AR never drafts: it must not pay for keeping the drafter's context cache (a fair baseline)
        dcache = drafter.new_cache() if drafter is not None and cfg.strategy != "ar" and cfg.draft else None
        if dcache is not None and prefill.features is not None:
            drafter.extend_cache(dcache, prefill.features)
        vocab, in_vocab = request_vocab(getattr(self.drafter, "draft_vocab", None), prompt_ids)
        gate = DraftGate() if dcache is not None and cfg.strategy == "bastion" and cfg.skip_draft and cfg.min_nodes == 0 else None
        # sampled draws: each position's noise row hashed once per request, not once per round
        coupled = cfg.couple and dcache is not None and params.temperature > 0  # coupling.py
        reuse = params.temperature > 0 and self.kernels.reuses_noise
        noise = GumbelRows(params.seed, target.device) if coupled or reuse else None
        return Request(cfg, root=prompt_ids[-1], before_root=prompt_ids[-2] if len(prompt_ids) > 1 else None,
                        committed=len(prompt_ids), dcache=dcache, vocab=vocab, in_vocab=in_vocab,
                        calib=self.calibrator(cfg), copies=self.copy_sources(cfg, prompt_ids), gate=gate,
                        depth=depth_policy(cfg, self.drafter), noise=noise, governor=governor,
                        draft_noise=DraftNoise(noise, target.vocab_size) if coupled else None,
                        prefill_s=time.perf_counter() - t_prefill,
                        text=TextStream(target.tokenizer.decode, prompt_ids) if target.tokenizer is not None else None)

    def _draft(self, req: Request, times: StageTimes) -> Draft:
        """One drafter forward over [root, MASK × D] (plus its refinement passes): the top-k of each depth's log q (D, k),
        calibrated to log g(q) for ranking, on the host as lists."""
        cfg, limit = req.cfg, self.target.max_positions
        with self.timer(times, "draft"):
            depth, refine = req.depth.depth(), refine_passes(cfg, self.drafter)
            more = {"refine": min(refine, depth - 1)} if refine and depth > 1 else {}  # asked only when wanted
            logq = self.drafter.draft(req.dcache, req.root, self.target.embed, self.target.lm_head, req.vocab, depth, **more)
            # never draft past the context limit; one host transfer of the top-k lists
            logq = logq[:max(0, min(logq.shape[0], limit - req.committed - 1))]
            if req.draft_noise is not None:  # T > 0: rank by the target's own draws too (coupling.py)
                logq = coupled_logq(logq, req.draft_noise, req.committed - 1, req.vocab, cfg.temperature,
                                    req.depth.reach())
            k = 1 if cfg.strategy == "chain" else req.depth.width(self._rule(cfg).max_nodes)
            raw, ids = topk_tensors(logq, max(k, TOPK_RECORDED), req.vocab)
            raw = raw.float().cpu()
            used = req.calib.log_g_rows(raw) if cfg.calibrate else None  # None: g = q so far
            raw = raw.tolist()
            return Draft((raw if used is None else used, ids.cpu().tolist()), None if used is None else raw)

    def _plan(self, req: Request, draft: Draft | None, prefix: int, times: StageTimes) -> Plan:
        """The tree this round verifies and its inputs: best-first growth from the draft, the copy
        sources' branches merged where they pay, the draft gate's judgement of the result, then the mask,
        position ids and tokens of its rows (padded to the cheapest row count)."""
        cfg, limit, device = req.cfg, self.target.max_positions, self.target.device
        drafting, topk = draft is not None, draft.topk if draft is not None else None
        with self.timer(times, "build"):
            exp = self._build(cfg, req.root, topk, prefix, draft.raw if draft else None, req.before_root, req.calib)
            cost = self.cost(cfg, prefix)
            if req.gate is not None and not drafting:
                exp.stop_reason = req.gate.reason()
            if drafting and len(topk[0]) < req.depth.full:
                exp.stop_reason += f" · drafted {len(topk[0])} of {req.depth.full} depths"
            proposals = req.copies.propose(drafting) if req.copies is not None else []
            for prop in proposals:  # copy sources' branches, kept where they pay
                n_before = len(exp.tree)
                prop.chain = extend_with_copy(exp, prop.proposal.tokens, prop.reuse_rates, cost,
                                              self.overhead(cfg, drafting), cfg.max_nodes,
                                              limit - req.committed - 1, prop.source, prop.rates)
                prop.reused = sum(1 for v in prop.chain if v < n_before)
            if req.gate is not None and drafting:  # the round's two options, copy branches in both
                req.gate.judge(exp.tree.expected_tokens / max(exp.round_overhead + cost(len(exp.tree)), 1e-12),
                               plain_rate(req.root, proposals, req.copies, cost, self.overhead(cfg, drafting=False),
                                          cfg.max_nodes, limit - req.committed - 1))
            tree = exp.tree
            # dummy rows (children of the root, never accepted, cropped at commit) up to the
            # cheapest row count: see RowPadding
            n, rows = len(tree), self.rows(cfg, len(tree))
            mask, pos = self.kernels.tree_mask(tree.parents + [0] * (rows - n), prefix, self.target.dtype, device)
            tokens = torch.tensor(tree.tokens + [req.root] * (rows - n), dtype=torch.long, device=device)
        return Plan(exp, proposals, rows, tokens, mask, pos)

    def _accept(self, req: Request, draft: Draft | None, plan: Plan, out, prefix: int,
                times: StageTimes) -> Acceptance:
        """Walk the verified tree (greedy or sample-and-walk), keep the accepted rows of the target's
        cache, queue their features for the drafter, and let the depth policy, the calibrator and
        the copy sources learn from what was accepted."""
        tree, n = plan.tree, len(plan.tree)
        with self.timer(times, "commit"):
            acc = accept(tree, out.logits[:n], req.cfg.sampling, self.kernels, plan.pos[0, :n], req.noise)
            self.target.commit(prefix, acc.accepted)
            if req.dcache is not None and out.features is not None:  # encoded by the next draft
                req.dcache.defer(out.features[acc.accepted])
            if draft is not None:
                req.depth.observe(tree)
                if req.cfg.calibrate:  # tree.marginals hold the drafter's raw q
                    req.calib.observe(tree, tree.marginals, acc.accepted)
            if plan.proposals:
                req.copies.observe(tree.parents, plan.proposals, acc.accepted)
        return acc

    def _emit(self, req: Request, tree: DraftTree, acc: Acceptance) -> tuple[list[int], str]:
        """The round's new tokens (accepted drafts + bonus), cut at a stop token or max_new_tokens,
        and why the request ends ("" while it goes on); widens the draft vocabulary by words it
        lacked and feeds the copy sources."""
        cfg = req.cfg
        new = [tree.tokens[i] for i in acc.accepted[1:]] + [acc.bonus]
        finish = ""
        for j, tok in enumerate(new):
            if tok in self.stop_ids:
                new, finish = new[:j + 1], "stop token"
                break
        if req.generated + len(new) >= cfg.max_new_tokens:
            new, finish = new[:cfg.max_new_tokens - req.generated], finish or "max_new_tokens"
        req.generated += len(new)
        if req.vocab is not None and not req.in_vocab.issuperset(new):  # a word the draft vocabulary lacked
            req.vocab = widen_vocab(req.vocab, req.in_vocab, new)
        if req.copies is not None:
            req.copies.extend(new)
        if not finish and req.committed + len(new) + 1 >= self.target.max_positions:
            finish = "context limit"
        return new, finish

    def _learn(self, req: Request, plan: Plan, prefix: int, times: StageTimes, drafting: bool) -> tuple[float, int]:
        """Feed this round's measured verification and overheads to the latency model, and its
        verification to the thread governor; returns (the prediction made before the measurement,
        the round's thread count)."""
        rows = plan.rows
        predicted = self.latency.predict(rows, prefix)  # before this round's measurement
        self.latency.observe(rows, prefix, times.verify)
        threads = torch.get_num_threads()  # this round's
        # against the probe's time for this tree on the idle host, not the prediction (which follows a stall)
        governor = req.governor
        if governor is not None and governor.observe(times.verify, self.latency.anchored(rows, prefix)) != threads:
            torch.set_num_threads(governor.current)
        self.latency.observe_overheads(times.draft if drafting else None, times.build + times.commit, setting=req.cfg.setting())
        self.host.observe(req.cfg.builder(), len(plan.tree), times.build + times.commit)
        return predicted, threads

    def _record(self, req: Request, draft: Draft | None, plan: Plan, acc: Acceptance, new: list[int],
                finish: str, predicted: float, threads: int, times: StageTimes, elapsed: float) -> Step:
        """The round as a :class:`Step` (what the app draws and the benchmark counts)."""
        exp, tree, topk = plan.exp, plan.tree, draft.topk if draft is not None else None
        lookup_tokens, lookup_rates = plan.proposed("lookup")
        datastore_tokens, datastore_rates = plan.proposed("datastore")
        return Step(req.index, req.cfg.strategy, tree, exp.trace, exp.stop_reason, acc.accepted, acc.choices, new,
                    self._texts(req, new, bool(finish)), acc.bonus, tree.expected_tokens, predicted, times.verify,
                    exp.round_overhead, times, req.committed, req.generated, elapsed,
                    prefill_s=req.prefill_s, finished=bool(finish), finish_reason=finish,
                    draft_logq=[row[:TOPK_RECORDED] for row in topk[0]] if topk else [],
                    draft_ids=[row[:TOPK_RECORDED] for row in topk[1]] if topk else [],
                    lookup_tokens=lookup_tokens, lookup_rates=lookup_rates, rows=plan.rows,
                    datastore_tokens=datastore_tokens, datastore_rates=datastore_rates,
                    conditioned=exp.conditioned, threads=threads)

    def run(self, prompt_ids: list[int], cfg: GenerationConfig) -> GenerationResult:
        """Drain :meth:`generate` into a result."""
        return self.summarize(list(self.generate(prompt_ids, cfg)), len(prompt_ids))

    def summarize(self, steps: list[Step], prompt_tokens: int) -> GenerationResult:
        """The run's summary (:meth:`GenerationResult.from_steps`), its text decoded by the target's tokenizer."""
        tok = self.target.tokenizer
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
        return GenerationResult.from_steps(steps, prompt_tokens, decode)
