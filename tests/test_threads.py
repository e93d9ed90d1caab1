"""The thread governor (bastion/threads.py): fewer CPU threads while another process holds a core."""

import random

import pytest
import torch

from bastion.engine import Engine, GenerationConfig
from bastion.records import Step
from bastion.threads import ThreadGovernor
from tiny import tiny_drafter, tiny_target


def feed(gov: ThreadGovernor, ratios) -> list[int]:
    """The thread count chosen after each round of the given measured / predicted ratios."""
    return [gov.observe(r * 0.01, 0.01) for r in ratios]


def test_noise_never_moves_the_count():
    gov = ThreadGovernor(2)
    rng = random.Random(0)
    # idle-machine noise, with lone spikes and pairs of spikes above the threshold
    ratios = [rng.uniform(0.6, 1.8) for _ in range(500)] + [5, 1, 5, 5, 1, 9, 1] * 20
    assert set(feed(gov, ratios)) == {2} and gov.changes == 0


def test_a_stall_halves_the_count_and_a_trial_brings_it_back():
    gov = ThreadGovernor(4, retry=8)
    assert feed(gov, [1, 30, 30]) == [4, 4, 4]
    assert feed(gov, [30]) == [2]  # the third stalled round in a row
    assert feed(gov, [25, 25, 25]) == [2, 2, 1]  # still stalled on two: one
    assert feed(gov, [1.6] * 7) == [1] * 7
    assert feed(gov, [1.0]) == [4]  # the eighth round at a reduced count: a trial at the full count
    assert feed(gov, [0.6]) == [4]  # the other process left: kept
    assert feed(gov, [1.0] * 50) == [4] * 50
    assert gov.changes == 3 and not gov.reduced


def test_a_failed_trial_goes_back_down_and_waits_twice_as_long():
    gov = ThreadGovernor(2, retry=4, max_retry=16)
    feed(gov, [10, 10, 10])
    assert gov.current == 1
    waits = []
    for _ in range(4):
        n = 1
        while gov.observe(0.01, 0.01) == 1:  # rounds at one thread until a trial starts
            n += 1
        waits.append(n)
        assert feed(gov, [40]) == [1]  # the trial stalled: back to one thread
    # interval 4 (the first trial), then 8, then 16, then capped at 16, counted from each trial's end
    assert waits == [4, 8, 16, 16]


def test_one_thread_has_nowhere_to_go_and_bad_settings_are_refused():
    gov = ThreadGovernor(1)
    assert set(feed(gov, [50] * 20)) == {1} and gov.changes == 0
    assert gov.observe(1.0, 0.0) == 1  # no prediction: no evidence
    for bad in [dict(full=0), dict(full=2, stall=1.0), dict(full=2, patience=0), dict(full=2, retry=0),
                dict(full=2, retry=64, max_retry=32)]:
        with pytest.raises(ValueError):
            ThreadGovernor(**bad)


class Stalling(ThreadGovernor):
    """Rounds 2-4 of its life report a verification 100× slower than predicted, every other round
    exactly its prediction: the host's own timing noise must not count (a CI run once measured a
    tiny model's first round over 2× its probe, and the governor rightly shed a round early)."""

    def observe(self, measured_s, predicted_s):
        self.rounds = getattr(self, "rounds", 0) + 1
        return super().observe(predicted_s * (100.0 if 2 <= self.rounds <= 4 else 1.0), predicted_s)


def test_the_engine_sheds_threads_on_a_stall_restores_the_callers_count_and_stays_lossless():
    """A stall simulated by rounds 2–4 measuring 100× their prediction: the next rounds run on one
    thread (recorded per step), the output is AR's, and the caller's thread count comes back."""
    target = tiny_target("llama", dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=6)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prompt = [5, 9, 13, 2, 7]
        ref = Engine(target, drafter, kernels="torch", stop_ids=set(), adapt_threads=False).run(
            prompt, GenerationConfig(strategy="ar", max_new_tokens=40)).token_ids
        engine = Engine(target, drafter, kernels="torch", stop_ids=set())
        engine.threads = Stalling(2, retry=6)
        steps = list(engine.generate(prompt, GenerationConfig(strategy="bastion", max_new_tokens=40)))
        assert [t for s in steps for t in s.tokens] == ref
        counts = [s.threads for s in steps]
        assert counts[:4] == [2, 2, 2, 2] and counts[4] == 1, counts  # after rounds 2, 3, 4 stalled
        assert torch.get_num_threads() == 2
        assert Step.from_dict(steps[4].to_dict()).threads == 1
        # the next request starts where the governor stands, and its trials bring two threads back
        later = list(engine.generate(prompt, GenerationConfig(strategy="ar", max_new_tokens=30)))
        assert [t for s in later for t in s.tokens] == ref[:30]
        assert 2 in [s.threads for s in later] and engine.threads.current == 2
        # a closed generator restores the count too
        gen = engine.generate(prompt, GenerationConfig(strategy="ar", max_new_tokens=30))
        engine.threads.current = 1
        next(gen)
        assert torch.get_num_threads() == 1
        gen.close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_off_switch_and_one_thread_callers():
    target = tiny_target("llama", dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        off = Engine(target, None, kernels="torch", stop_ids=set(), adapt_threads=False)
        steps = list(off.generate([3, 4, 5], GenerationConfig(strategy="ar", max_new_tokens=5)))
        assert off.threads is None and {s.threads for s in steps} == {2}
        torch.set_num_threads(1)
        one = Engine(target, None, kernels="torch", stop_ids=set())
        steps = list(one.generate([3, 4, 5], GenerationConfig(strategy="ar", max_new_tokens=5)))
        assert one.threads is None and {s.threads for s in steps} == {1}
    finally:
        torch.set_num_threads(before)
