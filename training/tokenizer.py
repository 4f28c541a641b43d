"""The embedded model's tokenizer: a byte-level BPE of 4096 tokens trained with the ``tokenizers`` library (every
UTF-8 text round-trips), DeepSeek-V3's special tokens spelled as DeepSeek spells them (fullwidth bar U+FF5C, U+2581 in
place of spaces) and a chat template modelled on DeepSeek-V3's. ``training.prepare_data`` trains it on the training
split of the corpus; it ships with the model in plugserve/assets/embedded_model.

The output loads with transformers 4.48+ and 5.x (see `_finish_config`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 4096

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
# Ids 0..3 in this order (DeepSeek-V3 also has bos = 0, eos = 1).
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]

# Modelled on DeepSeek-V3's chat template (without the tool-call branches): bos, the system prompt(s), then
# <｜User｜>{content} for each user message and <｜Assistant｜>{content}<｜end▁of▁sentence｜> for each assistant
# message, and <｜Assistant｜> at the end with add_generation_prompt. Content may be a string or a list of
# OpenAI-style parts ({"type": "text", "text": ...}); "developer" messages count as system messages.
CHAT_TEMPLATE = (
    "{%- macro text_of(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(system_prompt='', is_first_sp=true) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] in ['system', 'developer'] -%}"
    "{%- if ns.is_first_sp -%}"
    "{%- set ns.system_prompt = text_of(message['content']) -%}"
    "{%- set ns.is_first_sp = false -%}"
    "{%- else -%}"
    "{%- set ns.system_prompt = ns.system_prompt + '\\n\\n' + text_of(message['content']) -%}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '" + USER + "' + text_of(message['content']) }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT + "' + text_of(message['content']) + '" + EOS + "' }}"
    "{%- elif message['role'] not in ['system', 'developer'] -%}"
    "{{- raise_exception('Unsupported message role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT + "' }}{%- endif -%}"
)


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on `texts` and wrap it for transformers."""
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: the text is not changed, so decode(encode(text)) == text for every UTF-8 text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        # <｜User｜> and <｜Assistant｜>: control tokens, dropped by decode(..., skip_special_tokens=True).
        additional_special_tokens=[USER, ASSISTANT],
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, output_dir: Path) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json into `output_dir`; returns the paths written."""
    output_dir.mkdir(parents=True, exist_ok=True)
    # save_jinja_files=False: the chat template goes into tokenizer_config.json (as DeepSeek-V3 ships it), which
    # every transformers release reads; chat_template.jinja is only read by newer ones.
    saved = tokenizer.save_pretrained(output_dir, save_jinja_files=False)
    _finish_config(output_dir / "tokenizer_config.json")
    return [str(path) for path in saved]


def _finish_config(path: Path) -> None:
    """Make tokenizer_config.json loadable by transformers 4.x and 5.x alike, and say that bos is added.

    - tokenizer_class: transformers 5 writes "TokenizersBackend", which 4.x does not know; 5.x maps
      "PreTrainedTokenizerFast" to the same class.
    - add_bos_token / add_eos_token: written as DeepSeek-V3 writes them, for the reader. What adds bos is
      tokenizer.json's post-processor ("<bos> $A"); transformers 5 ignores these keys when tokenizer.json exists
      (so a loaded tokenizer's `add_bos_token` attribute reads False there although bos is added).
    - additional_special_tokens: transformers 5 writes <｜User｜> and <｜Assistant｜> as "extra_special_tokens", a list,
      which 4.x takes for a dict and fails on; both read "additional_special_tokens".
    - model_max_length: the saved value is transformers' "no limit" sentinel (1e30); the model config says how long
      a sequence may be, so the key is left out (loading gives the same sentinel back).
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["add_bos_token"] = True
    config["add_eos_token"] = False
    config["additional_special_tokens"] = config.pop("extra_special_tokens", [])
    config.pop("model_max_length", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
