"""The `omlx` command line as external checks call it: output formats are a contract."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from .conftest import DATA, reference_json, reference_npz_path

pytestmark = pytest.mark.slow  # a Python process loading a real model per test

SMOL = "smollm2-135m-instruct"


def omlx(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        capture_output=True, text=True, timeout=600, input=stdin, env=env,
    )
    return proc


@pytest.fixture(scope="module", autouse=True)
def _models(smollm2_path, gemma3_path):
    """Both catalog models are fetched before the CLI is called by name."""


@pytest.mark.parametrize("name", [SMOL, "gemma3-270m"])
def test_tokenize_prints_reference_ids(name):
    ref = reference_json(name)
    cases = ref["tokenize"]
    for case in (cases[0], cases[18], cases[19], cases[11]):
        plain = omlx("tokenize", name, case["text"])
        assert plain.returncode == 0, plain.stderr
        assert json.loads(plain.stdout) == case["ids_plain"]
        both = omlx("tokenize", name, case["text"], "--special", "--bos")
        assert json.loads(both.stdout) == case["ids_bos_special"]


def test_tokenize_accepts_a_path(smollm2_path):
    proc = omlx("tokenize", str(smollm2_path), "Hello world")
    assert json.loads(proc.stdout) == [19556, 905]


def test_generate_json_contract_and_greedy_reference():
    case = reference_json(SMOL, f32=True)["greedy_raw"][0]
    proc = omlx("generate", SMOL, "--prompt", case["prompt"], "--max-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"ids", "text", "stats"}
    assert set(out["stats"]) >= {"prompt_tokens", "ttft_s", "decode_tok_s", "peak_rss_bytes", "kv_bytes"}
    assert out["ids"] == case["ids"][:16]
    assert out["text"] == "".join(case["text"])[: len(out["text"])]
    assert out["stats"]["prompt_tokens"] == len(case["prompt_ids"])
    assert out["stats"]["peak_rss_bytes"] > 50 * 2**20
    assert out["stats"]["kv_bytes"] > 0 and out["stats"]["ttft_s"] > 0


def test_generate_chat_streams_text_and_stops_at_end_of_turn():
    case = reference_json(SMOL, f32=True)["greedy_chat"][0]
    proc = omlx("generate", SMOL, "--prompt", case["user"], "--chat", "--max-tokens", "200", "--json")
    out = json.loads(proc.stdout)
    assert out["finish_reason"] == "stop"
    assert out["ids"][:16] == case["ids"][:16]
    streamed = omlx("generate", SMOL, "--prompt", case["user"], "--chat", "--max-tokens", "200")
    assert streamed.stdout.strip() == out["text"].strip()


def test_generate_sampling_is_seeded():
    args = ("generate", SMOL, "--prompt", "Once upon a time", "--max-tokens", "12", "--temperature", "0.9",
            "--seed", "7", "--json")
    a, b = json.loads(omlx(*args).stdout), json.loads(omlx(*args).stdout)
    assert a["ids"] == b["ids"]
    c = json.loads(omlx(*args[:-3], "--seed", "8", "--json").stdout)
    assert c["ids"] != a["ids"]


def test_generate_rejects_chat_for_a_base_model():
    proc = omlx("generate", "gemma3-270m", "--prompt", "hi", "--chat")
    assert proc.returncode == 2 and "no chat template" in proc.stderr


def test_logprobs_writes_the_reference_format(tmp_path):
    out = tmp_path / "lp.npz"
    proc = omlx("logprobs", SMOL, "--text-file", str(DATA / "texts" / "gpl-3.txt"), "--n-tokens", "64",
                "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    ours, ref = np.load(out), np.load(reference_npz_path(SMOL, "gpl-3", f32=True))
    assert set(ours.files) == {"tokens", "top_ids", "top_logprobs", "next_logprob"}
    assert ours["tokens"].dtype == np.int32 and ours["tokens"].shape == (65,)
    assert ours["top_ids"].dtype == np.int32 and ours["top_ids"].shape == (64, 32)
    assert ours["top_logprobs"].dtype == np.float32 and ours["top_logprobs"].shape == (64, 32)
    assert ours["next_logprob"].dtype == np.float32 and ours["next_logprob"].shape == (64,)
    np.testing.assert_array_equal(ours["tokens"], ref["tokens"][:65])
    assert np.mean(ours["top_ids"][:, 0] == ref["top_ids"][:64, 0]) >= 0.98
    assert np.mean(np.abs(ours["next_logprob"] - ref["next_logprob"][:64])) < 0.01


def test_logprobs_text_too_short(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Just a few words.")
    proc = omlx("logprobs", SMOL, "--text-file", str(short), "--n-tokens", "100", "--out", str(tmp_path / "x.npz"))
    assert proc.returncode == 2 and "fewer than --n-tokens + 1" in proc.stderr


def test_models_list_path_and_fetch_prints_path(smollm2_path):
    listed = omlx("models", "list")
    assert SMOL in listed.stdout and "gemma3-270m" in listed.stdout and "(default)" in listed.stdout
    path = omlx("models", "path", SMOL)
    assert path.stdout.strip() == str(smollm2_path)
    fetched = omlx("models", "fetch", SMOL)  # already present: verifies and prints the path
    assert fetched.returncode == 0
    assert fetched.stdout.strip().splitlines()[-1] == str(smollm2_path)


def test_info_json():
    out = json.loads(omlx("info", "gemma3-270m", "--json").stdout)
    assert out["architecture"] == "gemma3" and out["layers"] == 18 and out["kv_heads"] == 1
    assert out["kv_bytes_per_token_f16"] == 18 * 1 * (256 + 256) * 2
    assert out["chat_template"] is False
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"} <= set(out["tensor_types"])


def test_chat_in_the_terminal():
    proc = omlx("chat", SMOL, "--max-tokens", "24", stdin="What is 2+2?\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) > 0
    assert "tok/s" in proc.stderr


def test_kv_estimate_7b_geometry():
    proc = omlx("kv-estimate", "--layers", "32", "--kv-heads", "32", "--head-dim", "128", "--ctx", "32768",
                "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["spec"]: r for r in json.loads(proc.stdout)["rows"]}
    assert abs(rows["full"]["bytes"] / 2**30 - 16) < 0.1
    assert rows["balanced"]["bytes"] <= 5.6 * 2**30
    assert rows["memory-saver"]["bytes"] < rows["balanced"]["bytes"] < rows["high-precision"]["bytes"]


def test_kv_estimate_needs_geometry():
    proc = omlx("kv-estimate", "--layers", "32", "--ctx", "100")
    assert proc.returncode == 2 and "--kv-heads" in proc.stderr and "--head-dim" in proc.stderr


def test_kv_sim_measures_what_the_formula_says():
    proc = omlx("kv-sim", "gemma3-270m", "--ctx", "1024", "--kv", "k4v4,0-3:k8v8", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert {r["spec"] for r in rows} == {"high-precision", "balanced", "memory-saver", "full", "k4v4,0-3:k8v8"}
    for r in rows:
        assert abs(r["ratio"] - 1) < 0.01, r
        assert r["allocated"] >= r["measured"]


def test_kv_flag_is_validated_with_a_suggestion():
    proc = omlx("generate", SMOL, "--prompt", "hi", "--kv", "balancd")
    assert proc.returncode == 2 and "balanced" in proc.stderr
    proc = omlx("generate", SMOL, "--prompt", "hi", "--kv", "k7v4")
    assert proc.returncode == 2 and "7" in proc.stderr


def test_generate_kv_changes_kv_bytes():
    sizes = {}
    for spec in ("full", "k4v4"):
        proc = omlx("generate", SMOL, "--prompt", "The capital of France is", "--max-tokens", "40", "--kv", spec,
                    "--json")
        assert proc.returncode == 0, proc.stderr
        sizes[spec] = json.loads(proc.stdout)["stats"]["kv_bytes"]
        assert "KV cache" in proc.stderr  # the per-layer scheme is logged at load
    assert sizes["k4v4"] < sizes["full"]


def test_eval_kv_prints_each_spec():
    proc = omlx("eval-kv", SMOL, "--text-file", str(DATA / "texts" / "gpl-3.txt"), "--n-tokens", "96",
                "--kv", "k8v8", "--kv", "k2v2", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["spec"] for r in rows] == ["k8v8", "k2v2"]
    assert rows[0]["mean_kl"] < rows[1]["mean_kl"]
    assert all(r["perplexity"] > 1 and r["kv_bytes"] > 0 for r in rows)


KV_COMMANDS = {  # every command taking --kv, with the arguments it needs to parse
    "tokenize": ["m", "text"],
    "info": ["m"],
    "generate": ["m", "--prompt", "hi"],
    "logprobs": ["m", "--text-file", "t", "--n-tokens", "1", "--out", "o"],
    "chat": [],
    "ask": [],
    "bench": [],
    "eval-kv": ["m", "--text-file", "t"],
    "kv-estimate": ["--ctx", "10"],
    "kv-sim": ["--ctx", "10"],
}
SEVERAL = {"bench", "eval-kv", "kv-estimate", "kv-sim"}   # --kv repeatable: specs besides each other


@pytest.fixture
def llama_file(tmp_path):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"cache_type_k": "q8_0", "cache_type_v": "q4_0", "layers": {"-1": "f16"}}))
    return str(path)


@pytest.mark.parametrize("command", sorted(KV_COMMANDS))
def test_kv_config_file_on_every_kv_command(command, llama_file, tmp_path, capsys):
    from engine.cli import build_parser

    parser = build_parser()
    args = parser.parse_args([command, *KV_COMMANDS[command], "--kv-config", llama_file])
    spec = "k8v4,-1:k16v16"
    assert args.kv == ([spec] if command in SEVERAL else spec)
    if command in SEVERAL:
        toml = tmp_path / "kv.toml"
        toml.write_text('kv = "memory-saver"\n')
        args = parser.parse_args([command, *KV_COMMANDS[command], "--kv-config", llama_file,
                                  "--kv-config", str(toml)])
        assert args.kv == [spec, "k4v4"]
    else:  # without the option, --kv's default stands
        assert parser.parse_args([command, *KV_COMMANDS[command]]).kv in (None, "full")
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([command, *KV_COMMANDS[command], "--kv", "k4v4", "--kv-config", llama_file])
    assert exit_.value.code == 2
    assert "--kv-config: not allowed with argument --kv" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, needles",
    [
        ({"cache_typ_k": "q8_0"}, ["unknown setting 'cache_typ_k'", "did you mean 'cache_type_k'?"]),
        ({"cache_type_v": "q4_O"}, ["cache_type_v: 'q4_O' is not a supported cache type", "did you mean 'q4_0'?"]),
        ({"k_bits": 7}, ["k_bits: 7 bits is not a supported K precision", "did you mean 8?"]),
    ],
)
def test_kv_config_errors_are_messages_not_tracebacks(tmp_path, content, needles):
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(content))
    proc = omlx("kv-estimate", "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--ctx", "100",
                "--kv-config", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"argument --kv-config: {path}: " in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    missing = omlx("info", "gemma3-270m", "--kv-config", str(tmp_path / "nowhere.toml"))
    assert missing.returncode == 2 and "no such settings file" in missing.stderr and "Traceback" not in missing.stderr


def test_kv_config_file_sets_the_cache(tmp_path, llama_file):
    estimate = omlx("kv-estimate", "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--ctx", "1000",
                    "--kv-config", llama_file, "--json")
    assert estimate.returncode == 0, estimate.stderr
    rows = {r["spec"]: r for r in json.loads(estimate.stdout)["rows"]}
    by_spec = json.loads(omlx("kv-estimate", "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--ctx",
                              "1000", "--kv", "k8v4,-1:f16", "--json").stdout)["rows"]
    assert rows["k8v4,-1:k16v16"]["bytes"] == by_spec[-1]["bytes"]

    info = json.loads(omlx("info", "gemma3-270m", "--kv-config", llama_file, "--json").stdout)
    assert info["kv_spec"] == "k8v4,-1:k16v16"

    toml = tmp_path / "kv.toml"
    toml.write_text('[kv]\ntype_k = "q4_0"\ntype_v = "q4_0"\n')
    proc = omlx("generate", SMOL, "--prompt", "The capital of France is", "--max-tokens", "8",
                "--kv-config", str(toml), "--json")
    assert proc.returncode == 0, proc.stderr
    assert "KV cache k4v4" in proc.stderr                    # the scheme logged at load
    assert json.loads(proc.stdout)["stats"]["kv_bytes"] > 0
