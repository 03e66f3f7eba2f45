"""Tokenizers and chat templates at serving time, without transformers.

`Tokenizer.from_dir(model_dir)` reads the files a Hugging Face checkpoint ships (`tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`) and reproduces what
`transformers.AutoTokenizer` does with them for the fast (Rust `tokenizers`) backend: the same ids from
`encode`, the same text from `decode`, and the same prompt from `apply_chat_template`. Only `tokenizers`
and `jinja2` are needed, so serving workers stay free of torch and transformers.

`train_byte_level_bpe(out_dir, vocab_size)` makes a small, deterministic tokenizer with a ChatML template
for synthetic checkpoints and tests, from Python standard-library sources on disk (no network).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as _Backend

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
GENERATION_CONFIG_FILE = "generation_config.json"

ROLES = ("system", "user", "assistant", "tool")
# The named special tokens of a tokenizer config; transformers hands the ones that are set to chat templates.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Older names for a message's reasoning; templates (Qwen3's among them) read `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template that cannot be compiled, or that refused the conversation (`raise_exception`)."""


# --------------------------------------------------------------------------------------------------
# Loading


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """Special tokens are plain strings in new configs and serialized AddedToken dicts in older ones."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_templates(model_dir: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates; a lone template is called "default".

    Like transformers, template files (written by transformers 5) replace whatever tokenizer_config.json
    holds rather than merging with it.
    """
    files: dict[str, str] = {}
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = (model_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    for path in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja")):
        files[path.stem] = path.read_text(encoding="utf-8")
    if files:
        return files
    raw = config.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in raw if isinstance(t, Mapping) and "name" in t and "template" in t}
    return {}


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool):  # bool is an int subclass; never a token id
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _added_token(entry: Mapping[str, Any]) -> AddedToken:
    special = bool(entry.get("special", False))
    return AddedToken(
        entry["content"],
        single_word=bool(entry.get("single_word", False)),
        lstrip=bool(entry.get("lstrip", False)),
        rstrip=bool(entry.get("rstrip", False)),
        normalized=bool(entry.get("normalized", not special)),
        special=special,
    )


def _add_missing_tokens(backend: _Backend, config: Mapping[str, Any], special: Mapping[str, str | None]) -> None:
    """Register tokens that tokenizer_config.json names but tokenizer.json lacks, as transformers does
    (in id order, after the existing vocabulary)."""
    known = set(backend.get_vocab(with_added_tokens=True))
    missing: list[AddedToken] = []
    decoder = config.get("added_tokens_decoder") or {}
    for _, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        if isinstance(entry, Mapping) and isinstance(entry.get("content"), str) and entry["content"] not in known:
            missing.append(_added_token(entry))
            known.add(entry["content"])
    for content in special.values():
        if content is not None and content not in known:
            missing.append(AddedToken(content, special=True, normalized=False))
            known.add(content)
    if missing:
        backend.add_tokens(missing)


# --------------------------------------------------------------------------------------------------
# Chat templates


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # Jinja's built-in tojson HTML-escapes (<, >, &, ') and sorts keys; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    # Templates come with checkpoints, i.e. from third parties: render them sandboxed and read-only.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
        content = msg.get("content")
        if isinstance(content, str):
            continue
        if content is None and role == "assistant" and msg.get("tool_calls"):
            continue  # an assistant turn that only calls tools
        raise ValueError(
            f"messages[{i}].content must be a string (None only for an assistant message with tool_calls); got {type(content).__name__}"
        )


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages the way transformers presents them to templates.

    Keys set to None are dropped (templates test for a missing key, and would print "None"), and reasoning
    given under an older name is also exposed as `reasoning_content` (and `thinking`, for gpt-oss).
    """
    prepared = []
    for msg in messages:
        out = {k: v for k, v in msg.items() if v is not None}
        reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
        if reasoning is not None:
            out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
        prepared.append(out)
    return prepared


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ValueError("tools must be a list of JSON-schema dicts")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{i}] must be a JSON-schema dict, got {type(tool).__name__}")


# --------------------------------------------------------------------------------------------------
# Tokenizer


class Tokenizer:
    """A checkpoint's tokenizer: `tokenizers` for text <-> ids, jinja2 for chat templates."""

    def __init__(
        self,
        backend: _Backend,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
    ):
        self._backend = backend
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._templates = dict(chat_templates or {})
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))  # dedupe, keep order
        self._bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (only fast, tokenizer.json-based tokenizers are supported)")
        backend = _Backend.from_file(str(path))
        config = _read_json(model_dir / TOKENIZER_CONFIG_FILE)
        generation = _read_json(model_dir / GENERATION_CONFIG_FILE)

        special = {name: _token_content(config.get(name)) for name in _SPECIAL_TOKEN_NAMES}
        _add_missing_tokens(backend, config, special)
        # Which specials encode(add_special_tokens=True) adds is up to tokenizer.json's post-processor alone:
        # transformers 5 drops add_bos_token/add_eos_token from the config whenever tokenizer.json exists.

        # generation_config.json is what generate() stops on, so its ids come first.
        eos_ids = _as_id_list(generation.get("eos_token_id"))
        if special["eos_token"] is not None and (tid := backend.token_to_id(special["eos_token"])) is not None:
            eos_ids.append(tid)
        bos_ids = _as_id_list(generation.get("bos_token_id"))
        bos_id = bos_ids[0] if bos_ids else None
        if bos_id is None and special["bos_token"] is not None:
            bos_id = backend.token_to_id(special["bos_token"])

        return cls(
            backend,
            special_tokens=special,
            chat_templates=_chat_templates(model_dir, config),
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
        )

    # ---- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # transformers 5 never applies clean_up_tokenization_spaces to BPE models (all our families are BPE).
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added and special tokens included (transformers' `len(tok)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        pad = self._special.get("pad_token")
        return None if pad is None else self._backend.token_to_id(pad)

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens that are set, e.g. {"eos_token": "<|im_end|>"}."""
        return dict(self._special)

    @property
    def backend(self) -> _Backend:
        return self._backend

    # ---- chat

    @property
    def chat_template(self) -> str | None:
        return self._templates.get("default")

    def _pick_template(self, name_or_source: str | None, tools: Any) -> str:
        if name_or_source is not None:
            return self._templates.get(name_or_source, name_or_source)
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if self._templates:
            raise ValueError(f"no default chat template; pass one of {sorted(self._templates)} as chat_template")
        raise ValueError(
            "this tokenizer has no chat template (none in tokenizer_config.json or chat_template.jinja); "
            "pass chat_template=... or send a plain prompt"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str | list[int]:
        """Render `messages` exactly as transformers' `apply_chat_template` would.

        `chat_template` is a template name (e.g. "tool_use") or a template source; by default the model's own.
        `extra` becomes template variables (e.g. `enable_thinking=False`), overriding the special tokens.
        With `tokenize=True`, returns ids of the rendered text encoded without adding special tokens, since
        the template already wrote them.
        """
        _check_messages(messages)
        _check_tools(tools)
        template = _compile_template(self._pick_template(chat_template, tools))
        variables = {
            **self._special,
            "tools": None if tools is None else [dict(t) for t in tools],
            "documents": None,
            **extra,
            "messages": _prepare_messages(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e
        return self.encode(text, add_special_tokens=False) if tokenize else text


# --------------------------------------------------------------------------------------------------
# Training a small tokenizer for synthetic checkpoints

# Ids 0, 1, 2 of every trained tokenizer (BpeTrainer puts special tokens first).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256  # the specials plus one token per byte
MODEL_MAX_LENGTH = 32768

# ChatML, as Qwen writes it. Tool schemas go into the system turn, tool calls follow the assistant's text
# as <tool_call> JSON, and tool results are their own `tool` turns.
CHATML_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\n\n' }}
{%- endif %}
{{- 'You can call these tools. For each call, reply with <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call>\n<tools>\n' }}
{%- for tool in tools %}
{{- tool | tojson + '\n' }}
{%- endfor %}
{{- '</tools><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if not (tools and loop.first and message.role == 'system') %}
{{- '<|im_start|>' + message.role + '\n' }}
{%- if message.content is string %}
{{- message.content }}
{%- endif %}
{%- for call in message.tool_calls | default([]) %}
{%- set fn = call.function | default(call) %}
{{- '\n<tool_call>\n' + {'name': fn.name, 'arguments': fn.arguments} | tojson + '\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Standard-library sources used as training text. Read from disk, never imported; a fixed, sorted list
# so the corpus (and so tokenizer.json) only depends on the Python version, not on what else is installed.
_CORPUS_MODULES = (
    "_pydatetime _pydecimal _pyio argparse ast base64 bdb calendar codecs configparser contextlib csv "
    "dataclasses difflib dis doctest enum fractions ftplib functools gettext gzip heapq imaplib inspect "
    "ipaddress locale mailbox mimetypes ntpath optparse os pathlib pdb pickle pickletools platform plistlib "
    "posixpath pprint profile pstats random selectors shlex shutil smtplib socket socketserver ssl statistics "
    "string subprocess sysconfig tarfile tempfile textwrap threading tokenize trace traceback turtle typing "
    "uuid warnings weakref webbrowser zipimport"
).split()
_CORPUS_PACKAGES = (
    "asyncio collections concurrent/futures email http importlib json logging multiprocessing sqlite3 "
    "tomllib unittest urllib wsgiref xml/dom xml/etree zoneinfo"
).split()
# Text read per requested token: enough pairs for every merge (the full corpus, ~6 MB, supports ~40k
# tokens), while small vocabularies train in a fraction of a second.
_CORPUS_CHARS_PER_TOKEN = 200
_MIN_CORPUS_CHARS = 500_000


def _corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f"{name}.py" for name in sorted(_CORPUS_MODULES)]
    for package in sorted(_CORPUS_PACKAGES):
        files.extend(sorted((root / package).glob("*.py")))
    return [f for f in files if f.is_file()]


def _training_corpus(vocab_size: int, seed_text: str | None) -> list[str]:
    budget = max(_MIN_CORPUS_CHARS, _CORPUS_CHARS_PER_TOKEN * vocab_size)
    texts = [seed_text] if seed_text else []
    size = len(seed_text or "")
    for path in _corpus_files():
        if size >= budget:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
    return texts


def _train_backend(vocab_size: int, seed_text: str | None) -> _Backend:
    backend = _Backend(models.BPE())
    # Byte-level: every string maps to bytes the base vocabulary covers, so any text round-trips.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_training_corpus(vocab_size, seed_text), trainer)
    # A corpus can run out of pairs to merge before reaching the target; fill the rest with reserved
    # specials at the top ids so the vocabulary size is always exact.
    shortfall = vocab_size - backend.get_vocab_size(with_added_tokens=True)
    backend.add_special_tokens([f"<|reserved_{i}|>" for i in range(shortfall)])
    return backend


def _tokenizer_config(backend: _Backend) -> dict[str, Any]:
    added = {
        str(tid): {
            "content": tok.content,
            "lstrip": tok.lstrip,
            "normalized": tok.normalized,
            "rstrip": tok.rstrip,
            "single_word": tok.single_word,
            "special": tok.special,
        }
        for tid, tok in sorted(backend.get_added_tokens_decoder().items())
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHATML_TEMPLATE,
    }


def train_byte_level_bpe(out_dir: str | Path, vocab_size: int, seed_text: str | None = None) -> Tokenizer:
    """Train a byte-level BPE tokenizer of exactly `vocab_size` ids and save it HF-style into `out_dir`.

    Ids 0, 1, 2 are `<|endoftext|>` (pad), `<|im_start|>` and `<|im_end|>` (eos), followed by the 256
    byte tokens and the merges; if the corpus runs out of merges, `<|reserved_N|>` specials fill the top ids.
    `seed_text` is trained on ahead of the standard-library corpus. Same inputs (and Python version) give
    byte-identical files. Writes tokenizer.json and tokenizer_config.json (with a ChatML chat template).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (3 specials + 256 bytes), got {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend = _train_backend(vocab_size, seed_text)
    (out / TOKENIZER_FILE).write_text(backend.to_str(pretty=True) + "\n", encoding="utf-8")
    config = json.dumps(_tokenizer_config(backend), indent=2, ensure_ascii=False)
    (out / TOKENIZER_CONFIG_FILE).write_text(config + "\n", encoding="utf-8")
    return Tokenizer.from_dir(out)
