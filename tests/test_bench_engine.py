"""`moray bench engine` end to end on the tiny preset with tiny settings: every JSON field present and sane.

No timing assertions: the development machines are shared and noisy; the figures only have to be
positive, finite and consistent with each other.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main as moray_main
from workers.models.make_model import PRESETS, make_model

ROOT = Path(__file__).resolve().parent.parent
RUNS, STEPS, PROMPT, PREFILL, BATCHES = 2, 2, 8, 16, (1, 2)
BYTE_KINDS = {"attention", "norms", "dense_mlp", "router", "shared_expert", "experts", "lm_head", "embedding", "kv", "total"}


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp("bench")
    model = make_model(tmp / "tiny", "qwen3_moe", "tiny", seed=0)
    out = tmp / "engine.json"
    batches = ",".join(map(str, BATCHES))
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "engine", "--model", str(model), "--json", str(out),
         "--runs", str(RUNS), "--decode-steps", str(STEPS), "--prompt-len", str(PROMPT), "--prefill-len", str(PREFILL),
         "--batches", batches, "--roofline-batches", batches, "--compare-batches", batches, "--bandwidth-mib", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stderr


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
        assert positive(split["step_ms"]) and positive(split["device_ms"])


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


def test_missing_transformers_is_reported(monkeypatch):
    from bench import engine

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    runner, status = engine._load_transformers(Path("unused"), "float32", 1)
    assert runner is None and status["available"] is False and "not installed" in status["reason"]


def test_bad_arguments_exit_2(tmp_path, capsys):
    rc = moray_main(["bench", "engine", "--model", str(tmp_path), "--json", str(tmp_path / "o.json"), "--batches", "1,8", "--roofline-batches", "16"])
    assert rc == 2 and "must also be in --batches" in capsys.readouterr().err


def test_module_imports_no_jax():
    code = "import sys, bench.engine; assert 'jax' not in sys.modules, 'bench.engine imported jax'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
