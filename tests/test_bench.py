"""The benchmark harness end to end on a tiny random model, and its input checks (exit 2, no model)."""

import argparse
import csv
import gzip
import json
import lzma
import re

import pytest
import torch

from bastion import bench
from bastion.__main__ import main
from bastion.engine import Engine
from bastion.kernels import cpu_native
from tiny import tiny_drafter, tiny_target

SUITE = {"_about": "ignored: not a list", "chat": ["hello there", "how are you"], "code": ["def f(x):"],
         "math": ["2 + 2 =", "3 * 7 =", "not used: over the limit"]}


def bench_args(*argv):
    ap = argparse.ArgumentParser()
    bench.add_parser(ap.add_subparsers(dest="cmd"))
    return ap.parse_args(["bench", *argv])


@pytest.fixture(scope="module")
def engine():
    target = tiny_target("llama", dtype=torch.float64)
    return Engine(target, tiny_drafter(target, block_size=6), kernels="torch", stop_ids=set())


def encode(text):  # tiny targets have no tokenizer: characters to ids below the mask token
    return [ord(c) % 90 for c in text]


def test_end_to_end_on_tiny_model(engine, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(SUITE))
    out = tmp_path / "out"
    a = bench_args("--prompts", str(prompts), "--strategies", "ar,chain,fixed:4,fixed:16,bastion,bastion:always,bastion:raw,bastion:nolookup", "--hf-baselines",
                   "--max-new-tokens", "8", "--repeats", "2", "--limit-per-category", "2", "--out", str(out))
    assert bench.run_bench(a, engine=engine, encode=encode) == 0

    res = json.loads((out / "results.json").read_text())
    assert {"machine", "command", "strategies", "categories", "prompts"} <= set(res)
    assert {"cpu", "cores", "torch", "date"} <= set(res["machine"])
    want = "native" if cpu_native.available() else "fast"
    assert res["machine"]["linear"].startswith(want) and "--linear native" in res["command"]
    # the drafter's products: the probe's choice of bf16 or float32 panels for a CPU float32 drafter
    # (a draft is only a proposal); this float64 one keeps its default and claims no probe timings
    assert "--drafter-linear auto" in res["command"]
    assert res["machine"]["drafter_linear"].startswith("native-bf16" if cpu_native.available() else want)
    assert "chosen by" not in res["machine"]["drafter_linear"]
    padding = res["machine"]["row_padding"]  # measured in the first drafting warm-up
    assert len(padding["padded"]) == len(padding["seconds"]) > 1
    assert all(m >= n for n, m in enumerate(padding["padded"], 1))
    names = ["ar", "chain", "fixed:4", "fixed:16", "bastion", "bastion:always", "bastion:raw", "bastion:nolookup", "hf_generate", "hf_prompt_lookup"]
    assert list(res["strategies"]) == names
    assert list(res["categories"]) == ["chat", "code", "math"]
    assert [(p["category"], p["index"]) for p in res["prompts"]] == [("chat", 0), ("chat", 1), ("code", 0),
                                                                     ("math", 0), ("math", 1)]
    for name, st in res["strategies"].items():
        assert st["match_ar"] == 1.0, name  # lossless at T = 0, the transformers baselines included
        assert st["tokens_per_s"] > 0 and st["speedup_vs_ar"] > 0 and st["tau"] >= 1.0
        assert st["tokens"] == 5 * 2 * 8 and st["runs"] == 10 and st["peak_rss_mb"] > 0
        if name.startswith("hf_"):
            assert st["time_s"] is None and st["mean_tree_size"] is None
        else:
            assert set(st["time_fraction"]) == {"draft", "build", "verify", "commit", "other"}
            assert st["mean_tree_size"] >= 1.0
        for cat in res["categories"].values():
            assert cat[name]["match_ar"] == 1.0
    assert res["strategies"]["ar"]["speedup_vs_ar"] == 1.0 and res["strategies"]["ar"]["tau"] == 1.0
    assert res["strategies"]["ar"]["mean_tree_size"] == 1.0 and res["strategies"]["chain"]["mean_tree_size"] == 6.0
    entry = res["prompts"][0]["strategies"]["bastion"]
    assert entry["first_mismatch"] is None and len(entry["tokens_per_s_runs"]) == 2

    md = (out / "results.md").read_text()
    assert "| fixed:16 |" in md and "hf_prompt_lookup" in md and res["command"] in md
    with gzip.open(out / "rounds.csv.gz", "rt") as fh:
        rounds = list(csv.DictReader(fh))
    assert len(rounds) > 5 * 2 * 5 and {r["strategy"] for r in rounds} >= {"ar", "chain", "bastion"}
    assert all(float(r["measured_s"]) > 0 and int(r["tree_size"]) >= 1 and int(r["threads"]) >= 1 for r in rounds)
    # each round's measured host time, and the T a drafted Bastion round planned with (AR and the chain plan nothing)
    assert all(float(r["host_s"]) > 0 and float(r["draft_s"]) >= 0 for r in rounds)
    planned = [float(r["overhead_s"]) for r in rounds if r["strategy"] == "bastion" and float(r["draft_s"]) > 0]
    assert planned and all(t > 0 for t in planned)
    for png in ("speedup_by_category.png", "tau_vs_tree_size.png", "verify_latency.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| bastion |" in capsys.readouterr().out
    # ms per round by stage (the stages and "other" add up to the round), Bastion over the chain and
    # the best fixed budget, and the median verification time per row count from the round log
    row = next(line for line in md.splitlines() if line.startswith("| bastion |") and line.count("|") == 8)
    ms = [float(x) for x in row.strip("|").split("|")[1:]]
    assert abs(ms[0] - sum(ms[1:])) <= 0.03 and ms[3] > 0
    ratio = res["strategies"]["bastion"]["speedup_vs_ar"] / res["strategies"]["chain"]["speedup_vs_ar"]
    assert f"divided by the chain's, {ratio:.2f}×" in md and "`fixed:" in md
    assert "| rows | rounds | measured ms | predicted ms |" in md
    chain_tau = f"| chain | {res['categories']['chat']['chain']['tau']:.2f} | {res['categories']['code']['chain']['tau']:.2f} |"
    assert md.split("τ by category")[1].count(chain_tau) == 1
    # drawn again from the saved data alone: the same tables, the per-row medians from the rounded log
    (out / "results.md").unlink()
    (out / "verify_latency.png").unlink()
    assert main(["report", str(out)]) == 0
    again, cut = (out / "results.md").read_text(), md.index("Verification time by rows")
    assert again[:cut] == md[:cut] and again.count("\n") == md.count("\n")
    assert (out / "verify_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with gzip.open(out / "results.json.gz", "wt") as fh:  # how older folders keep theirs
        fh.write((out / "results.json").read_text())
    (out / "results.json").unlink()
    (out / "results.md").unlink()
    assert main(["report", str(out)]) == 0 and (out / "results.md").read_text() == again
    with gzip.open(out / "rounds.csv.gz", "rb") as src, lzma.open(out / "rounds.csv.xz", "wb") as dst:
        dst.write(src.read())  # and their per-round log as xz: the latency table needs it
    (out / "rounds.csv.gz").unlink()
    (out / "results.md").unlink()
    assert main(["report", str(out)]) == 0 and (out / "results.md").read_text() == again
    # the hf baselines switch the feature hooks off while they run, and back on
    assert engine.target.prefill(torch.tensor([1, 2, 3])).features is not None


def test_drafter_b_runs_its_strategies_on_a_second_engine_in_the_same_turns(tmp_path):
    target = tiny_target("llama", dtype=torch.float64, seed=3)
    engine = Engine(target, tiny_drafter(target, block_size=6), kernels="torch", stop_ids=set())
    # another drafter reading three target layers, not two: each run must switch the captured layers
    engine_b = Engine(target, tiny_drafter(target, block_size=5, seed=7, features=3), kernels="torch", stop_ids=set())
    assert target.feature_layers == list(engine_b.drafter.cfg.target_layer_ids) != list(engine.drafter.cfg.target_layer_ids)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"chat": ["hello there", "how are you"], "code": ["def f(x):"]}))
    out = tmp_path / "out"
    a = bench_args("--prompts", str(prompts), "--strategies", "ar,chain,bastion,chain@b,bastion@b", "--max-new-tokens", "8",
                   "--out", str(out))
    assert bench.run_bench(a, engine=engine, encode=encode, engine_b=engine_b) == 0

    res = json.loads((out / "results.json").read_text())
    assert list(res["strategies"]) == ["ar", "chain", "bastion", "chain@b", "bastion@b"]
    for name, st in res["strategies"].items():
        assert st["match_ar"] == 1.0 and st["tokens"] == 3 * 8, name
    # chain drafts a whole block: 6 nodes with the first drafter, 5 with the second
    assert res["strategies"]["chain"]["mean_tree_size"] == 6.0 and res["strategies"]["chain@b"]["mean_tree_size"] == 5.0
    assert res["machine"]["row_padding_b"] is not None and engine_b.calibrators and engine.calibrators
    assert res["machine"]["drafter_linear_b"] == res["machine"]["drafter_linear"]  # recorded for the A/B's second drafter
    with gzip.open(out / "rounds.csv.gz", "rt") as fh:
        assert {"bastion", "bastion@b", "chain@b"} <= {r["strategy"] for r in csv.DictReader(fh)}


@pytest.mark.skipif(not cpu_native.available(), reason="the packed kernel could not be built here")
def test_drafter_linear_b_sets_the_second_drafters_products_only(tmp_path):
    """``--drafter-linear-b`` runs ``--drafter-b``'s drafter in its own mode — with one folder for both, an
    A/B of the drafter's arithmetic within one run —, the first engine keeps ``--drafter-linear``'s, and
    the recorded command repeats it."""
    from bastion.bench_runs import linear_mode
    from bastion.drafter_io import save_drafter

    target = tiny_target("llama", dtype=torch.float32, seed=3)
    save_drafter(tiny_drafter(target), tmp_path / "d")
    a = bench_args("--drafter", str(tmp_path / "d"), "--drafter-b", str(tmp_path / "d"), "--strategies",
                   "ar,bastion,bastion@b", "--drafter-linear", "native-bf16", "--drafter-linear-b", "native-f32")
    engine = bench._engine_on(a, target, a.drafter, "")
    engine_b = bench._load_engine_b(a, engine)
    assert linear_mode(engine.drafter).startswith("native-bf16")
    assert linear_mode(engine_b.drafter).startswith("native-f32")
    assert "--drafter-linear-b native-f32" in bench._command(a, tmp_path / "out")
    plain = bench_args("--drafter-b", str(tmp_path / "d"), "--strategies", "bastion@b", "--drafter-linear", "native-f32")
    assert linear_mode(bench._load_engine_b(plain, engine).drafter).startswith("native-f32")  # default: --drafter-linear's
    # a mode named is kept (the probe may not change it); by default the probe chooses, and says so
    assert not engine.drafter.tune_products and not engine_b.drafter.tune_products
    auto = bench_args("--drafter", str(tmp_path / "d"), "--strategies", "ar,bastion")
    assert bench.drafter_linear(auto) == "auto" and "--drafter-linear auto" in bench._command(auto, tmp_path / "o")
    chosen = bench._engine_on(auto, target, auto.drafter, "")
    assert chosen.drafter.tune_products and chosen.drafter.low_precision  # bf16 until a probe times both
    chosen.drafter.products_probe = {"native-bf16": 2.3e-3, "native-f32": 2.0e-3}
    assert linear_mode(chosen.drafter).endswith("(median draft: native-bf16 2.30 ms, native-f32 2.00 ms)")
    ablation = bench_args("--drafter", str(tmp_path / "d"), "--strategies", "ar,bastion", "--linear", "fast")
    assert bench.drafter_linear(ablation) == "fast"
    assert not bench._engine_on(ablation, target, ablation.drafter, "").drafter.tune_products


def test_drafter_b_strategies_parse_and_need_a_drafting_kind():
    found = {s.name: s for s in bench.parse_strategies("bastion,bastion@b,fixed:8@b,bastion:nods:nopad@b")}
    assert list(found) == ["ar", "bastion", "bastion@b", "fixed:8@b", "bastion:nods:nopad@b"]
    assert [s.drafter_b for s in found.values()] == [False, False, True, True, True]
    assert found["fixed:8@b"].budget == 8 and not found["bastion:nods:nopad@b"].datastore
    assert not found["bastion:nods:nopad@b"].pad_rows
    refined = {s.name: s for s in bench.parse_strategies("chain,chain:refine,chain:refine3,chain:refine0,"
                                                          "bastion:nods:refine@b")}
    assert refined["chain:refine"].refine == 1 and refined["chain:refine"].config(8, 0.0, 0).refine == 1
    assert refined["chain:refine3"].config(8, 0.0, 0).refine == 3 and refined["chain:refine0"].refine == 0
    assert refined["chain"].config(8, 0.0, 0).refine is None  # the drafter's own passes
    assert refined["bastion:nods:refine@b"].refine == 1 and not refined["bastion:nods:refine@b"].datastore
    grown = {s.name: s for s in bench.parse_strategies("bastion:min8,bastion:nods:min64@b,bastion:min32:refine2")}
    assert grown["bastion:min8"].config(8, 0.0, 0).min_nodes == 8 and grown["bastion:min8"].kind == "bastion"
    assert grown["bastion:nods:min64@b"].min_nodes == 64 and grown["bastion:nods:min64@b"].drafter_b
    assert grown["bastion:min32:refine2"].config(8, 0.0, 0).min_nodes == 32 and grown["bastion:min32:refine2"].refine == 2
    assert bench.parse_strategies("bastion")[1].config(8, 0.0, 0).min_nodes == 0  # the throughput rule alone
    for name, message in [("chain:min8", "only bastion's"), ("fixed:8:min8", "only bastion's"),
                          ("bastion:copies:min8", "only bastion's"), ("bastion:min", "integer in [1, 128]"),
                          ("bastion:min0", "integer in [1, 128]"), ("bastion:min129", "integer in [1, 128]"),
                          ("bastion:minx", "unknown strategy")]:
        with pytest.raises(bench.BenchError, match=re.escape(message)):
            bench.parse_strategies(name)
    with pytest.raises(ValueError, match="need engine_b"):
        bench.run_suite(Engine.__new__(Engine), [bench.PromptCase("chat", 0, "x", [1])],
                        bench.parse_strategies("ar,bastion@b"))


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "{missing}"], "does not exist"),
    (["--prompts", "{broken}"], "not valid JSON"),
    (["--prompts", "{list}"], "JSON object"),
    (["--prompts", "{empty}"], "no prompts"),
    (["--strategies", "ar,medusa"], "unknown strategy 'medusa'"),
    (["--strategies", "fixed:0"], "positive integer"),
    (["--strategies", "fixed:x"], "positive integer"),
    (["--strategies", "fixed:-4"], "positive integer"),
    (["--strategies", "fixed"], "positive integer"),
    (["--strategies", "ar:nopad"], "only drafting strategies"),
    (["--strategies", "hf_generate:nopad"], "only drafting strategies"),
    (["--strategies", "fixed:0:nopad"], "positive integer"),
    (["--strategies", "ar:refine"], "only drafting strategies refine"),
    (["--strategies", "chain:refinex"], "unknown strategy"),
    (["--strategies", "bastion:copies:refine"], "only drafting strategies refine"),
    (["--repeats", "0"], "--repeats"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--limit-per-category", "0"], "--limit-per-category"),
    (["--temperature", "-1"], "temperature"),
    (["--strategies", "ar,bastion@b"], "pass --drafter-b"),
    (["--strategies", "ar@b"], "only drafting strategies run on --drafter-b"),
    (["--strategies", "hf_generate@b"], "only drafting strategies run on --drafter-b"),
    (["--strategies", "ar,bastion", "--drafter-b", "{good}"], "strategies named NAME@b"),
    (["--strategies", "ar,bastion", "--drafter-linear-b", "native-f32"], "sets the products of --drafter-b's drafter"),
    (["--strategies", "ar,bastion", "--drafter", "{missing}"], "does not exist"),
    (["--strategies", "ar,bastion,bastion@b", "--drafter-b", "{good}"], "has no config.json"),
])
def test_bad_input_exits_2_before_loading(argv, message, tmp_path, capsys, monkeypatch):
    files = {"missing": tmp_path / "nope.json", "broken": tmp_path / "broken.json", "list": tmp_path / "list.json",
             "empty": tmp_path / "empty.json", "good": tmp_path / "good.json"}
    files["broken"].write_text("{not json")
    files["list"].write_text(json.dumps(["a prompt"]))
    files["empty"].write_text(json.dumps({"_about": "no lists here", "chat": []}))
    files["good"].write_text(json.dumps(SUITE))
    argv = [x.format(**files) for x in argv]
    if "--prompts" not in argv:
        argv += ["--prompts", str(files["good"])]

    def no_loading(*_args, **_kw):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(bench, "_load_engine", no_loading)
    assert main(["bench", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_nopad_variants_turn_row_padding_off():
    found = {s.name: s for s in bench.parse_strategies("bastion:nopad,fixed:16:nopad,chain:nopad,bastion:nolookup:nopad")}
    assert found["ar"].pad_rows and list(found)[1:] == ["bastion:nopad", "fixed:16:nopad", "chain:nopad",
                                                         "bastion:nolookup:nopad"]
    assert not any(s.pad_rows for n, s in found.items() if n != "ar")
    assert found["fixed:16:nopad"].budget == 16 and not found["bastion:nolookup:nopad"].lookup
    assert not found["bastion:nopad"].config(8, 0.0, 0).pad_rows
    sources = {s.name: s for s in bench.parse_strategies("bastion,bastion:nods,bastion:drafter,bastion:nolookup,"
                                                         "bastion:nocond")}
    assert [(s.lookup, s.datastore, s.condition) for s in list(sources.values())[1:]] == [
        (True, True, True), (True, False, True), (False, False, False), (False, True, True), (True, True, False)]
    assert not sources["bastion:drafter"].config(8, 0.0, 0).datastore
    assert not sources["bastion:nocond"].config(8, 0.0, 0).condition and sources["bastion"].config(8, 0.0, 0).condition


def test_the_recorded_command_names_the_default_prompts_relative_to_the_working_directory(monkeypatch, tmp_path):
    from bastion.loading import EVAL_PROMPTS

    monkeypatch.chdir(EVAL_PROMPTS.parent.parent)  # the repository root, where the README's commands run
    assert "--prompts assets/eval_prompts.json " in bench._command(bench_args(), tmp_path / "o")
    monkeypatch.chdir(tmp_path)  # elsewhere the path stays whole
    assert f"--prompts {EVAL_PROMPTS} " in bench._command(bench_args(), tmp_path / "o")


def test_drafter_linear_follows_linear_unless_given():
    assert bench.drafter_linear(bench_args()) == "auto"  # the probe chooses bf16 or float32 panels
    assert bench.drafter_linear(bench_args("--linear", "stock")) == "stock"
    assert bench.drafter_linear(bench_args("--linear", "fast", "--drafter-linear", "native")) == "native"
    assert bench.drafter_linear(bench_args("--drafter-linear", "native-bf16")) == "native-bf16"
    with pytest.raises(SystemExit):
        bench_args("--drafter-linear", "turbo")


def test_verification_medians_per_row_count_skip_rare_counts():
    from bastion.report import verify_by_rows

    rounds = [{"rows": 2, "measured_s": 1e-3 * (5 + i), "predicted_s": 6e-3} for i in range(11)]
    rounds += [{"rows": 9, "measured_s": 0.02, "predicted_s": 0.02}] * 9  # under 10 rounds: left out
    assert verify_by_rows(rounds) == {2: {"rounds": 11, "measured_ms": 10.0, "predicted_ms": 6.0}}
    assert set(verify_by_rows(rounds, least=9)) == {2, 9}


def test_report_of_a_folder_without_readable_results_exits_2_and_changes_nothing(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "does not exist: not a benchmark folder" in capsys.readouterr().err
    (tmp_path / "results.json").write_text('{"strategies": ')  # cut short
    (tmp_path / "results.md").write_text("the old report")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no readable benchmark results" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md"]
    assert (tmp_path / "results.md").read_text() == "the old report"
