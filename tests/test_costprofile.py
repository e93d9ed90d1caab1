"""Cost profiles: another host's measured costs sizing the trees here (bastion/costprofile.py)."""

import argparse
import csv
import gzip
import json
from pathlib import Path

import pytest
import torch

from bastion import bench
from bastion.__main__ import main
from bastion.costprofile import CostProfile, load_profile, profile_from_bench, profile_names
from bastion.engine import Engine, GenerationConfig
from tiny import OracleDrafter, hf_greedy, tiny_drafter, tiny_target

ROOT = Path(__file__).resolve().parent.parent


def flat(node_s=0.0):  # a GPU-like host: one to 128 rows cost about the same
    return CostProfile("flat", (1, 128), (10e-3, 11e-3), draft_s=1e-3, host_s=0.2e-3, node_s=node_s)


def steep():  # a CPU-like host: every row costs as much as a plain step
    return CostProfile("steep", (1, 2, 64), (10e-3, 20e-3, 640e-3), draft_s=1e-3, host_s=0.2e-3)


@pytest.mark.parametrize("kw, message", [
    (dict(rows=(), verify_s=()), "non-empty and of one length"),
    (dict(rows=(1, 2), verify_s=(1e-3,)), "non-empty and of one length"),
    (dict(rows=(0, 2), verify_s=(1e-3, 2e-3)), "positive and increasing"),
    (dict(rows=(4, 4), verify_s=(1e-3, 2e-3)), "positive and increasing"),
    (dict(rows=(1, 4), verify_s=(2e-3, 1e-3)), "non-decreasing"),
    (dict(rows=(1,), verify_s=(0.0,)), "positive"),
    (dict(rows=(1,), verify_s=(1e-3,), draft_s=-1.0), "draft_s"),
    (dict(rows=(1,), verify_s=(1e-3,), host_s=float("nan")), "host_s"),
    (dict(rows=(1,), verify_s=(1e-3,), node_s="0.1"), "node_s"),
    (dict(rows=(1,), verify_s=(1e-3,), lines=(("fixed", 1e-3, -1e-3),)), r"lines\[fixed\]"),
])
def test_a_bad_profile_is_refused_naming_the_field(kw, message):
    args = dict(name="bad", draft_s=0.0, host_s=0.0) | kw
    with pytest.raises(ValueError, match=message):
        CostProfile(**args)


def test_verification_time_interpolates_and_extends_along_the_last_segment():
    p = CostProfile("p", (2, 4, 8), (1.0, 2.0, 2.0), draft_s=0.5, host_s=0.25, node_s=0.125)
    assert [p.verify(n) for n in (1, 2, 3, 4, 6, 8, 16)] == [1.0, 1.0, 1.5, 2.0, 2.0, 2.0, 2.0]
    rising = CostProfile("r", (1, 3), (1.0, 2.0), draft_s=0.0, host_s=0.0)
    assert rising.verify(5) == 3.0 and CostProfile("one", (4,), (1.0,), 0.0, 0.0).verify(100) == 1.0
    assert p.cost(4) == 2.0 + 0.5 and p.overhead(True) == 0.75 and p.overhead(False) == 0.25
    assert p.round_s(4, drafted=False) == 2.75


def test_profiles_load_by_name_or_path_and_bad_files_get_a_clear_error(tmp_path):
    assert "h100-s43" in profile_names()
    p = load_profile("h100-s43")
    assert p.name == "h100-s43" and "H100" in p.source and p.rows[0] == 1
    # on that host a 64-row tree verifies in well under twice a one-row step: the flat curve of a GPU
    assert p.verify(64) < 1.5 * p.verify(1)
    again = tmp_path / "mine.json"
    p.save(again)
    assert load_profile(str(again)) == p
    with pytest.raises(ValueError, match="h100-s43"):  # the error lists what is shipped
        load_profile("no-such-host")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(broken)
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"name": "x", "rows": [1]}))
    with pytest.raises(ValueError, match="name, rows, verify_s, draft_s and host_s"):
        load_profile(partial)
    partial.write_text(json.dumps({"name": "x", "rows": [1], "verify_s": [1e-3], "draft_s": 0, "host_s": 0,
                                   "lines": [["ar", 0.001]]}))
    with pytest.raises(ValueError, match="triples"):
        load_profile(partial)


@pytest.mark.parametrize("name", profile_names())
def test_each_shipped_profile_is_what_its_benchmark_folder_measures(name):
    shipped = load_profile(name)
    folder = shipped.source.split(":")[0]  # the source names the committed folder it was measured from
    measured = profile_from_bench(ROOT / "bench" / folder, name)
    assert measured.rows == shipped.rows and measured.source == shipped.source
    for a, b in zip(measured.verify_s, shipped.verify_s):
        assert a == pytest.approx(b, abs=1e-7)
    for field in ("draft_s", "host_s", "node_s"):
        assert getattr(measured, field) == pytest.approx(getattr(shipped, field), rel=1e-9)
    assert [x[0] for x in shipped.lines] == ["ar", "chain", "fixed"]
    for a, b in zip(measured.lines, shipped.lines):
        assert a[0] == b[0] and a[1:] == pytest.approx(b[1:], abs=1e-9)


def test_the_h100_profile_keeps_each_strategys_host_time():
    shipped = load_profile("h100-s43")
    # fixed:16 and fixed:64 spent 2.30 and 3.91 ms a round building and committing there: their line
    # passes through both, and Bastion's re-weighted trees cost ~4× as much a node
    a, b = shipped.host_line("fixed")
    assert a + 17 * b == pytest.approx(2.30e-3, abs=0.01e-3) and a + 65 * b == pytest.approx(3.91e-3, abs=0.01e-3)
    assert shipped.node_s > 4 * b


def _bench_folder(folder: Path) -> None:
    """A benchmark folder in the current format whose costs are known exactly."""
    folder.mkdir()
    results = {"machine": {"cpu": "test CPU", "gpu": None, "device": "cpu", "dtype": "float32", "date": "2026-12-07"},
               "command": "python -m bastion bench", "strategies": {"ar": {"rounds": 6}, "bastion": {"rounds": 6}}}
    (folder / "results.json").write_text(json.dumps(results))
    rows = []
    for i in range(6):  # AR: 1 row at 10 ms (and one stalled round the median ignores)
        rows.append(dict(strategy="ar", rows=1, tree_size=1, measured_s=0.5 if i == 0 else 0.010, draft_s=0.0,
                         host_s=0.001))
    for n, v in ((4, 0.013), (8, 0.012), (8, 0.012), (8, 0.012), (4, 0.013), (4, 0.013), (4, 0.013), (4, 0.013),
                 (8, 0.012), (8, 0.012)):  # 4 rows dearer than 8: isotonic regression pools them
        rows.append(dict(strategy="bastion", rows=n, tree_size=n, measured_s=v, draft_s=0.003,
                         host_s=0.001 + 0.0005 * n))
    rows.append(dict(strategy="bastion", rows=50, tree_size=50, measured_s=0.1, draft_s=0.003, host_s=0.026))
    fields = ["strategy", "category", "prompt", "repeat", "round", "tree_size", "rows", "context", "tokens",
              "predicted_s", "measured_s", "threads", "overhead_s", "draft_s", "host_s"]
    with gzip.open(folder / "rounds.csv.gz", "wt", newline="") as fh:
        w = csv.DictWriter(fh, fields)
        w.writeheader()
        w.writerows(dict(category="chat", prompt=0, repeat=0, round=j, context=10, tokens=1, predicted_s=0.01,
                         threads=2, overhead_s=0.001, **r) for j, r in enumerate(rows))


def test_a_profile_is_measured_from_a_benchmark_folder(tmp_path):
    _bench_folder(tmp_path / "run")
    p = profile_from_bench(tmp_path / "run")
    assert p.name == "run" and p.source.startswith("run: test CPU")
    assert p.rows == (1, 4, 8)  # 50 rows had one round: not a point
    assert p.verify_s[0] == pytest.approx(0.010)
    assert p.verify_s[1] == p.verify_s[2] == pytest.approx(0.0125)  # 5 rounds at 13 ms pooled with 5 at 12
    assert p.draft_s == pytest.approx(0.003)
    assert p.host_s == pytest.approx(0.001) and p.node_s == pytest.approx(0.0005)
    # AR's own host line prices AR's rounds; Bastion's (the rule's) prices any strategy without one
    assert [x[0] for x in p.lines] == ["ar"] and p.lines[0][1:] == pytest.approx((0.001, 0.0))
    assert p.round_s(1, False, "ar") == pytest.approx(0.010 + 0.001)
    assert p.round_s(4, True, "chain") == pytest.approx(0.003 + 0.001 + 0.002 + 0.0125)
    with pytest.raises(ValueError, match="not a benchmark folder"):
        profile_from_bench(tmp_path)


def test_the_profile_command_writes_whole_files_and_refuses_bad_folders(tmp_path, capsys):
    _bench_folder(tmp_path / "run")
    out = tmp_path / "p.json"
    assert main(["profile", str(tmp_path / "run"), "--name", "mine", "--out", str(out)]) == 0
    assert load_profile(out).name == "mine" and capsys.readouterr().err.strip() == f"wrote {out}"
    assert main(["profile", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a benchmark folder" in err[0]
    assert main(["profile", str(tmp_path / "run"), "--out", str(tmp_path / "no" / "p.json")]) == 2
    assert not (tmp_path / "no").exists() and sorted(x.name for x in tmp_path.iterdir()) == ["p.json", "run"]


def test_a_flat_profile_grows_larger_trees_than_a_steep_one_and_both_stay_lossless():
    target = tiny_target("llama", dtype=torch.float64)
    prompt = [3, 5, 7]
    full = hf_greedy(target, prompt, 40)
    drafter = OracleDrafter(tiny_drafter(target, block_size=8), full, target.vocab_size, hit=0.9, spread=2)
    engine = Engine(target, drafter, kernels="torch", stop_ids=set())
    sizes = {}
    for profile in (flat(), steep(), flat(node_s=5e-3)):
        steps = list(engine.generate(prompt, GenerationConfig(strategy="bastion", max_new_tokens=40, cost_profile=profile)))
        assert [t for s in steps for t in s.tokens] == full[len(prompt):], profile.name
        sizes[profile.node_s, profile.name] = sum(len(s.tree) for s in steps) / len(steps)
        # the profile priced what the rule saw: the recorded T is its T_d + a
        assert all(s.round_overhead_s == pytest.approx(profile.overhead(True)) for s in steps if s.draft_ids)
        assert profile.modeled_s(steps) == pytest.approx(
            sum(profile.overhead(s.times.draft > 0) + profile.cost(len(s.tree)) for s in steps))
    big, small, priced = sizes[0.0, "flat"], sizes[0.0, "steep"], sizes[5e-3, "flat"]
    assert big > 2 * small and big > priced  # a node's host cost holds the flat host's trees back


def test_the_benchmark_sizes_with_a_profile_and_reports_its_modeled_time(tmp_path):
    target = tiny_target("llama", dtype=torch.float64)
    engine = Engine(target, tiny_drafter(target, block_size=6), kernels="torch", stop_ids=set())
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"chat": ["hello there"], "math": ["2 + 2 ="]}))
    profile = tmp_path / "flat.json"
    flat().save(profile)
    out = tmp_path / "out"
    ap = argparse.ArgumentParser()
    bench.add_parser(ap.add_subparsers(dest="cmd"))
    a = ap.parse_args(["bench", "--prompts", str(prompts), "--strategies", "ar,chain,bastion", "--max-new-tokens", "8",
                       "--cost-profile", str(profile), "--out", str(out), "--no-progress"])
    assert bench.run_bench(a, engine=engine, encode=lambda t: [ord(c) % 90 for c in t]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["cost_profile"]["name"] == "flat" and "--cost-profile" in res["command"]
    for name, st in res["strategies"].items():
        assert st["modeled_tokens_per_s"] > 0, name
        # AR's modeled rate is the profile's one-row round: v(1) + a + b
        if name == "ar":
            assert st["modeled_tokens_per_s"] == pytest.approx(1 / flat().round_s(1, False), rel=1e-3)
            assert st["modeled_speedup_vs_ar"] == 1.0
    md = (out / "results.md").read_text()
    assert "cost profile `flat`" in md and "| strategy | modeled tok/s |" in md


@pytest.mark.parametrize("argv", [["--cost-profile", "no-such-host"], ["--cost-profile", "{broken}"]])
def test_a_bad_profile_exits_2_before_anything_loads(argv, tmp_path, capsys, monkeypatch):
    broken = tmp_path / "broken.json"
    broken.write_text("[]")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"chat": ["hi"]}))

    def no_loading(*_args, **_kw):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(bench, "_load_engine", no_loading)
    argv = [x.format(broken=broken) for x in argv]
    assert main(["bench", "--prompts", str(prompts), *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "cost profile" in err[0]
    assert not (tmp_path / "out").exists()
    assert main(["generate", "--prompt", "hi", *argv]) == 2  # refused before the target loads
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cost profile" in err[0]


def test_sampled_output_with_a_profile_is_ars_sample():
    """At T > 0 a profile changes which trees are verified, never the sample: one seed, one output."""
    target = tiny_target("llama", dtype=torch.float64)
    engine = Engine(target, tiny_drafter(target, block_size=6), kernels="torch", stop_ids=set())
    for seed in (1, 2):
        ar = engine.run([2, 3], GenerationConfig(strategy="ar", max_new_tokens=16, temperature=1.0, seed=seed)).token_ids
        for profile in (flat(), steep()):
            cfg = GenerationConfig(strategy="bastion", max_new_tokens=16, temperature=1.0, seed=seed, cost_profile=profile)
            assert engine.run([2, 3], cfg).token_ids == ar, (seed, profile.name)
