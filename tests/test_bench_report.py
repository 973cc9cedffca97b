"""`kvserve bench --quick` on the shipped model, end to end: report, plots, JSON, then `kvserve advise` on it.

One run (about 1.3 minutes on 2 cores, one speed round) in a fresh process, as a user would start it; the checks are on
values (bytes, compression, agreement, perplexity change), never on timings.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    # one speed round and 128 scored tokens per window (the defaults' 3 and 256 took 2.4 minutes, these 1.3): the
    # checks are on bytes, compression, agreement and perplexity, and the spread over rounds has its own test below
    subprocess.run([sys.executable, "-m", "server.cli", "bench", "--quick", "--rounds", "1", "--prefix", "896",
                    "--needle-context", "300", "--long-context", "1024", "--out", str(out)], cwd=REPO,
                   check=True, capture_output=True, text=True, timeout=900)
    return out


def test_quick_bench_writes_report_plots_and_json(quick_report):
    result = json.loads((quick_report / "results.json").read_text())
    rows = {r["backend"]: r for r in result["rows"]}
    assert list(rows) == ["full", "gqa", "mla", "int8", "dca"]
    full = rows["full"]
    # fp32 MHA, 8 layers x 8 heads x head_dim 32: K and V, 4 bytes each.
    assert full["bytes_per_token"] == 2 * 8 * 8 * 32 * 4 and full["compression"] == 1.0
    assert full["greedy_agreement"] == 1.0 and full["perplexity_change_pct"] == 0.0
    for r in result["rows"]:
        assert r["bytes_per_token"] == pytest.approx(r["formula_bytes_per_token"]), r["spec"]
        assert r["bytes_vs_context"]["1024"] > r["bytes_vs_context"]["128"] > 0
        assert set(r["tpot_s"]) == {"512", "1024"} and all(v > 0 for v in r["tpot_s"].values())
        assert set(r["phase_s"]) == {"prepare", "bytes", "perplexity", "greedy", "retrieval", "long", "latency",
                                     "throughput"}
        long = r["long_price"]  # the quality budget's long price, on one 1024-token input
        assert long["context"] == 1024 and long["tokens"] == 256 and len(long["found"]) == 4, r["spec"]
        assert long["reference_retrieval"] == rows["full"]["long_price"]["retrieval"]
        found = r["retrieval"]  # one probe per depth, the same five prompts for every backend
        assert found["context"] == 300 and found["asked"] == 5 and found["found"] + len(found["depths_missed"]) == 5
    assert rows["gqa"]["compression"] == 4.0 and rows["mla"]["compression"] == 8.0
    assert rows["int8"]["compression"] > 2.5 and abs(rows["int8"]["perplexity_change_pct"]) < 1.0
    assert abs(rows["mla"]["perplexity_change_pct"]) < 1.0  # rank 64 of 512 keeps the model (measured +0.03%)
    assert 0.0 <= rows["gqa"]["greedy_agreement"] < rows["int8"]["greedy_agreement"]
    assert full["long_price"]["kl"] == 0.0 and full["long_price"]["agreement"] == 1.0
    assert rows["int8"]["long_price"]["ppl_increase_pct"] < 1.0 and rows["int8"]["long_price"]["agreement"] > 0.9
    assert rows["gqa"]["long_price"]["kl"] > rows["int8"]["long_price"]["kl"]  # 4 heads to 1 costs more than int8

    report = (quick_report / "report.md").read_text()
    assert "| retrieval @300 |" in report and "--needle-context 300" in report
    assert "| Δ ppl @1024 (KL) | needles @1024 |" in report and "--long-context 1024" in report
    assert "kvserve bench --quick" in report and report.count("\n| ") >= 1 + 5 + 2  # header, 5 rows, dca table
    for name in ("frontier", "tpot_vs_context", "kv_bytes_vs_context"):
        png = quick_report / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({name}.png)" in report
        import matplotlib.image

        height, width, _ = matplotlib.image.imread(png).shape
        assert width > 600 and height > 400


def test_advise_ranks_the_measured_settings(quick_report):
    out = subprocess.run([sys.executable, "-m", "server.cli", "advise", "--bench", str(quick_report / "results.json"),
                          "--context", "1024", "--concurrency", "8", "--memory-budget", "64MiB", "--json"],
                         cwd=REPO, check=True, capture_output=True, text=True, timeout=120)
    ranked = json.loads(out.stdout)
    fits = {r["spec"].split(":")[0]: r["fits"] for r in ranked}
    # 8 x 1024 tokens: full needs 128 MiB, int8 ~43 MiB, mla rank 64 16 MiB.
    assert fits["full"] is False and fits["int8"] is True and fits["mla"] is True
    assert all(r["reason"] for r in ranked)


@pytest.mark.parametrize("args, message", [
    (["--backends", "full", "nosuch"], "--backends nosuch: unknown KV backend"),
    (["--backends", "mla:rank=abc"], "mla:rank=abc: rank must be an integer"),
    (["--backends", "gqa:groups=0"], "gqa:groups=0: groups must be >= 1"),
    (["--backends", "gqa:groups"], "expected key=value"),
    (["--prefix", "1024"], "--prefix must be between 1 and 1023"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--needle-context", "-1"], "--needle-context must be between 0 (off) and 1012"),
    (["--needle-context", "1013"], "--needle-context must be between 0 (off) and 1012"),
    (["--long-context", "100"], "--long-context must be 0 (off) or 1024 (the model has 1024 positions), got 100"),
    (["--long-context", "1025"], "--long-context must be 0 (off) or 1024 (the model has 1024 positions)"),
    # 512-600 passed the bound, then the long input did not fit (601 tokens on this tokenizer)
    (["--long-context", "600"], "--long-context must be 0 (off) or 1024"),
    (["--model", "/nonexistent"], "no config.json"),
    (["--backends", "mla@budget", "--budget", "nan"], "--budget must be a finite number"),
    (["--backends", "mla@budget", "--budget", "-1"], "--budget must be a finite number of percent, at least 0"),
    (["--backends", "mla@budget:rank=3"], "--backends mla@budget:rank=3: @budget chooses the setting itself"),
    (["--backends", "mla:rank=3@budget"], "--backends mla:rank=3@budget: @budget chooses the setting itself"),
])
def test_bad_arguments_fail_fast_with_one_line(args, message, tmp_path, capsys):
    """In-process (the parsing and checks ``kvserve bench`` runs before it loads anything); the test below runs the
    command itself once."""
    from server.cli import main

    try:
        status = main(["bench", "--out", str(tmp_path / "out"), *args])
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("args", [["--help"], ["--backends", "full", "nosuch"], ["--bogus"]])
def test_python_m_bench_report_is_kvserve_bench(args, tmp_path):
    """``python -m bench.report`` runs ``kvserve bench`` (whose code is in ``server.bench_cmd``): the same flags,
    the same output and exit status, under its own name (its usage said "usage: kvserve bench"); the command itself
    refuses an unknown backend in one line, exit status 2, before it writes anything."""
    def run(*command):
        p = subprocess.run([sys.executable, "-m", *command, "--out", str(tmp_path / "out"), *args], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        return p.returncode, p.stdout, p.stderr

    ours, theirs = run("bench.report"), run("server.cli", "bench")
    assert ours[0] == theirs[0] in (0, 2) and (ours[1] or ours[2])
    if "nosuch" in args:
        assert theirs[0] == 2 and "--backends nosuch: unknown KV backend" in theirs[2], theirs[2]
        assert "Traceback" not in theirs[2] and len(theirs[2].strip().splitlines()) == 1
    if args == ["--help"]:  # wrapped to its own name's width
        assert ours[1].startswith("usage: python -m bench.report [-h]") and "usage: kvserve" not in ours[1]
    else:
        assert ours[1:] == tuple(text.replace("kvserve bench", "python -m bench.report") for text in theirs[1:])
    assert not (tmp_path / "out").exists()


def test_every_benchmark_names_itself_as_it_is_run():
    """Each ``python -m bench.X`` entry point's parser is named ``python -m bench.X`` (they said ``needle.py``, or
    ``bench.fair_share``)."""
    import ast

    for path in sorted((REPO / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("ArgumentParser", "OneLineParser"):
                prog = {k.arg: k.value for k in node.keywords}.get("prog")
                named = prog.value if isinstance(prog, ast.Constant) else getattr(prog, "id", None)
                assert named in (f"python -m bench.{path.stem}", "PROG"), f"{path.name}: prog {named!r}"


def test_report_table_shows_the_spread_over_rounds():
    """One noisy round made `full` look slowest with no sign of it: each speed column carries its min-max over
    the rounds beside the median (a row without samples, e.g. an older results.json, shows the median alone)."""
    from bench.report import markdown

    row = {"backend": "full", "params": {}, "bytes_per_token": 16384, "compression": 1.0, "perplexity": 63.84,
           "perplexity_change_pct": 0.0, "greedy_agreement": 1.0, "ttft_s": 0.088, "tpot_s": {512: 0.0081, 1024: 0.0098},
           "tokens_per_s": {1: 101.2, 8: 455.0},
           "speed_samples": {"ttft_s": [0.088, 0.080, 0.120], "tpot_s": {512: [0.0081, 0.0079, 0.0090],
                                                                         1024: [0.0098, 0.0095, 0.0104]},
                             "tokens_per_s": {1: [101.2, 99.0, 110.5], 8: [455.0, 400.1, 460.0]}}}
    old = {k: v for k, v in row.items() if k != "speed_samples"} | {"backend": "int8"}
    table = markdown({"contexts": [512, 1024], "rounds": 3, "rows": [row, old]})
    full, int8 = (line.split(" | ") for line in table.splitlines()[2:4])
    assert full[7:] == ["0.088 (0.080-0.120)", "8.1 (7.9-9.0)", "9.8 (9.5-10.4)", "101.2 (99.0-110.5)",
                        "455.0 (400.1-460.0) |"]
    assert int8[7:] == ["0.088", "8.1", "9.8", "101.2", "455.0 |"]
    assert "median over 3 rounds, min-max over the rounds in brackets" in table


def test_the_report_names_the_command_that_repeats_it():
    """The report's command carries the model, the backends and every size that differs from the defaults
    (it named only --backends, so a run on another model could not be repeated from its report)."""
    import argparse

    from bench.report import DEFAULT, add_arguments, command_line

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "models/other", "--backends", "int8", "mla@budget", "--windows", "2",
                              "--budget", "0.5"])
    for key, value in DEFAULT.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    assert command_line(args) == ("kvserve bench --model models/other --backends int8 mla@budget --windows 2 "
                                  "--budget 0.5")
    args.long_context = 2048
    assert command_line(args).endswith("--budget 0.5 --long-context 2048")
