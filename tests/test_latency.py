"""Online calibration of the roofline recovers known parameters; its error falls with data."""

import math
import random

import torch
from transformers import LlamaConfig

from bastion.hardware import HardwareSpec, ModelSpec, known_device, measure_device
from bastion.latency import LatencyModel


def spec():
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    return ModelSpec.from_config(cfg, dtype=torch.float32)


def test_model_spec_counts_smollm2_parameters():
    assert abs(spec().params - 134.5e6) / 134.5e6 < 0.02


def test_calibration_recovers_parameters_and_error_falls():
    m = spec()
    hw = HardwareSpec("fake", 200e9, 25e9)
    truth = LatencyModel(m, hw)
    truth.compute.alpha, truth.compute.beta = 1.8, 0.030
    truth.memory.alpha, truth.memory.beta = 1.2, 0.012
    lm = LatencyModel(m, hw, window=256, decay=1.0)
    rng = random.Random(0)
    held_out = [(rng.choice([1, 2, 4, 8, 16, 32, 64, 128]), rng.randint(50, 800)) for _ in range(50)]

    def err():
        return sum(abs(lm.predict(s, c) - truth.predict(s, c)) / truth.predict(s, c) for s, c in held_out) / 50

    errors = []
    for i in range(200):
        s, c = rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 200]), rng.randint(50, 800)
        lm.observe(s, c, truth.predict(s, c) * (1 + rng.gauss(0, 0.02)))
        if i in (0, 9, 49, 199):
            errors.append(err())
    assert errors[-1] < errors[0] and errors[-1] < 0.03, errors
    assert abs(lm.compute.alpha - 1.8) / 1.8 < 0.1 and abs(lm.compute.beta - 0.030) < 0.005
    assert abs(lm.memory.beta + lm.memory.alpha * lm.t_mem(1, 400) - truth.predict(1, 400)) / truth.predict(1, 400) < 0.05


def test_single_size_keeps_prior_slope():
    lm = LatencyModel(spec(), HardwareSpec("fake", 200e9, 25e9))
    for _ in range(20):
        lm.observe(1, 100, 0.05)
    assert abs(lm.predict(1, 100) - 0.05) < 1e-3
    assert lm.compute.alpha > 0 and lm.memory.alpha > 0


def test_probe_anchors_restore_the_slope_after_a_long_ar_run(tmp_path):
    """The probe's timings (anchors) are fed in again once AR steps (n = 1) fill the window: the
    prediction for a large tree comes back near the truth, where the window alone falls back to the
    analytic prior (several-fold off on a CPU-like curve); they survive save/load."""
    hw = HardwareSpec("fake", 200e9, 25e9)

    def truth(s):  # a forward over a few rows far below the square-product rate the prior assumes
        return 0.030 + 0.0025 * s

    probe = [(s, 128, truth(s)) for s in (1, 2, 4, 8, 16, 32, 64)]
    lm = LatencyModel(spec(), hw, window=32)
    lm.observe_many(probe, anchor=True)
    assert lm.slope_identified() and lm.anchors == probe
    for i in range(40):  # a long AR run pushes every probe sample out of the window
        lm.observe(1, 128 + i, truth(1))
    assert {s for s, _, _ in lm.samples} == {1} and not lm.slope_identified()
    lost = abs(lm.predict(32, 160) - truth(32)) / truth(32)
    lm.save(tmp_path / "cal.json")
    back = LatencyModel.load(tmp_path / "cal.json")
    assert back.anchors == lm.anchors
    assert back.reanchor() and back.slope_identified() and back.anchors == probe  # fed in, not replaced
    found = abs(back.predict(32, 160) - truth(32)) / truth(32)
    assert found < 0.1 < lost, (found, lost)
    assert abs(back.predict(1, 160) - truth(1)) / truth(1) < 0.05
    # a host that has slowed by a fifth since the probe: the anchors keep their shape, take its speed
    slow = LatencyModel(spec(), hw, window=32)
    slow.observe_many(probe, anchor=True)
    for i in range(40):
        slow.observe(9, 200 + i, 1.2 * truth(9))  # trees of one size only: the slope is lost again
    assert not slow.slope_identified() and abs(slow.anchor_scale() - 1.2) < 0.03
    assert slow.reanchor()
    for s in (2, 6, 16, 32):
        assert abs(slow.predict(s, 200) - 1.2 * truth(s)) / (1.2 * truth(s)) < 0.08, s
    assert slow.anchors == probe  # kept as measured; only what is fed in is scaled
    assert LatencyModel(spec(), hw).anchor_scale() == 1.0
    plain = LatencyModel(spec(), hw)
    plain.observe_many(probe)  # not kept as anchors: nothing to feed in again
    assert not plain.anchors and not plain.reanchor()
    close = LatencyModel(spec(), hw)
    close.observe_many(probe[:2], anchor=True)  # sizes 1 and 2 only: too close to tell a slope
    assert not close.reanchor() and len(close.samples) == 2


def test_save_load_round_trip(tmp_path):
    lm = LatencyModel(spec(), HardwareSpec("fake", 200e9, 25e9))
    for s in (1, 8, 32):
        lm.observe(s, 100, 0.01 * s + 0.04)
    lm.observe_overheads(0.01, 0.002)
    lm.save(tmp_path / "cal.json")
    back = LatencyModel.load(tmp_path / "cal.json")
    assert back.predict(16, 300) == lm.predict(16, 300) and back.round_overhead() == lm.round_overhead()


def test_known_and_measured_devices():
    assert known_device("NVIDIA H200").bandwidth == 4.8e12
    assert known_device("NVIDIA A100-SXM4-80GB", torch.float32).flops == 19.5e12
    hw = measure_device("cpu", torch.float32)
    assert hw.flops > 1e8 and hw.bandwidth > 1e8  # loose: the machine may be busy


def test_ar_only_measurements_do_not_extrapolate():
    """Only s = 1 at slowly growing context, with noise: C(64) must stay near the analytic slope."""
    m = spec()
    hw = HardwareSpec("fake", 200e9, 25e9)
    lm = LatencyModel(m, hw)
    rng = random.Random(1)
    for c in range(100, 228):
        lm.observe(1, c, 0.05 * (1 + rng.gauss(0, 0.15)))
    prior = LatencyModel(m, hw)
    prior.observe(1, 100, 0.05)
    ratio = (lm.predict(64, 228) - lm.predict(1, 228)) / (prior.predict(64, 228) - prior.predict(1, 228))
    assert 0.3 < ratio < 3.0, ratio


def test_rounds_without_a_draft_leave_the_draft_time_alone():
    """AR rounds (or skipped drafts) report no draft time; T_d must keep its last estimate."""
    lm = LatencyModel(spec(), HardwareSpec("fake", 200e9, 25e9))
    lm.observe_overheads(0.02, 0.001)
    for _ in range(50):
        lm.observe_overheads(None, 0.003)
    assert lm.draft_s == 0.02 and abs(lm.overhead_s - 0.003) < 1e-6
    lm.observe_overheads(0.04, 0.003)
    assert abs(lm.draft_s - 0.024) < 1e-9


def test_each_setting_keeps_its_own_draft_and_host_times():
    """``overheads(setting)``: the engine's averages until the setting's first round (its first draft,
    for T_d), then only its own rounds move it — another setting's rounds move the engine's averages
    and their own, never this one's; past ``max_settings`` the least recently seen is dropped."""
    lm = LatencyModel(spec(), HardwareSpec("fake", 200e9, 25e9), max_settings=3)
    lm.observe_overheads(0.010, 0.004, setting="fixed:64")
    assert lm.overheads("bastion") == (0.010, 0.004) == lm.overheads(None)  # nothing of its own yet
    lm.observe_overheads(None, 0.001, setting="bastion")  # a round without a draft
    assert lm.overheads("bastion") == (lm.draft_s, 0.001)
    lm.observe_overheads(0.003, 0.001, setting="bastion")
    own = lm.overheads("bastion")
    assert own == (0.003, 0.001)
    for _ in range(20):
        lm.observe_overheads(0.010, 0.004, setting="fixed:64")
    assert lm.overheads("bastion") == own  # untouched by the other setting
    assert abs(lm.overhead_s - 0.004) < 1e-4 and abs(lm.overheads("fixed:64")[1] - 0.004) < 1e-12
    lm.observe_overheads(0.003, 0.002, setting="bastion")
    assert math.isclose(lm.overheads("bastion")[1], 0.001 + 0.2 * 0.001, rel_tol=1e-12)
    lm.observe_overheads(0.001, 0.001, setting="chain")
    lm.observe_overheads(0.001, 0.001, setting="ar")  # a fourth: "fixed:64", seen longest ago, goes
    assert list(lm.per_setting) == ["bastion", "chain", "ar"]
    assert lm.overheads("fixed:64") == (lm.draft_s, lm.overhead_s)


def test_row_padding_takes_the_cheapest_nearby_row_count():
    from bastion.latency import RowPadding

    rng = random.Random(3)
    for trial in range(200):
        m = rng.randint(1, 24)
        t = [rng.uniform(0.5, 2.0) + 0.02 * i for i in range(m)]  # bumpy, rising slowly
        margin, extra = rng.choice([0.0, 0.03, 0.1]), rng.choice([0, 1, 3, 100])
        pad = RowPadding.from_times(t, margin, extra)
        for n in range(1, m + 1):
            r = pad.rows(n)
            assert n <= r <= min(m, n + extra) and t[r - 1] <= t[n - 1]  # never dearer than n rows
            best = min(t[n - 1:n + extra])
            assert t[r - 1] <= best * (1.0 + margin) + 1e-12  # within the margin of the cheapest candidate
            assert all(t[k - 1] > best * (1.0 + margin) for k in range(n, r))  # and the fewest rows that are
            if n < m and extra >= m:  # unbounded: the effective cost rises with n, up to the margin
                assert t[r - 1] <= t[pad.rows(n + 1) - 1] * (1.0 + margin) + 1e-12
        assert pad.rows(m + 5) == m + 5 and pad.rows(0) == 0
    # the case seen on a 2-core CPU (ms for 1..8 rows): 2–4 rows run as 5, 6–7 as 8
    pad = RowPadding.from_times([56, 95, 117, 88, 75, 85, 104, 82])
    assert pad.padded == [1, 5, 5, 5, 5, 8, 8, 8]
    pad = RowPadding.from_times([1.0, 0.99, 2.0])  # 1% cheaper is within the default 3% margin: no padding
    assert pad.padded == [1, 2, 3]
    pad = RowPadding.from_times([1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.5])  # a fluke far away is out of reach
    assert pad.padded == [1, 2, 3, 7, 7, 7, 7]


def test_per_size_ratio_follows_a_kinked_curve():
    """A CPU-like curve with a step (4 → 5 rows) that two lines cannot fit: ρ(s) learns it."""
    lm = LatencyModel(spec(), HardwareSpec("fake", 200e9, 25e9))

    def truth(s):
        return 0.035 + 0.004 * (s - 1) + (0.013 if s >= 5 else 0.0)

    sizes = [1, 2, 3, 4, 5, 6, 8, 12, 16, 32]
    lm.observe_many([(s, 100, truth(s)) for s in sizes])
    rng = random.Random(1)
    for _ in range(100):
        s = rng.choice(sizes)
        lm.observe(s, 100, truth(s) * (1 + rng.gauss(0, 0.02)))
    for s in sizes:
        assert abs(lm.predict(s, 100) - truth(s)) / truth(s) < 0.05, s
    assert lm.predict(5, 100) > 1.2 * lm.predict(4, 100)  # the step is kept, not smoothed away
    assert min(lm.shape[s] for s in sizes) < 1.0 < max(lm.shape[s] for s in sizes)
    # unseen sizes interpolate between their neighbours; beyond the last seen, its ratio
    assert min(lm.shape[8], lm.shape[12]) <= lm.shape_factor(10) <= max(lm.shape[8], lm.shape[12])
    assert lm.shape_factor(64) == lm.shape[32]
    back = LatencyModel.from_dict(lm.to_dict())
    assert back.shape == lm.shape and back.predict(5, 100) == lm.predict(5, 100)
    assert LatencyModel(spec(), HardwareSpec("fake", 200e9, 25e9)).shape_factor(7) == 1.0


def _probed_cpu_like_model():
    """A model probed (anchors) on a CPU-like curve with a kink at 7 rows, and that curve."""
    lm = LatencyModel(spec(), HardwareSpec("fake", 160e9, 34e9))

    def truth(s, c=300):
        return 0.016 + 0.0011 * (s - 1) + (0.003 if s >= 7 else 0.0) + 2e-6 * c

    lm.observe_many([(s, 300, truth(s)) for s in list(range(1, 17)) + [32, 64]], anchor=True)
    return lm, truth


def test_a_stall_moves_its_row_count_a_little_and_does_not_lock_it_out():
    """A verification slowed 10x by another process raises ρ(s) by ≲ 15%, not ~3x; and after a burst
    of them at one count, rounds at *other* counts bring that count's prediction back to the host's
    present level, so the budget rule does not avoid it (and never re-measure it) for good."""
    lm, truth = _probed_cpu_like_model()
    before = lm.predict(5, 300)
    lm.observe(5, 300, 10 * truth(5))
    assert 1.0 < lm.predict(5, 300) / before < 1.2
    for _ in range(6):  # a burst: six stalls in a row at 5 rows
        lm.observe(5, 300, 8 * truth(5))
    assert lm.predict(5, 300) > 1.5 * truth(5)
    assert lm.predict(4, 300) < 2 * truth(4)  # the fit weighs the burst down: other counts move less
    rng = random.Random(0)
    for _ in range(80):  # the stall is over; the trees are now 4 and 6 rows
        s = rng.choice([4, 6])
        lm.observe(s, 300, truth(s) * (1 + rng.gauss(0, 0.02)))
    assert abs(lm.predict(5, 300) / truth(5) - 1) < 0.1
    for s in (1, 2, 8, 12, 16):  # the other unvisited counts stay at their level too
        assert abs(lm.predict(s, 300) / truth(s) - 1) < 0.1, s


def test_a_zero_timing_leaves_the_model_alone():
    """A timer that returned 0 (or NaN) is no measurement: it must not zero ρ (nor, through the
    relaxation, every other count's) or poison the fit."""
    lm, _ = _probed_cpu_like_model()
    before = [lm.predict(s, 300) for s in range(1, 12)]
    lm.observe(5, 300, 0.0)
    lm.observe(6, 300, float("nan"))
    assert [lm.predict(s, 300) for s in range(1, 12)] == before and len(lm.samples) == 18


def test_a_lasting_change_at_a_row_count_is_followed():
    """Clipped steps still follow a real change: 5 rows now cost 1.6x the probe's time, every round."""
    lm, truth = _probed_cpu_like_model()
    for _ in range(30):
        lm.observe(5, 300, 1.6 * truth(5))
    assert abs(lm.predict(5, 300) / (1.6 * truth(5)) - 1) < 0.1


def test_refit_schedule_every_sample_while_short_then_every_kth():
    """α, β are refitted on every sample while the window is short, then every ``refit_every``-th
    sample (and always at the end of observe_many); ρ(s) follows every sample."""
    m, hw = spec(), HardwareSpec("fake", 200e9, 25e9)
    lm = LatencyModel(m, hw, refit_every=4)
    rng = random.Random(1)
    fits, rhos = [], []
    for i in range(24):
        s = rng.choice([1, 4, 8, 16, 32])
        lm.observe(s, 300, 0.02 + 0.001 * s * (1 + rng.gauss(0, 0.05)))
        fits.append((lm.compute.alpha, lm.compute.beta, lm.memory.alpha, lm.memory.beta))
        rhos.append(dict(lm.shape))
    changed = [i for i in range(1, 24) if fits[i] != fits[i - 1]]
    assert set(range(1, 7)) <= set(changed)            # samples 2..7: refitted each time (window < 8)
    late = [i for i in changed if i >= 8]
    assert len(late) == 4 and all(b - a == 4 for a, b in zip(late, late[1:])), changed  # then every 4th only
    assert all(rhos[i] != rhos[i - 1] for i in range(1, 24))      # ρ moves on every sample
    every = LatencyModel(m, hw, refit_every=1)
    points = [(s, 300, 0.02 + 0.001 * s) for s in (1, 2, 4, 8, 16, 32, 64) * 3]
    lm2 = LatencyModel(m, hw, refit_every=4)
    every.observe_many(points)
    lm2.observe_many(points)
    assert abs(lm2.predict(12, 300) - every.predict(12, 300)) / every.predict(12, 300) < 1e-9


def test_probe_pads_by_the_median_pass_not_a_lucky_one():
    """A row count that was fast in one pass of the probe only (a lull on a loaded host) must not
    become the padding target: the table follows each size's median time."""
    from contextlib import contextmanager

    from bastion.engine import Engine
    from tiny import tiny_target

    target = tiny_target(dtype=torch.float32)
    engine = Engine(target, None, kernels="torch", stop_ids=set())
    sizes, passes = [], {}

    real_forward = target.forward_tree

    def forward(tokens, mask, pos):
        sizes.append(len(tokens))
        return real_forward(tokens, mask, pos)

    @contextmanager
    def timer(times, stage):
        yield
        s = sizes[-1]
        passes[s] = passes.get(s, 0) + 1
        # 1 ms a row, except one lucky pass of 10 rows at half the time of 8
        setattr(times, stage, (4.0 if s == 10 and passes[s] == 3 else float(s)) * 1e-3)

    target.forward_tree = forward
    engine.timer = timer
    engine.probe_latency(max_rows=12, sizes=(), repeats=5)
    assert engine.padding.padded == list(range(1, 13))  # the minimum would have padded 7–9 rows to 10
    assert engine.padding.seconds[9] == 10e-3
