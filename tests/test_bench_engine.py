"""`moray bench engine` end to end on the tiny preset with tiny settings: every JSON field present and sane,
for an attention-only model (qwen3_moe) and a hybrid linear-attention one (qwen3_5_moe); and the
`--sizes-only` KV / state figures against hand-computed ones (tiny preset, Qwen3.5-397B-A17B).

No timing assertions: the development machines are shared and noisy; the figures only have to be
positive, finite and consistent with each other.
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from report_harness import check_report

from bench.engine import rate
from cluster.cli import main as moray_main
from kernels import moe
from workers.models.make_model import HYBRID_PRESETS, PRESETS, make_model

ROOT = Path(__file__).resolve().parent.parent
RUNS, STEPS, PROMPT, PREFILL, BATCHES = 2, 2, 8, 16, (1, 2)
BYTE_KINDS = {
    "attention",
    "linear_attention",
    "norms",
    "dense_mlp",
    "router",
    "shared_expert",
    "experts",
    "lm_head",
    "embedding",
    "kv",
    "state",
    "total",
}


def run_bench(tmp: Path, arch: str) -> tuple[dict, str, Path]:
    model = make_model(tmp / "tiny", arch, "tiny", seed=0)
    out = tmp / "engine.json"
    batches = ",".join(map(str, BATCHES))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "bench",
            "engine",
            "--model",
            str(model),
            "--json",
            str(out),
            "--runs",
            str(RUNS),
            "--decode-steps",
            str(STEPS),
            "--prompt-len",
            str(PROMPT),
            "--prefill-len",
            str(PREFILL),
            "--batches",
            batches,
            "--roofline-batches",
            batches,
            "--compare-batches",
            batches,
            "--overhead-batches",
            batches,
            "--bandwidth-mib",
            "8",
            "--report",
            str(tmp / "report"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stderr, model


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, str]:
    data, stderr, _ = run_bench(tmp_path_factory.mktemp("bench"), "qwen3_moe")
    return data, stderr


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> tuple[dict, str, Path]:
    return run_bench(tmp_path_factory.mktemp("bench_hybrid"), "qwen3_5_moe")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_decode_and_prefill(result):
    data, stderr = result
    assert "[bench engine]" in stderr and "run 2/2" in stderr  # progress on stderr
    assert set(data["decode"]) == {str(b) for b in BATCHES}
    for entry in data["decode"].values():
        assert positive(entry["tokens_per_s"]) and positive(entry["step_ms"])
        assert len(entry["samples_tokens_per_s"]) == RUNS and all(map(positive, entry["samples_tokens_per_s"]))
        assert [len(run) for run in entry["step_ms_per_run"]] == [STEPS] * RUNS
    assert data["prefill"]["prompt_len"] == PREFILL
    assert positive(data["prefill"]["tokens_per_s"]) and len(data["prefill"]["samples_tokens_per_s"]) == RUNS
    assert set(data["warmup_s"]) == {"1", "2", "prefill"}
    loads = data["expert_loads"]  # counted by the engine over every step the bench ran
    assert loads["routed_tokens"] > 0 and loads["ep_size"] == 1 and loads["rank_max_over_mean"] == 1.0
    assert all(r >= 1.0 for r in loads["per_layer"]["expert_max_over_mean"])


def test_report(result):
    data, stderr = result
    (line,) = [l for l in stderr.splitlines() if l.startswith("[bench engine] report: ")]
    report = Path(line.rsplit(" and ", 1)[1]).parent  # the progress line names the report's index.html
    assert set(check_report(report, min_plots=2)) == {"roofline.png", "tokens_per_s.png"}
    page = (report / "index.html").read_text()
    assert all(f"roofline.{b}.ratio" in page and f"decode.{b}.tokens_per_s" in page for b in BATCHES)


def test_bandwidth_and_roofline(result):
    data, _ = result
    preset = PRESETS["tiny"]
    bandwidth = data["bandwidth"]
    assert positive(bandwidth["gb_per_s"]) and len(bandwidth["samples_gb_per_s"]) == RUNS * len(BATCHES)
    for b in BATCHES:
        roof = data["roofline"][str(b)]
        assert positive(roof["ratio"]) and len(roof["ratio_samples"]) == RUNS
        assert positive(roof["measured_step_ms"]) and positive(roof["roofline_step_ms"])
        nbytes = roof["bytes"]
        assert set(nbytes) == BYTE_KINDS
        assert nbytes["total"] == sum(v for k, v in nbytes.items() if k != "total")
        assert nbytes["embedding"] == b * preset.hidden_size * 4  # one float32 row per token
        assert nbytes["lm_head"] == preset.vocab_size * preset.hidden_size * 4
        assert nbytes["dense_mlp"] == 0 and nbytes["shared_expert"] == 0  # every tiny layer is MoE
        assert nbytes["linear_attention"] == 0 and nbytes["state"] == 0  # attention only
        # Distinct experts per layer: at least top-k (one token), at most what the batch can select.
        per_layer = roof["experts_per_layer"]
        assert len(per_layer) == preset.num_layers
        assert all(preset.top_k <= n <= min(preset.num_experts, b * preset.top_k) for n in per_layer)
        expert_bytes = 3 * preset.moe_intermediate_size * preset.hidden_size * 4
        assert nbytes["experts"] == pytest.approx(sum(per_layer) * expert_bytes, rel=1e-3)
        # KV: every step reads at least the prompt of each sequence.
        kv_per_token = preset.num_layers * 2 * preset.num_kv_heads * preset.head_dim * 4
        assert nbytes["kv"] >= b * PROMPT * kv_per_token
        split = roof["step_split"]
        assert positive(split["step_ms"]) and positive(split["device_ms"]) and positive(split["sync_step_ms"])
        assert split["host_ms"] == pytest.approx(split["sync_step_ms"] - split["device_ms"], abs=2e-3)
        assert 0 <= split["host_not_hidden_ms"] <= split["step_ms"]
        # Medians over --runs pairs of an asynchronous and a synchronous run (the machine drifts between runs).
        assert len(split["pairs"]) == RUNS
        assert split["step_ms"] == pytest.approx(statistics.median(p["step_ms"] for p in split["pairs"]), abs=2e-3)
        assert split["device_ms"] == pytest.approx(statistics.median(p["device_ms"] for p in split["pairs"]), abs=2e-3)
        assert data["host_overhead"][str(b)] == split
        # The weight reads part by part, with the engine's kernels and with XLA alone.
        parts = data["parts"][str(b)]
        assert set(parts) == {"lm_head", "attention", "experts"}
        assert parts["lm_head"]["bytes"] == nbytes["lm_head"]
        assert parts["attention"]["bytes"] == pytest.approx(nbytes["attention"], rel=0.02)  # less the q/k norms
        assert parts["experts"]["impl"] in moe.IMPLS  # the engine's own choice, named
        assert 0 < parts["experts"]["bytes"] <= preset.num_layers * min(preset.num_experts, b * preset.top_k) * expert_bytes
        for part in parts.values():
            assert positive(part["ms"]) and positive(part["xla_ms"])
            assert part["gb_per_s"] == pytest.approx(part["bytes"] / part["ms"] / 1e6, rel=0.05)  # ms rounded to 0.1 us
    assert data["kv_bytes_per_token"] == preset.num_layers * 2 * preset.num_kv_heads * preset.head_dim * 4
    assert data["state_bytes_per_sequence"] == 0 and data["kv_dtype"] == "float32"
    assert data["layers"] == {
        "num_layers": preset.num_layers,
        "linear_attention": 0,
        "full_attention": preset.num_layers,
        "full_attention_layers": list(range(preset.num_layers)),
    }


# The tiny hybrid preset by hand: 4 layers, every 4th full attention -> layers 0-2 Gated DeltaNet, 3 full.
P, LP = HYBRID_PRESETS["tiny"]
TINY_LINEAR, TINY_FULL = 3, 1
TINY_CONV_DIM = 2 * LP.num_key_heads * LP.head_dim + LP.num_value_heads * LP.head_dim  # q | k | v channels
TINY_KV_PER_TOKEN = TINY_FULL * 2 * P.num_kv_heads * P.head_dim * 4  # float32 K and V, full layers only
TINY_STATE = TINY_LINEAR * 4 * ((LP.conv_kernel_size - 1) * TINY_CONV_DIM + LP.num_value_heads * LP.head_dim**2)


def test_hybrid_tiny_by_hand():
    assert (P.num_layers, LP.full_attention_interval) == (4, 4)
    assert (TINY_CONV_DIM, TINY_KV_PER_TOKEN, TINY_STATE) == (128, 256, 3 * 4 * (3 * 128 + 4 * 16 * 16)) == (128, 256, 16896)


def test_hybrid_decode_prefill_and_sizes(hybrid):
    data, stderr, _ = hybrid
    assert "run 2/2" in stderr and data["model_config"]["model_type"] == "qwen3_5_moe"
    for entry in data["decode"].values():
        assert positive(entry["tokens_per_s"]) and [len(run) for run in entry["step_ms_per_run"]] == [STEPS] * RUNS
    assert positive(data["prefill"]["tokens_per_s"]) and len(data["prefill"]["samples_tokens_per_s"]) == RUNS
    assert data["layers"] == {"num_layers": 4, "linear_attention": 3, "full_attention": 1, "full_attention_layers": [3]}
    assert data["kv_bytes_per_token"] == TINY_KV_PER_TOKEN
    assert data["state_bytes_per_sequence"] == TINY_STATE
    hf = data["transformers"]
    assert hf["available"] is True
    for b in BATCHES:
        assert positive(hf["ratio"][str(b)]) and len(hf["decode"][str(b)]["samples_tokens_per_s"]) == RUNS


def test_hybrid_roofline(hybrid):
    data, _, _ = hybrid
    h = P.hidden_size
    # Gated DeltaNet weights of one layer: qkvz, ba, the depthwise conv, dt_bias, A_log, the gated norm, out.
    value_dim = LP.num_value_heads * LP.head_dim
    linear_layer = (
        (TINY_CONV_DIM + value_dim) * h
        + 2 * LP.num_value_heads * h
        + TINY_CONV_DIM * LP.conv_kernel_size
        + 2 * LP.num_value_heads
        + LP.head_dim
        + h * value_dim
    )
    # Gated attention: q (query | gate) k v, o, q/k norms.
    q_size, kv_size = P.num_heads * P.head_dim, P.num_kv_heads * P.head_dim
    attention_layer = (2 * q_size + 2 * kv_size) * h + h * q_size + 2 * P.head_dim
    for b in BATCHES:
        roof = data["roofline"][str(b)]
        assert positive(roof["ratio"]) and len(roof["ratio_samples"]) == RUNS
        nbytes = roof["bytes"]
        assert set(nbytes) == BYTE_KINDS
        assert nbytes["total"] == sum(v for k, v in nbytes.items() if k != "total")
        assert nbytes["linear_attention"] == TINY_LINEAR * linear_layer * 4 > 0
        assert nbytes["attention"] == TINY_FULL * attention_layer * 4
        assert nbytes["state"] == 2 * TINY_STATE * b > 0  # read and written once per sequence per step
        # KV of the one full-attention layer: at least the prompt of each sequence, at most the whole run.
        assert b * PROMPT * TINY_KV_PER_TOKEN <= nbytes["kv"] <= b * (PROMPT + STEPS + 4) * TINY_KV_PER_TOKEN
        per_layer = roof["experts_per_layer"]  # every layer, linear or not, is MoE
        assert len(per_layer) == P.num_layers
        assert all(P.top_k <= n <= min(P.num_experts, b * P.top_k) for n in per_layer)
        assert nbytes["experts"] == pytest.approx(sum(per_layer) * 3 * P.moe_intermediate_size * h * 4, rel=1e-3)
        assert nbytes["shared_expert"] > 0 and nbytes["dense_mlp"] == 0


def sizes_only(capsys, *args) -> dict:
    assert moray_main(["bench", "engine", "--sizes-only", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_sizes_only_qwen3_5_397b(capsys, tmp_path):
    data = sizes_only(capsys, "--preset", "qwen3.5-397b")
    # 60 layers, every 4th full attention: 45 Gated DeltaNet + 15 full.
    assert data["layers"]["linear_attention"] == 45 and data["layers"]["full_attention"] == 15
    assert data["layers"]["full_attention_layers"] == list(range(3, 60, 4))
    # bf16 K and V: 15 layers x 2 x 2 KV heads x 256 x 2 B = 30 KiB per token.
    assert data["kv_dtype"] == "bfloat16" and data["kv_bytes_per_token"] == 15 * 2 * 2 * 256 * 2 == 30720
    # float32 per linear layer: conv [3, 2 x 16 x 128 + 64 x 128] + recurrent [64, 128, 128].
    conv, recurrent = 3 * (2 * 16 * 128 + 64 * 128) * 4, 64 * 128 * 128 * 4
    assert data["state_bytes_per_layer"] == {"conv": conv, "recurrent": recurrent}
    assert data["state_bytes_per_sequence"] == 45 * (conv + recurrent) == 195_379_200  # ~186 MiB
    assert data["conv_state_shape"] == [3, 12288] and data["recurrent_state_shape"] == [64, 128, 128]
    # The same from a config.json file, and in float32 KV; --json gets a copy.
    from bench.sizes import QWEN3_5_397B_A17B

    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_5_397B_A17B))
    again = sizes_only(capsys, "--config", str(path), "--dtype", "float32", "--json", str(tmp_path / "s.json"))
    assert again["kv_bytes_per_token"] == 2 * 30720 and again["state_bytes_per_sequence"] == 195_379_200
    assert json.loads((tmp_path / "s.json").read_text()) == again


def test_sizes_only_deepseek_v3_counts_one_latent_row_per_layer(capsys):
    data = sizes_only(capsys, "--preset", "deepseek-v3")
    # MLA: 61 layers x (kv_lora_rank 512 + rope 64) x 2 B (bf16) = 68.6 KiB per token, no head axis.
    assert data["kv_bytes_per_token"] == 61 * (512 + 64) * 2 == 70272
    assert data["state_bytes_per_sequence"] == 0 and data["layers"]["full_attention"] == 61


@pytest.mark.parametrize(
    "preset,params,sliding,full",
    # (published parameters, sliding layers' 2*Hkv*D, full layers' with attention_k_eq_v's global KV heads)
    [("gemma4-31b", 30.7e9, 2 * 16 * 256, 2 * 4 * 512), ("gemma4-26b-a4b", 25.2e9, 2 * 8 * 256, 2 * 2 * 512)],
)
def test_sizes_only_gemma4_weights_and_window_rule(capsys, preset, params, sliding, full):
    data = sizes_only(capsys, "--preset", preset)
    layers = data["layers"]["num_layers"]
    n_full = layers // 6
    assert data["kv_bytes_per_token"] == 2 * ((layers - n_full) * sliding + n_full * full)
    assert abs(data["weight_bytes"]["bfloat16"] / 2 - params) < 0.02 * params  # the published size
    for context in ("8192", "131072"):
        kv = data["kv_per_sequence"][context]
        assert kv["all_blocks_gib"] * 2**30 == int(context) * data["kv_bytes_per_token"]
        # Sliding layers hold (1024 / 16 + 1) blocks of 16 tokens; full layers every token.
        held = 2 * ((layers - n_full) * sliding * 65 * 16 + n_full * full * int(context))
        assert kv["window_rule_gib"] * 2**30 == held
    if preset == "gemma4-31b":  # the seeds' 21.67 GiB on one v6e chip holds these weights and ~3.7 GiB more
        assert 17 < data["weight_gib"]["w4a16"] < 19


def test_sizes_only_matches_the_bench(capsys, hybrid):
    data, _, model = hybrid
    sizes = sizes_only(capsys, "--model", str(model), "--dtype", "float32")
    assert sizes["kv_bytes_per_token"] == data["kv_bytes_per_token"] == TINY_KV_PER_TOKEN
    assert sizes["state_bytes_per_sequence"] == data["state_bytes_per_sequence"] == TINY_STATE
    assert sizes["layers"] == data["layers"]
    assert sizes["state_equals_kv_tokens"] == TINY_STATE / TINY_KV_PER_TOKEN


def test_sizes_only_bad_arguments(tmp_path, capsys):
    assert moray_main(["bench", "engine", "--sizes-only", "--preset", "qwen3.5-397b", "--config", str(tmp_path)]) == 2
    assert "exactly one of" in capsys.readouterr().err
    assert moray_main(["bench", "engine", "--model", str(tmp_path)]) == 2
    assert "--json are required" in capsys.readouterr().err
    assert moray_main(["bench", "engine", "--preset", "qwen3.5-397b", "--model", str(tmp_path), "--json", "x"]) == 2
    assert "--sizes-only" in capsys.readouterr().err
    assert moray_main(["bench", "engine", "--sizes-only", "--config", str(tmp_path / "missing.json")]) == 1


def test_transformers_side_by_side_and_metadata(result):
    data, _ = result
    hf = data["transformers"]
    assert hf["available"] is True and hf["transformers_version"] and hf["torch_threads"] == data["threads"]
    for b in BATCHES:
        assert positive(hf["ratio"][str(b)]) and len(hf["paired_ratio_samples"][str(b)]) == RUNS
        assert len(hf["decode"][str(b)]["samples_tokens_per_s"]) == RUNS
    assert data["threads"] >= 1 and data["dtype"] == "float32"
    assert data["versions"]["jax"] and data["versions"]["transformers"] == hf["transformers_version"]
    assert data["settings"]["runs"] == RUNS and data["settings"]["bandwidth_bytes"] > 0
    assert set(data["targets"]["met"]) >= {"roofline_ratio_b1", "transformers_ratio_b1"}
    assert len(data["load_average"]["start"]) == 3


def test_llama_cpp_side_by_side(result):
    data, _ = result
    peer = data["llama_cpp"]
    if importlib.util.find_spec("llama_cpp") is None:
        assert peer["available"] is False and "not installed" in peer["reason"]
        return
    assert peer["available"] is True and peer["gguf_bytes"] > 0 and peer["threads"] == data["threads"]
    for b in BATCHES:
        assert positive(peer["ratio"][str(b)]) and len(peer["paired_ratio_samples"][str(b)]) == RUNS
    assert set(data["targets"]["met"]) >= {"llama_cpp_ratio_b1"}
    # Its prefill of the same prompts, beside ours.
    assert peer["prefill"]["prompt_len"] == PREFILL and len(peer["prefill"]["samples_tokens_per_s"]) == RUNS
    assert positive(peer["prefill"]["tokens_per_s"])


def test_gguf_export_runs_the_same_model_in_llama_cpp(tmp_path):
    """The GGUF file llama.cpp is measured on holds the same model: its greedy tokens equal the engine's
    (4 sequences decoded together)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is a bench extra")
    import argparse

    from bench.engine import _load_llama_cpp
    from workers.engine import LLM, SamplingParams

    model = make_model(tmp_path / "tiny", "qwen3_moe", "tiny", seed=3)
    prompts = [[5 + i, 17, 33, 99 + i, 7, 8, 250, 3] for i in range(4)]
    args = argparse.Namespace(model=model, dtype="float32", compare_batches=[4], prompt_len=8, decode_steps=6, prefill_len=16)
    runner, status = _load_llama_cpp(args, 2)
    assert status["available"], status
    try:
        theirs = runner.decode(prompts, 6)["tokens"]
    finally:
        runner.close()
    llm = LLM(model=str(model), dtype="float32", warmup=False, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    ours = llm.generate(prompts, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in ours] == theirs


def test_gguf_export_refuses_what_it_cannot_write(tmp_path):
    pytest.importorskip("gguf", reason="gguf is a bench extra")
    from bench.gguf_export import export_gguf

    model = make_model(tmp_path / "hybrid", "qwen3_5_moe", "tiny", seed=0)
    with pytest.raises(ValueError, match="qwen3_moe only, not 'qwen3_5_moe'"):
        export_gguf(model, tmp_path / "x.gguf")


def test_missing_transformers_is_reported(monkeypatch):
    from bench import engine

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    runner, status = engine._load_transformers(Path("unused"), "float32", 1)
    assert runner is None and status["available"] is False and "not installed" in status["reason"]


def test_bad_arguments_exit_2(tmp_path, capsys):
    rc = moray_main(
        ["bench", "engine", "--model", str(tmp_path), "--json", str(tmp_path / "o.json"), "--batches", "1,8", "--roofline-batches", "16"]
    )
    assert rc == 2 and "must also be in --batches" in capsys.readouterr().err


def test_module_imports_no_jax():
    code = "import sys, bench.engine; assert 'jax' not in sys.modules, 'bench.engine imported jax'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_part_rates_keep_three_significant_digits():
    """A slow part's GB/s keeps its precision (two decimals made 0.0264 read 0.03: the part test above failed
    on a loaded machine); a fast one is not padded with noise digits."""
    assert rate(26_356, 1.0) == 0.0264
    assert rate(1e9, 1.0) == 1000.0
    assert rate(123_456_789, 1.0) == 123.0
