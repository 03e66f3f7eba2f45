"""`workers.models.tokenizer` against transformers as the reference implementation."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from workers.models import tokenizer as tokmod
from workers.models.tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS, ChatTemplateError, Tokenizer, train_byte_level_bpe

transformers = pytest.importorskip("transformers")
jinja2 = pytest.importorskip("jinja2")
tokenizers = pytest.importorskip("tokenizers")

REPO_ROOT = Path(__file__).resolve().parents[1]

# Mistral/Llama-2 style: bos up front, alternating roles enforced with raise_exception, the system prompt
# folded into the first user turn, `continue` (loopcontrols) and loop.index, multi-line with indented
# block tags so that trim_blocks/lstrip_blocks matter (without them the indentation would be rendered).
INST_TEMPLATE = """{{ bos_token -}}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] + '\\n\\n' %}
{% else %}
    {% set system = '' %}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
    {% if (message['role'] == 'user') != ((loop.index - (1 if system else 0)) % 2 == 1) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{- '[INST] ' + (system if loop.index <= 2 else '') + message['content'] | trim + ' [/INST]' -}}
    {% else %}
        {{- ' ' + message['content'] | trim + eos_token -}}
    {% endif %}
{% endfor %}
"""

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "unicode_and_whitespace": [
        {"role": "user", "content": "  naïve café — 日本語 🤖\n\n\ttabbed  "},
        {"role": "assistant", "content": "Ünïcödé ✓"},
    ],
    "empty_content": [{"role": "user", "content": ""}],
    "special_token_text": [{"role": "user", "content": "say <|im_end|> literally"}],
}

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "naïve café, Größe, Ελληνικά, русский, 日本語, 한국어",
    "emoji: 🤖👍🏽🏳️‍🌈 and a 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math run",
    "   leading spaces\t\ttabs\n\n\nnewlines   trailing   ",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok512")
    train_byte_level_bpe(out, vocab_size=512)
    return out


@pytest.fixture
def model_dir(trained_dir, tmp_path) -> Path:
    """A private copy of the trained tokenizer that a test may edit."""
    out = tmp_path / "model"
    shutil.copytree(trained_dir, out)
    return out


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))


def _load_both(model_dir: Path):
    return Tokenizer.from_dir(model_dir), transformers.AutoTokenizer.from_pretrained(str(model_dir))


def _hf_chat(hf, messages, **kwargs):
    """transformers' rendering as (text, ids); its ids come back in a BatchEncoding since v5."""
    text = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return text, list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


# ---------------------------------------------------------------------------------------------------
# Training


@pytest.mark.parametrize("vocab_size", [tokmod.MIN_VOCAB_SIZE, 300, 512, 4096, 32000])
def test_vocab_size_is_exact(tmp_path, vocab_size):
    tok = train_byte_level_bpe(tmp_path, vocab_size)
    assert tok.vocab_size == vocab_size
    backend = json.loads((tmp_path / "tokenizer.json").read_text())
    ids = set(backend["model"]["vocab"].values()) | {t["id"] for t in backend["added_tokens"]}
    assert ids == set(range(vocab_size)), "ids must be dense 0..vocab_size-1"


def test_specials_layout_and_config(trained_dir):
    tok = Tokenizer.from_dir(trained_dir)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id is None
    assert tok.pad_token_id == 0
    config = json.loads((trained_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None
    assert config["chat_template"] == CHATML_TEMPLATE
    assert {v["content"] for v in config["added_tokens_decoder"].values()} == set(SPECIAL_TOKENS)
    assert all(v["special"] for v in config["added_tokens_decoder"].values())


def test_vocab_too_small_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="at least"):
        train_byte_level_bpe(tmp_path, tokmod.MIN_VOCAB_SIZE - 1)


def test_short_corpus_is_padded_with_reserved_tokens(tmp_path, monkeypatch):
    # Without the stdlib corpus a tiny seed text cannot supply enough merges; the size must still be exact.
    monkeypatch.setattr(tokmod, "_corpus_files", lambda: [])
    tok = train_byte_level_bpe(tmp_path, 400, seed_text="abab abab cdcd")
    assert tok.vocab_size == 400
    assert tok.token_to_id("<|reserved_0|>") is not None
    assert tok.decode([tok.vocab_size - 1], skip_special_tokens=False).startswith("<|reserved_")
    assert tok.decode(tok.encode("anything at all ✓")) == "anything at all ✓"


def test_training_is_deterministic(tmp_path):
    a = train_byte_level_bpe(tmp_path / "a", 1000)
    b = train_byte_level_bpe(tmp_path / "b", 1000)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert a.encode(TEXTS[1]) == b.encode(TEXTS[1])


def test_training_is_deterministic_across_processes(tmp_path):
    # Hash ordering and thread scheduling differ between processes; the bytes must not.
    script = "import sys; from workers.models.tokenizer import train_byte_level_bpe; train_byte_level_bpe(sys.argv[1], 700)"
    for name in ("p1", "p2"):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], cwd=REPO_ROOT, check=True)
    train_byte_level_bpe(tmp_path / "here", 700)
    files = [(tmp_path / name / "tokenizer.json").read_bytes() for name in ("p1", "p2", "here")]
    assert files[0] == files[1] == files[2]


def test_seed_text_changes_the_merges(tmp_path):
    seed = "zyzzyva quokka " * 2000
    plain = train_byte_level_bpe(tmp_path / "plain", 600)
    seeded = train_byte_level_bpe(tmp_path / "seeded", 600, seed_text=seed)
    assert len(seeded.encode("zyzzyva quokka")) < len(plain.encode("zyzzyva quokka"))


def test_runtime_module_imports_neither_torch_nor_transformers():
    code = (
        "import sys, workers.models.tokenizer as t; bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


# ---------------------------------------------------------------------------------------------------
# Encoding and decoding


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(trained_dir, text):
    ours, hf = _load_both(trained_dir)
    for add in (True, False):
        ids = ours.encode(text, add_special_tokens=add)
        assert ids == hf.encode(text, add_special_tokens=add)
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level: exact round trip
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_decode_skips_specials_by_default(trained_dir):
    tok = Tokenizer.from_dir(trained_dir)
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "hi"
    assert tok.decode(iter(ids), skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_bos_comes_from_the_tokenizer_json_post_processor(model_dir):
    # A Mixtral-style tokenizer.json whose post-processor prepends bos.
    backend = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B", special_tokens=[("<|endoftext|>", 0)]
    )
    backend.save(str(model_dir / "tokenizer.json"))
    _edit_config(model_dir, bos_token="<|endoftext|>")
    ours, hf = _load_both(model_dir)
    assert ours.bos_token_id == 0
    for text in TEXTS[:4]:
        ids = ours.encode(text)
        assert ids[0] == 0 and ids[1:] == ours.encode(text, add_special_tokens=False)
        assert ids == hf.encode(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_add_bos_token_in_config_does_not_override_tokenizer_json(model_dir):
    # transformers 5 ignores add_bos_token when tokenizer.json exists; so do we.
    _edit_config(model_dir, bos_token="<|endoftext|>", add_bos_token=True)
    ours, hf = _load_both(model_dir)
    assert ours.bos_token_id == 0
    for text in TEXTS[:4]:
        assert ours.encode(text) == hf.encode(text) == ours.encode(text, add_special_tokens=False)


def test_missing_special_token_is_added_like_transformers(model_dir):
    _edit_config(model_dir, unk_token="<unk>")
    ours, hf = _load_both(model_dir)
    assert ours.vocab_size == len(hf) == 513
    assert ours.token_to_id("<unk>") == hf.convert_tokens_to_ids("<unk>") == 512
    assert ours.encode("a <unk> b") == hf.encode("a <unk> b")


# ---------------------------------------------------------------------------------------------------
# generation_config.json


def test_eos_ids_from_generation_config_come_first(model_dir):
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9], "bos_token_id": 1}))
    tok = Tokenizer.from_dir(model_dir)
    assert tok.eos_token_ids == (7, 2, 9)  # the config's eos (2) is already there: no duplicate
    assert tok.bos_token_id == 1


def test_single_eos_id_from_generation_config(model_dir):
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 5, "bos_token_id": None}))
    tok = Tokenizer.from_dir(model_dir)
    assert tok.eos_token_ids == (5, 2)
    assert tok.bos_token_id is None


def test_eos_without_generation_config(trained_dir):
    assert Tokenizer.from_dir(trained_dir).eos_token_ids == (2,)


# ---------------------------------------------------------------------------------------------------
# Chat templates


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chatml_matches_transformers(trained_dir, name, add_generation_prompt):
    ours, hf = _load_both(trained_dir)
    messages = CONVERSATIONS[name]
    text, ids = _hf_chat(hf, messages, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == text
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True) == ids
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chatml_layout(trained_dir):
    tok = Tokenizer.from_dir(trained_dir)
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "U"}], tokenize=True)
    assert ids[0] == 1 and ids.count(2) == 1  # <|im_start|> / <|im_end|> encoded as single special ids


def test_chatml_tools_and_tool_calls_match_transformers(trained_dir):
    ours, hf = _load_both(trained_dir)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city — °C",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    text, ids = _hf_chat(hf, messages, tools=tools, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, tools=tools) == text
    assert ours.apply_chat_template(messages, tools=tools, tokenize=True) == ids
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text  # tojson keeps non-ASCII


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_inst_template_matches_transformers(model_dir, add_generation_prompt):
    _edit_config(model_dir, chat_template=INST_TEMPLATE, bos_token="<|endoftext|>")
    ours, hf = _load_both(model_dir)
    for messages in (CONVERSATIONS["with_system"], CONVERSATIONS["single_user"], CONVERSATIONS["unicode_and_whitespace"]):
        text, ids = _hf_chat(hf, messages, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == text
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True) == ids
    text = ours.apply_chat_template(CONVERSATIONS["with_system"])
    assert text == "<|endoftext|>[INST] You are terse.\n\nWhat is 2+2? [/INST] 4<|im_end|>[INST] And 3+3? [/INST]"


def test_raise_exception_surfaces_as_value_error(model_dir):
    _edit_config(model_dir, chat_template=INST_TEMPLATE, bos_token="<|endoftext|>")
    ours, hf = _load_both(model_dir)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    message = "Conversation roles must alternate user/assistant/user/assistant/..."
    with pytest.raises(ValueError) as ours_err:
        ours.apply_chat_template(bad)
    assert str(ours_err.value) == message
    assert isinstance(ours_err.value, ChatTemplateError)
    with pytest.raises(jinja2.TemplateError, match="alternate"):  # transformers raises the same message
        hf.apply_chat_template(bad, tokenize=False)


def test_template_helpers_match_transformers(model_dir):
    template = (
        "{{ strftime_now('%Y') }}|{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}"
        "|{{ flavour | default('none') }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ loop.index }}:{{ m.role }}{% endfor %}|{{ tools is none }}"
    )
    _edit_config(model_dir, chat_template=template)
    ours, hf = _load_both(model_dir)
    messages = [{"role": "user", "content": "<b>&'ü\"</b>"}, {"role": "assistant", "content": "ok"}]
    for extra in ({}, {"flavour": "spicy"}):
        text, ids = _hf_chat(hf, messages, **extra)
        assert ours.apply_chat_template(messages, add_generation_prompt=False, **extra) == text
        assert ours.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, **extra) == ids
    assert '"<b>&\'ü\\"</b>"' in text  # no HTML escaping, no \u escapes
    assert "|spicy|1:user|True" in text


def test_chat_template_jinja_file_wins_over_config(model_dir):
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    ours, hf = _load_both(model_dir)
    messages = CONVERSATIONS["with_system"]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False)
    assert ours.apply_chat_template(messages).startswith("<system>You are terse.<user>")


def test_named_template_list_picks_default_and_tool_use(model_dir):
    templates = [
        {"name": "default", "template": "D:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T:{{ tools[0].name }}:{{ messages[0].content }}"},
    ]
    _edit_config(model_dir, chat_template=templates)
    ours, hf = _load_both(model_dir)
    messages = CONVERSATIONS["single_user"]
    tools = [{"name": "calc"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False) == "D:Hello!"
    with_tools = hf.apply_chat_template(messages, tools=tools, tokenize=False)
    assert ours.apply_chat_template(messages, tools=tools) == with_tools == "T:calc:Hello!"


def test_missing_chat_template_is_a_clear_value_error(model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(model_dir)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS["single_user"])


def test_broken_template_is_a_value_error(model_dir):
    _edit_config(model_dir, chat_template="{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer.from_dir(model_dir).apply_chat_template(CONVERSATIONS["single_user"])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (None, "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "wizard", "content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": "ok"}, {"role": "user", "content": 3}], r"messages\[1\]\.content"),
        ([{"role": "user"}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
        ([{"role": "assistant", "content": None}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], r"messages\[0\]\.content"),
    ],
)
def test_bad_messages_raise_value_error(trained_dir, messages, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_dir(trained_dir).apply_chat_template(messages)


def test_assistant_tool_call_without_content_is_accepted(trained_dir):
    tok = Tokenizer.from_dir(trained_dir)
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert "None" not in text
    assert text.endswith('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n')
