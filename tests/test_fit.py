"""Will it fit: the memory estimate, its verdict, the CLI's refusal, and the estimate against the
peak RSS measured in a fresh process that loads the model, prefills and decodes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from engine import fit
from engine.errors import DoesNotFit, SettingsError
from engine.kv.config import estimate_bytes, parse_kv
from engine.gguf_file import GGUFFile
from engine.models import model_args

SMOL = "smollm2-135m-instruct"
MiB = 1 << 20

PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    path, n, kv = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    engine = Engine.load(path, kv=kv)
    if len(sys.argv) > 4:  # a draft model drafting every token (--draft)
        from engine.speculate import load_draft
        engine.set_draft(load_draft(engine, sys.argv[4]))
    ids = (np.arange(n - 4) % 1000 + 100).tolist()  # n - 4 prompt tokens, then 4 decoded
    result = engine.generate(ids, max_tokens=4, sampling=SamplingParams())
    assert result.stats.prompt_tokens == n - 4
    # The high-water mark of this address space's resident set (VmHWM, KiB). Not getrusage's
    # ru_maxrss: Linux carries that across fork and exec, so a child of a large pytest process
    # would report the parent's size.
    with open("/proc/self/status") as status:
        hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    print(json.dumps({"peak_rss": hwm * 1024}))
""")


def omlx(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


def test_verdict_thresholds():
    assert fit.verdict(800, 1000) == fit.FITS
    assert fit.verdict(801, 1000) == fit.TIGHT
    assert fit.verdict(1000, 1000) == fit.TIGHT
    assert fit.verdict(1001, 1000) == fit.DOES_NOT_FIT
    assert fit.download_verdict(100 * MiB, available=64 * 1024 * MiB) == fit.FITS
    assert fit.download_verdict(4096 * MiB, available=2048 * MiB) == fit.DOES_NOT_FIT


def test_memory_limit_caps_available(monkeypatch):
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, "512M")
    assert fit.memory_limit() == 512 * MiB and fit.available_bytes() <= 512 * MiB
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, "1.5GiB")
    assert fit.memory_limit() == 1536 * MiB
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, "lots")
    with pytest.raises(SettingsError, match="OMLX_MEMORY_LIMIT='lots' is not a size"):
        fit.available_bytes()


def test_estimate_parts(smollm2_path):
    gguf = GGUFFile(smollm2_path)
    args = model_args(gguf)
    g = args.kv_geometry()
    small = fit.estimate(gguf, 1024, "balanced", available=1 << 40)
    large = fit.estimate(gguf, 4096, "balanced", available=1 << 40)
    saver = fit.estimate(gguf, 4096, "memory-saver", available=1 << 40)
    assert small.kv_bytes == estimate_bytes(parse_kv("balanced"), g.n_layers, g.n_kv_heads, g.head_dim,
                                            1024, g.value_dim, windows=list(g.windows))["total"]
    assert small.weights_bytes == smollm2_path.stat().st_size  # every matrix read in place
    assert small.total_bytes < large.total_bytes and saver.kv_bytes < large.kv_bytes
    assert fit.estimate(gguf, 10**9, "balanced").ctx == args.context_length  # capped at the model's
    assert fit.estimate(gguf, 1024, "balanced", available=small.total_bytes // 2).verdict == fit.DOES_NOT_FIT
    with pytest.raises(DoesNotFit, match="context of 0 tokens"):
        fit.estimate(gguf, 0)


def test_info_prints_the_verdict(smollm2_path):
    out = omlx("info", SMOL, "--ctx", "2048", "--kv", "balanced")
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if "will it fit" in l)
    assert "fits: needs about" in line and "2,048 tokens k6v4" in line and "available" in line
    data = json.loads(omlx("info", SMOL, "--ctx", "2048", "--kv", "balanced", "--json").stdout)
    assert data["fit"]["verdict"] == "fits" and data["fit"]["ctx"] == 2048
    assert data["fit"]["total_bytes"] > data["file_bytes"]
    tiny = omlx("info", SMOL, "--ctx", "2048", env={fit.MEMORY_LIMIT_ENV: "100M"})
    assert "does not fit: needs about" in tiny.stdout


def test_loading_a_model_that_does_not_fit_needs_force(smollm2_path):
    args = ("generate", SMOL, "--prompt", "Hello", "--max-tokens", "2")
    refused = omlx(*args, env={fit.MEMORY_LIMIT_ENV: "150M"})
    assert refused.returncode == 2 and refused.stdout == "", (refused.returncode, refused.stdout, refused.stderr)
    assert "does not fit" in refused.stderr and "--force" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    forced = omlx(*args, "--force", env={fit.MEMORY_LIMIT_ENV: "150M"})
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.strip(), forced.stderr
    assert "does not fit" in forced.stderr, forced.stderr  # said, then loaded anyway


# Six fresh processes; the quick subset keeps the smallest case, the whole suite runs all three
@pytest.mark.parametrize("name, n_tokens, kv", [
    (SMOL, 64, "full"),
    pytest.param(SMOL, 2048, "balanced", marks=pytest.mark.slow),
    pytest.param("gemma3-270m", 1024, "balanced", marks=pytest.mark.slow),
])
def test_estimate_within_15_percent_of_measured_peak_rss(name, n_tokens, kv, smollm2_path, gemma3_path):
    path = smollm2_path if name == SMOL else gemma3_path
    # A fresh process, so no other test's memory counts; run twice, measuring the second: the
    # first may compile kernels into numba's disk cache (a one-time cost on a new install, whose
    # LLVM memory is not the steady state the estimate describes).
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), str(n_tokens), kv],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr
    measured = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss"]
    estimated = fit.estimate_file(path, n_tokens, kv).total_bytes
    assert abs(estimated - measured) <= 0.15 * measured, (
        f"estimate {estimated / MiB:.0f} MiB vs measured peak {measured / MiB:.0f} MiB")


@pytest.mark.slow  # two fresh processes
def test_estimate_with_a_draft_model_within_15_percent_of_measured_peak_rss(smollm2_path):
    """The draft model's share of the estimate (`fit._draft_bytes`), measured: SmolLM2 drafting
    for itself, 1,024 tokens, K6V4."""
    for _ in range(2):  # the second run measured, as above
        proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(smollm2_path), "1024", "balanced",
                               str(smollm2_path)], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr
    measured = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss"]
    estimated = fit.estimate_file(smollm2_path, 1024, "balanced", draft=smollm2_path).total_bytes
    assert abs(estimated - measured) <= 0.15 * measured, (
        f"estimate {estimated / MiB:.0f} MiB vs measured peak {measured / MiB:.0f} MiB")


def test_a_draft_model_counts_in_the_fit_check(smollm2_path, tmp_path, monkeypatch, capsys):
    """With --draft the check adds the draft model's file and its KV at the same spec and
    context: a budget the model alone fits in but the pair does not refuses the pair (exit 2,
    the message naming both files) before either loads, on generate and serve alike."""
    from engine import cli

    draft = tmp_path / "smollm2-draft.gguf"  # SmolLM2 drafting for itself, under another name
    try:
        os.link(smollm2_path, draft)  # (a symlink would resolve to the model's own name)
    except OSError:  # another file system
        shutil.copyfile(smollm2_path, draft)
    prompt, max_tokens = "Hello", 2
    ctx = len(prompt.encode()) + max_tokens + 16  # what the check assumes for generate (cli._fit_ctx)
    alone = fit.estimate_file(smollm2_path, ctx, "full", available=1 << 40)
    pair = fit.estimate_file(smollm2_path, ctx, "full", available=1 << 40, draft=draft)
    g = model_args(GGUFFile(smollm2_path)).kv_geometry()
    draft_kv = estimate_bytes(parse_kv("full"), g.n_layers, g.n_kv_heads, g.head_dim, ctx, g.value_dim,
                              windows=list(g.windows))["total"]
    # the same weight types: no kernels more; its file, tokenizer and KV at the same context
    assert pair.draft_bytes == (smollm2_path.stat().st_size + draft_kv
                                + fit.TOKENIZER_BYTES_PER_ENTRY * model_args(GGUFFile(draft)).vocab_size)
    assert pair.total_bytes == alone.total_bytes + pair.draft_bytes
    assert "draft model" in pair.summary() and "draft model" not in alone.summary()
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, str((alone.total_bytes + pair.total_bytes) // 2))

    args = ["-q", "generate", str(smollm2_path), "--prompt", prompt, "--max-tokens", str(max_tokens), "--kv", "full"]
    assert cli.main(args) == 0  # alone it fits (tight: said, then loaded)
    capsys.readouterr()
    assert cli.main([*args, "--draft", str(draft)]) == 2
    err = capsys.readouterr().err
    assert f"{smollm2_path.name} with the draft model {draft.name} does not fit" in err, err
    assert "--force" in err and "Traceback" not in err
    serve = ["-q", "serve", str(smollm2_path), "--port", "0", "--ctx", str(ctx), "--kv", "full", "--draft", str(draft)]
    assert cli.main(serve) == 2
    assert f"{smollm2_path.name} with the draft model {draft.name} does not fit" in capsys.readouterr().err


def test_ask_without_ctx_counts_the_draft_model_in_its_default_context(smollm2_path, tmp_path, monkeypatch,
                                                                       capsys):
    """`omlx ask --draft` without --ctx: the context is fit.default_context's with the draft model
    counted, less than the model's whole context under a budget the model alone fits in at it."""
    from engine import cli

    draft = tmp_path / "smollm2-draft.gguf"
    try:
        os.link(smollm2_path, draft)
    except OSError:  # another file system
        shutil.copyfile(smollm2_path, draft)
    alone = fit.estimate_file(smollm2_path, None, None, available=1)
    pair = fit.estimate_file(smollm2_path, None, None, available=1, draft=draft)
    limit = int((alone.total_bytes + pair.total_bytes) / 2 / fit.TIGHT_FRACTION)
    with_draft = fit.default_context_file(smollm2_path, None, limit, draft=draft)
    assert fit.default_context_file(smollm2_path, None, limit) == alone.ctx > with_draft
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, str(limit))

    ask = ["-q", "ask", str(smollm2_path), "--question", "Hi", "--max-tokens", "1", "--json"]
    assert cli.main(ask) == 0
    assert json.loads(capsys.readouterr().out)["ctx"] == alone.ctx
    assert cli.main([*ask, "--draft", str(draft)]) == 0
    assert json.loads(capsys.readouterr().out)["ctx"] == with_draft


def test_info_draft_says_whether_it_can_draft_and_the_pairs_memory(smollm2_path, gemma3_path, capsys,
                                                                   monkeypatch):
    """`omlx info MODEL --draft DRAFT`: the lines without --draft unchanged, then whether DRAFT
    can draft for MODEL (the same vocabulary, or why not: speculate's check) and the pair's
    estimate (fit.estimate's, draft model counted); --json carries the same under "draft"."""
    from engine import cli

    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, "2G")  # the same "available" in every run below
    base = ["info", str(smollm2_path), "--ctx", "2048", "--kv", "full"]
    assert cli.main(base) == 0
    alone = capsys.readouterr().out.splitlines()
    assert not any("draft" in line for line in alone)

    assert cli.main([*base, "--draft", str(smollm2_path)]) == 0  # SmolLM2 drafting for itself
    out = capsys.readouterr().out.splitlines()
    assert out[:len(alone)] == alone  # the model's own lines, as without --draft
    draft_line, pair_line = out[len(alone):]
    assert draft_line.startswith("  draft model    ") and "can draft for it (the same vocabulary)" in draft_line
    assert smollm2_path.name in draft_line
    pair = fit.estimate_file(smollm2_path, 2048, "full", available=1 << 40, draft=smollm2_path)
    assert pair_line.startswith("  with the draft ") and f"draft model {pair.draft_bytes / MiB:,.0f} MiB" in pair_line
    assert f"needs about {pair.total_bytes / MiB:,.0f} MiB" in pair_line

    assert cli.main([*base, "--draft", str(gemma3_path), "--json"]) == 0  # another vocabulary
    data = json.loads(capsys.readouterr().out)
    draft = data["draft"]
    assert draft["can_draft"] is False and draft["file"] == str(gemma3_path)
    assert draft["reason"] == f"the draft model {draft['name']} does not have {data['name']}'s vocabulary"
    pair = fit.estimate_file(smollm2_path, 2048, "full", available=1 << 40, draft=gemma3_path)
    assert draft["fit"]["draft_bytes"] == pair.draft_bytes
    assert draft["fit"]["total_bytes"] == data["fit"]["total_bytes"] + pair.draft_bytes
    assert cli.main([*base, "--json"]) == 0
    assert "draft" not in json.loads(capsys.readouterr().out)
    assert cli.main([*base, "--draft", str(gemma3_path)]) == 0
    assert "cannot draft for it: the draft model Gemma" in capsys.readouterr().out
