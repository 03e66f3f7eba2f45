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
from safetensors.numpy import load_file, save_file

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
