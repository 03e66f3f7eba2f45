"""Multi-token-prediction heads (workers/models/mtp.py) against transformers.

transformers has no MTP module (it skips `mtp.*` and DeepSeek's extra layer), so the reference is built from
what it does have: the head's decoder layer and norm, copied into a one-layer model of the same family
(the target's embedding and LM head beside them), run by transformers on the head's input computed here in
torch from the stored `enorm` / `hnorm` / `eh_proj` (`fc`), with the target's last hidden state from
transformers' own run of the target."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from engine_harness import ENGINE_ARGS, kv_handoff, prompts
from safetensors.numpy import load_file, save_file

from workers.engine import LLM, EngineConfig, EngineCore, SamplingParams
from workers.models import load_model
from workers.models import mtp as mtp_head
from workers.models.config import ModelLoadError
from workers.models.layers import KVCache
from workers.models.make_model import make_model

ARCHS = ["deepseek_v3", "qwen3_5_moe"]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    return request.param, make_model(tmp_path_factory.mktemp(f"mtp-{request.param}") / "m", request.param, "tiny", seed=3, mtp=True)


def stored(model_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def reference_dir(arch: str, model_dir: Path, out: Path) -> Path:
    """A one-layer checkpoint of the family holding the head's layer and norm, the target's embedding and head."""
    raw = json.loads((model_dir / "config.json").read_text())
    tensors = stored(model_dir)
    out.mkdir()
    if arch == "deepseek_v3":
        n = raw["num_hidden_layers"]
        layer = f"model.layers.{n}."
        own = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
        picked = {
            "model.layers.0." + k[len(layer) :]: v
            for k, v in tensors.items()
            if k.startswith(layer) and not k[len(layer) :].startswith(own)
        }
        picked["model.norm.weight"] = tensors[f"{layer}shared_head.norm.weight"]
        picked["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        picked["lm_head.weight"] = tensors["lm_head.weight"]
        cfg = {**raw, "num_hidden_layers": 1, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0}
    else:
        text = raw["text_config"]
        picked = {"model.layers.0." + k[len("mtp.layers.0.") :]: v for k, v in tensors.items() if k.startswith("mtp.layers.0.")}
        picked["model.norm.weight"] = tensors["mtp.norm.weight"]
        picked["model.embed_tokens.weight"] = tensors["model.language_model.embed_tokens.weight"]
        if "lm_head.weight" in tensors:
            picked["lm_head.weight"] = tensors["lm_head.weight"]
        cfg = {
            **text,
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "num_hidden_layers": 1,
            "layer_types": ["full_attention"],
            "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        }
        cfg.pop("mtp_num_hidden_layers", None)
    save_file(picked, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def rms(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * (1 + w if zero_centred else w)


def reference(arch: str, model_dir: Path, ref_dir: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(the target's last hidden state [T, H], the head's logits [T - 1, vocab]) by transformers: position i
    reads h_i and the token at i + 1."""
    tensors = {k: torch.from_numpy(v) for k, v in stored(model_dir).items()}
    target = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    raw = json.loads((model_dir / "config.json").read_text())
    with torch.no_grad():
        hidden = target.model(torch.tensor([ids])).last_hidden_state[0]
        if arch == "deepseek_v3":
            p = f"model.layers.{raw['num_hidden_layers']}."
            enorm, hnorm, proj = tensors[p + "enorm.weight"], tensors[p + "hnorm.weight"], tensors[p + "eh_proj.weight"]
            eps, zc = raw["rms_norm_eps"], False
            embed = tensors["model.embed_tokens.weight"]
        else:
            enorm, hnorm, proj = (
                tensors["mtp.pre_fc_norm_embedding.weight"],
                tensors["mtp.pre_fc_norm_hidden.weight"],
                tensors["mtp.fc.weight"],
            )
            eps, zc = raw["text_config"]["rms_norm_eps"], True
            embed = tensors["model.language_model.embed_tokens.weight"]
        e = embed[torch.tensor(ids[1:])].clone()
        if arch == "deepseek_v3":
            e[0] = 0  # vLLM's DeepSeek MTP: no embedding at position 0
        x = torch.cat([rms(e, enorm, eps, zc), rms(hidden[:-1], hnorm, eps, zc)], -1) @ proj.T
        logits = head(inputs_embeds=x[None], position_ids=torch.arange(len(ids) - 1)[None]).logits[0]
    return hidden.numpy(), logits.numpy()


def test_the_head_equals_its_layer_run_by_transformers(checkpoint, tmp_path):
    arch, model_dir = checkpoint
    ids = [5, 17, 42, 8, 99, 3, 64, 21, 7, 250, 11, 30]
    want_hidden, want_logits = reference(arch, model_dir, reference_dir(arch, model_dir, tmp_path / "ref"), ids)
    target = load_model(model_dir, show_progress=False)
    head = mtp_head.load(model_dir, target.family, target.cfg, target.mesh, target.dtype)
    tokens, positions = np.array([ids]), np.arange(len(ids))[None]
    _, _, hidden = target.family.forward(target.weights, target.cfg, tokens, positions, target.new_cache(1, len(ids)), hidden_out="normed")
    np.testing.assert_allclose(np.asarray(hidden)[0], want_hidden, atol=2e-4, rtol=0)
    cache = KVCache.zeros(head.cfg, 1, len(ids), target.dtype)
    logits, _, chained = head.forward(target.weights, tokens[:, 1:], positions[:, :-1], hidden[:, :-1], cache)
    np.testing.assert_allclose(np.asarray(logits)[0], want_logits, atol=2e-4, rtol=0)
    assert chained.shape == hidden[:, :-1].shape


def test_a_checkpoint_without_the_head_is_refused_by_name(tmp_path):
    plain = make_model(tmp_path / "plain", "deepseek_v3", "tiny", seed=1)
    target = load_model(plain, show_progress=False)
    with pytest.raises(ModelLoadError, match="num_nextn_predict_layers is 0"):
        mtp_head.load(plain, target.family, target.cfg, target.mesh, target.dtype)
    raw = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.\d+\.(enorm|hnorm|eh_proj)"):
        mtp_head.load(plain, target.family, target.cfg, target.mesh, target.dtype)


# ---------------------------------------------------------------------------------------------
# The engine's speculative method mtp (workers/engine/mtp_proposer.py).

ENGINE = {**ENGINE_ARGS, "warmup": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def test_greedy_output_with_mtp_equals_greedy_output_without(checkpoint):
    """A mixed batch (prompts longer than a step's budget: chunked prefill) decodes the same tokens with the
    head proposing 3 drafts a step as without speculation, and the head did propose."""
    _, model_dir = checkpoint
    batch = prompts(6, seed=11, lo=5, hi=90)
    plain = LLM(str(model_dir), **ENGINE).generate(batch, GREEDY)
    llm = LLM(str(model_dir), speculative={"method": "mtp", "num_speculative_tokens": 3}, **ENGINE)
    spec = llm.generate(batch, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_a_disaggregated_decode_engine_speculates_with_the_head(checkpoint):
    """Prefill on one engine, KV handoff, decode with the head proposing on another: the colocated greedy
    tokens, drafts proposed (the head has not seen the prompt: it starts from the decode steps), and every
    block back in the pool."""
    _, model_dir = checkpoint
    batch = prompts(3, seed=6, lo=8, hi=40)
    want = [o.token_ids for o in LLM(str(model_dir), **ENGINE).generate(batch, GREEDY)]
    prefill = EngineCore(EngineConfig(model=str(model_dir), worker_id="p", **ENGINE), show_progress=False)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    decode = EngineCore(EngineConfig(model=str(model_dir), worker_id="d", speculative=spec, **ENGINE), show_progress=False)
    for i, p in enumerate(batch):
        _, whole, _ = kv_handoff(prefill, decode, f"r{i}", p, GREEDY)
        assert whole[0].token_ids == want[i]
    assert decode.speculator.stats.num_draft_tokens > 0
    assert decode.kv.num_free_blocks == decode.kv.pool.num_blocks


def reference_drafts(target, head, known: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after `known`, run on one contiguous cache: positions 0..n-2 read the
    target's hidden states and the true next tokens; then each chained position its own last draft."""
    n = len(known)
    _, _, hidden = target.family.forward(
        target.weights, target.cfg, np.array([known[:-1]]), np.arange(n - 1)[None], target.new_cache(1, n), hidden_out="normed"
    )
    cache = KVCache.zeros(head.cfg, 1, n + k, target.dtype)
    logits, cache, chained = head.forward(target.weights, np.array([known[1:]]), np.arange(n - 1)[None], hidden, cache)
    drafts = [int(np.argmax(np.asarray(logits)[0, -1]))]
    last = chained[:, -1:]
    for j in range(1, k):
        logits, cache, last = head.forward(target.weights, np.array([[drafts[-1]]]), np.array([[n - 2 + j]]), last, cache)
        drafts.append(int(np.argmax(np.asarray(logits)[0, -1])))
    return drafts


def test_the_heads_drafts_follow_the_accepted_tokens(checkpoint):
    """Every proposal equals the head run offline on the request's true tokens, also after steps that
    accepted several drafts and after steps run without speculation (two steps of three run plain: the head
    catches up on them at the next proposal): the proposer is made to verify the true
    continuation (so every draft is accepted) and the head's own drafts are recorded; the head's KV written
    by chained steps at unknown tokens is rewritten, and output stays the plain greedy tokens."""
    _, model_dir = checkpoint
    prompt = prompts(1, seed=5, lo=20, hi=30)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)  # (the offline reference runs eagerly)
    plain = LLM(str(model_dir), **ENGINE).generate([prompt], greedy)[0].token_ids
    truth = prompt + list(plain)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(model_dir), speculative=spec, **ENGINE)
    speculator = llm.engine.speculator
    proposer, seen = speculator.proposer, []
    heads_own = proposer.propose_all

    def true_continuation(wanted):
        drafts = heads_own(wanted)
        seen.extend((list(r.all_token_ids), d) for (r, _), d in zip(wanted, drafts))
        return [truth[r.num_tokens : r.num_tokens + len(d)] for (r, _), d in zip(wanted, drafts)]

    proposer.propose_all = true_continuation
    speculator.wants = lambda batch: llm.engine._step_counter % 3 == 0
    assert llm.generate([prompt], greedy)[0].token_ids == plain
    assert speculator.stats.num_accepted_tokens >= speculator.stats.num_draft_tokens - 3 > 0  # all but the last overshoot
    assert len(seen) >= 2 and all(d for _, d in seen)
    for known, drafts in seen:
        assert drafts == reference_drafts(llm.engine.model, proposer.head, known, len(drafts)), len(known)


def test_the_heads_view_of_a_request_is_its_tokens_shifted_by_one_then_the_drafts():
    from workers.engine.mtp_proposer import _HeadTokens

    tokens, drafts = [10, 11, 12, 13], [20, 21]
    view, want = _HeadTokens(tokens, drafts), tokens[1:] + drafts
    assert len(view) == len(want) and [view[i] for i in range(len(want))] == want
    for start in range(len(want) + 1):
        for stop in range(start, len(want) + 2):
            assert view[start:stop] == want[start:stop]


def test_a_head_trained_with_its_model_drafts_what_the_model_then_accepts(tmp_path):
    """`train_tiny`'s test-sized DeepSeek-V3 with its MTP head, trained together (seconds): the head's loss
    on the token after next falls, and on held-out code the head's drafts are accepted (a random head's
    almost never are), with greedy output equal to the model's without speculation."""
    from bench.spec import workload_prompts
    from workers.models.tokenizer import Tokenizer
    from workers.models.train_tiny import TEST_MTP_TARGET, trained_model

    path = trained_model(TEST_MTP_TARGET, tmp_path, show_progress=False)
    record = json.loads((path / "trained.json").read_text())
    assert record["mtp_loss"][-1][1] < record["mtp_loss"][0][1] - 1.0, record["mtp_loss"]
    assert record["loss"][-1][1] < record["loss"][0][1] - 1.0, record["loss"]
    batch = workload_prompts(Tokenizer.from_dir(path), "code", 4, 48)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    engine = {**ENGINE, "max_model_len": 128}
    plain = LLM(str(path), **engine).generate(batch, params)
    llm = LLM(str(path), speculative={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}, **engine)
    spec = llm.generate(batch, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.speculator.stats.acceptance_rate > 0.3, llm.engine.speculator.stats
