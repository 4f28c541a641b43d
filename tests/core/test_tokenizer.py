"""The embedded tokenizer, loaded offline: round trips, bos, eos, the chat template, compression, errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR, load_tokenizer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

# A paragraph of README prose (copied here so that README edits do not move the threshold).
PROSE = (
    "A lean serving core for DeepSeek-V3-style models (MLA attention, DeepSeekMoE, block-wise FP8) whose "
    "kernels are plugins. Attention, FP8 GEMM and MoE backends are discovered through pluggy entry points, "
    "checked against torch reference backends by a conformance kit, and chosen per GPU, per phase "
    "(prefill / decode) and per batch size."
)

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And times 3?"},
]
CHAT_RENDERED = (
    f"{BOS}You are a helpful assistant."
    f"{USER}What is 2 + 2?"
    f"{ASSISTANT}2 + 2 = 4.{EOS}"
    f"{USER}And times 3?"
    f"{ASSISTANT}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Iterator[PreTrainedTokenizerBase]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        yield load_tokenizer(EMBEDDED_MODEL_DIR)


def test_embedded_model_dir_is_in_the_package() -> None:
    assert EMBEDDED_MODEL_DIR.name == "embedded_model"
    assert EMBEDDED_MODEL_DIR.parent.name == "assets"
    assert (EMBEDDED_MODEL_DIR / "tokenizer.json").is_file()
    assert (EMBEDDED_MODEL_DIR / "tokenizer_config.json").is_file()


def test_vocabulary_and_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer) == 4096
    assert tokenizer.bos_token == BOS
    assert tokenizer.eos_token == EOS
    assert tokenizer.pad_token == EOS
    assert tokenizer.eos_token_id is not None
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(EOS)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids(BOS)
    for token in (BOS, EOS, USER, ASSISTANT):  # each one token, whole
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "def add(a: int, b: int) -> int:\n    return a + b  # sum\n\n\tx = {'k': [1, 2.5]}\r\n",
        "naïve café 東京 🙂",
        "  leading and trailing spaces  ",
        "",
    ],
    ids=["english", "code", "non-ascii", "spaces", "empty"],
)
def test_round_trip(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_bos_prepended_once(tokenizer: PreTrainedTokenizerBase) -> None:
    bos = tokenizer.bos_token_id
    ids = tokenizer("Hello, world!")["input_ids"]
    assert ids[0] == bos
    assert ids.count(bos) == 1
    assert tokenizer("")["input_ids"] == [bos]
    assert bos not in tokenizer("Hello, world!", add_special_tokens=False)["input_ids"]
    assert EOS not in tokenizer.convert_ids_to_tokens(ids)


def test_chat_template_renders_like_deepseek_v3(tokenizer: PreTrainedTokenizerBase) -> None:
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered == CHAT_RENDERED
    without_prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False)
    assert without_prompt == CHAT_RENDERED.removesuffix(ASSISTANT)


def test_chat_template_tokenized_has_one_bos(tokenizer: PreTrainedTokenizerBase) -> None:
    # The way the server calls it; transformers 5 returns a BatchEncoding here, 4.x a list of ids.
    out = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    bos = tokenizer.bos_token_id
    assert ids[0] == bos
    assert ids.count(bos) == 1
    assert ids[-1] == tokenizer.convert_tokens_to_ids(ASSISTANT)
    assert ids.count(tokenizer.eos_token_id) == 1
    assert ids == tokenizer(CHAT_RENDERED, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == CHAT_RENDERED


def test_chat_template_content_parts_and_system_only_once(tokenizer: PreTrainedTokenizerBase) -> None:
    chat = [
        {"role": "system", "content": "One."},
        {"role": "system", "content": [{"type": "text", "text": "Two."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == f"{BOS}One.\n\nTwo.{USER}Hi there{ASSISTANT}"


def test_prose_compresses(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer(PROSE, add_special_tokens=False)["input_ids"]
    assert len(ids) < 0.5 * len(PROSE)


def test_directory_without_tokenizer_files_raises(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer files") as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_missing_directory_raises(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="does not exist") as info:
        load_tokenizer(str(missing))
    assert str(missing) in str(info.value)


@pytest.mark.parametrize("preset", [None, "tiny"])
def test_embedded_tokenizer_fits_the_embedded_model_and_the_small_presets(preset: str | None):
    from plugserve.core.loader import read_config

    config, _ = read_config(None if preset else str(EMBEDDED_MODEL_DIR), preset)
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    assert len(tokenizer) == config.vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config.bos_token_id, config.eos_token_ids[0])
