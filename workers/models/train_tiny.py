"""Small *trained* checkpoints, offline: a model worth speculating on (and testing acceptance with).

Random weights accept nothing, so speculative decoding's figures need models that predict text. This
trains tiny Mixture-of-Experts checkpoints on text every machine has (the Python standard library's
source, the corpus the tokenizer is trained on) on the CPU, deterministically from a seed, and caches
them (`~/.cache/moray/trained/<name>-<digest of everything that shapes the weights>`):

- `TARGET`: the target MoE (the demo and benchmark model);
- `DRAFT`: a smaller MoE with the same tokenizer (same vocabulary size: the tokenizer training is
  deterministic), for draft-model speculation;
- `TEST_TARGET` / `TEST_DRAFT`: test-sized ones that train in seconds;
- `MTP_TARGET` / `TEST_MTP_TARGET`: a DeepSeek-V3 MoE (MLA attention) with its multi-token-prediction head
  (`mtp.py`), trained together as DeepSeek-V3 trains them: next-token loss plus `mtp_weight` x the head's
  loss on the token after next (the head reads the target's hidden state at i and the token at i + 1).

Training runs in checkpoint-tensor space: the parameters are the checkpoint's own tensors, and the model's
weight pytree is assembled from them by the family's load plan with jnp (concatenate, stack, row order),
so gradients reach the tensors that are then written back unchanged in layout. Next-token cross-entropy on
random windows of the corpus, Adam with warm-up and cosine decay.

`python -m workers.models.train_tiny --which target` trains (or finds) one and prints its directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .config import read_config_json
from .make_model import Preset, make_model, write_safetensors
from .model import load_config
from .weights import Concat, OneOf, Rows, Stack, Tensor, is_spec, plan_leaves

log = logging.getLogger("moray.train")

CACHE_ROOT = Path(os.environ.get("MORAY_TRAINED_CACHE", Path.home() / ".cache" / "moray" / "trained"))
_FORMAT = 2  # bump when training changes what a digest means


@dataclass(frozen=True)
class TrainSpec:
    name: str
    preset: Preset | str  # a `Preset`, or a named one (families that take only those, as deepseek_v3)
    steps: int
    seq_len: int = 128
    batch: int = 16
    lr: float = 3e-3
    seed: int = 0
    arch: str = "qwen3_moe"
    mtp: bool = False  # with a multi-token-prediction head, trained beside the model
    mtp_weight: float = 0.3  # DeepSeek-V3's weight of the head's loss
    init: float | None = None  # the initial weights' standard deviation (None: the preset's)

    def digest(self) -> str:
        text = json.dumps({**asdict(self), "format": _FORMAT, "python": sys.version_info[:2]}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# vocab, hidden, layers, heads, kv heads, head dim, experts, top-k, expert width, dense width, init, shard
TARGET = TrainSpec("target", Preset(1024, 128, 4, 4, 2, 32, 8, 2, 128, 256, 0.02, 1 << 30), steps=600)
DRAFT = TrainSpec("draft", Preset(1024, 64, 1, 4, 2, 16, 4, 1, 128, 128, 0.02, 1 << 30), steps=600)
TEST_TARGET = TrainSpec("test-target", Preset(512, 64, 2, 4, 2, 16, 4, 2, 64, 96, 0.02, 1 << 30), steps=150, seq_len=64)
TEST_DRAFT = TrainSpec("test-draft", Preset(512, 32, 1, 2, 1, 16, 2, 1, 32, 64, 0.02, 1 << 30), steps=150, seq_len=64)
# DeepSeek-V3 takes named presets only; their initial weights are a test's (0.1-0.2), too large to train from.
MTP_TARGET = TrainSpec("mtp-target", "tiny", steps=600, arch="deepseek_v3", mtp=True, init=0.02)
TEST_MTP_TARGET = TrainSpec("test-mtp-target", "tiny", steps=150, seq_len=64, arch="deepseek_v3", mtp=True, init=0.02)
SPECS = {s.name: s for s in (TARGET, DRAFT, TEST_TARGET, TEST_DRAFT, MTP_TARGET, TEST_MTP_TARGET)}


def trained_model(spec: TrainSpec, cache_root: Path | None = None, show_progress: bool = True) -> Path:
    """The checkpoint `spec` describes: from the cache, or trained now and cached (atomically: a
    concurrent trainer's result wins, never a half-written one)."""
    root = Path(cache_root or CACHE_ROOT)
    out = root / f"{spec.name}-{spec.digest()}"
    if (out / "trained.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=root))
    try:
        train(spec, tmp, show_progress)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def corpus_ids(tokenizer, max_chars: int | None = None) -> np.ndarray:
    """The standard-library corpus as one token stream (files joined by EOS), its first `max_chars`
    characters' worth of files (all by default)."""
    from .tokenizer import _corpus_files

    eos = tokenizer.eos_token_ids[0]
    ids: list[int] = []
    chars = 0
    for path in _corpus_files():
        if max_chars is not None and chars >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        chars += len(text)
        ids += tokenizer.encode(text, add_special_tokens=False) + [eos]
    return np.asarray(ids, np.int32)


def train(spec: TrainSpec, out: Path, show_progress: bool = True) -> dict:
    """Writes a random checkpoint of `spec.preset`, trains it and overwrites its weights; returns the
    training record (also written to trained.json)."""
    from .tokenizer import Tokenizer

    start = time.perf_counter()
    make_model(out, spec.arch, spec.preset, seed=spec.seed, mtp=spec.mtp, initializer_range=spec.init)
    family, cfg = load_config(out)
    plan = family.plan(cfg)
    head = None
    if spec.mtp:
        from . import mtp

        head_cfg, where, head_plan = mtp.plan(family, cfg, read_config_json(out))
        head = (head_cfg, where, head_plan)
    params = _initial_params(out)
    # ~10 characters of text per token the training reads: windows rarely repeat, and a short run does not
    # tokenise the whole corpus.
    data = corpus_ids(Tokenizer.from_dir(out), max_chars=10 * spec.steps * spec.batch * (spec.seq_len + 1))
    rng = np.random.default_rng(spec.seed)
    step_fn = _train_step(family, cfg, plan, spec, head)
    opt = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params))
    losses, head_losses = [], []
    for step in range(spec.steps):
        starts = rng.integers(0, len(data) - spec.seq_len - 1, spec.batch)
        window = np.stack([data[s : s + spec.seq_len + 1] for s in starts])
        params, opt, (loss, head_loss) = step_fn(params, opt, jnp.int32(step), window)
        if step % 50 == 0 or step == spec.steps - 1:
            losses.append((step, float(loss)))
            extra = ""
            if head is not None:
                head_losses.append((step, float(head_loss)))
                extra = f", head {float(head_loss):.3f}"
            if show_progress:
                print(f"train {spec.name}: step {step}/{spec.steps} loss {float(loss):.3f}{extra}", file=sys.stderr, flush=True)
    host = {k: np.asarray(v) for k, v in params.items()}
    for f in out.glob("*.safetensors"):
        f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    shard_bytes = spec.preset.max_shard_bytes if isinstance(spec.preset, Preset) else 1 << 30
    write_safetensors(out, iter(sorted(host.items())), len(host), shard_bytes)
    record = {
        "name": spec.name,
        "digest": spec.digest(),
        "steps": spec.steps,
        "tokens_seen": spec.steps * spec.batch * spec.seq_len,
        "corpus_tokens": int(len(data)),
        "loss": losses,
        **({"mtp_loss": head_losses} if head is not None else {}),
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out / "trained.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _initial_params(out: Path) -> dict[str, jax.Array]:
    from safetensors.numpy import load_file

    params = {}
    for f in sorted(out.glob("*.safetensors")):
        params.update({k: jnp.asarray(v, jnp.float32) for k, v in load_file(str(f)).items()})
    return params


def _assemble(source, params):
    """A weight leaf from checkpoint tensors, as the loader reads it (differentiable)."""
    if isinstance(source, Tensor):
        return params[source.key]
    if isinstance(source, OneOf):
        return _assemble(source.options[0], params)  # make_model writes the first layout
    if isinstance(source, Concat):
        return jnp.concatenate([_assemble(p, params) for p in source.parts], axis=0)
    if isinstance(source, Stack):
        return jnp.stack([_assemble(p, params) for p in source.parts])
    if isinstance(source, Rows):
        return _assemble(source.parts[0], params)[jnp.asarray(source.order)]
    raise TypeError(f"cannot assemble {type(source).__name__}")


def _cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def _train_step(family, cfg, plan, spec: TrainSpec, head=None):
    """One jitted Adam step; it returns (params, opt, (loss, the head's loss or 0)). `head`: the MTP head's
    (config, layout, plan) from `mtp.plan`, trained beside the model."""
    from .layers import KVCache
    from .mtp import MTPHead

    assert all(not isinstance(leaf.source, OneOf) or leaf.source.options for leaf in plan_leaves(plan))
    warmup = max(1, spec.steps // 20)

    def assemble(p, params):
        return jax.tree.map(lambda leaf: _assemble(leaf.source, params), p, is_leaf=is_spec)

    def loss_fn(params, window):
        weights = assemble(plan, params)
        tokens, targets = window[:, :-1], window[:, 1:]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        cache = KVCache.zeros(cfg, tokens.shape[0], tokens.shape[1], jnp.float32)
        if head is None:
            logits, _ = family.forward(weights, cfg, tokens, positions, cache)
            loss = _cross_entropy(logits, targets)
            return loss, (loss, jnp.float32(0))
        logits, _, hidden = family.forward(weights, cfg, tokens, positions, cache, hidden_out="normed")
        loss = _cross_entropy(logits, targets)
        # The head at position i reads h_i and the token at i + 1, and predicts the token at i + 2.
        head_cfg, where, head_plan = head
        mtp = MTPHead(family, head_cfg, where, assemble(head_plan, params))
        n = tokens.shape[1] - 1
        head_cache = KVCache.zeros(head_cfg, tokens.shape[0], n, jnp.float32)
        head_logits, _, _ = mtp.forward(weights, targets[:, :n], positions[:, :n], hidden[:, :n], head_cache)
        head_loss = _cross_entropy(head_logits, targets[:, 1:])
        return loss + spec.mtp_weight * head_loss, (loss, head_loss)

    @jax.jit
    def step(params, opt, i, window):
        (_, (loss, head_loss)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, window)
        frac = jnp.minimum(1.0, (i + 1) / warmup)
        lr = spec.lr * frac * 0.5 * (1 + jnp.cos(jnp.pi * i / spec.steps))
        m, v = opt
        b1, b2, eps = 0.9, 0.98, 1e-8
        m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
        t = (i + 1).astype(jnp.float32)
        params = jax.tree.map(
            lambda p, a, b: p - lr * (a / (1 - b1**t)) / (jnp.sqrt(b / (1 - b2**t)) + eps),
            params,
            m,
            v,
        )
        return params, (m, v), (loss, head_loss)

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.models.train_tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--which", choices=sorted(SPECS), default="target")
    p.add_argument("--cache", type=Path, help=f"cache directory (default {CACHE_ROOT}; MORAY_TRAINED_CACHE)")
    args = p.parse_args(argv)
    print(trained_model(SPECS[args.which], args.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
