"""Loading a model's tokenizer from a local directory, strictly offline.

The embedded default model (`EMBEDDED_MODEL_DIR`) ships a small byte-level BPE tokenizer with DeepSeek-V3's special
tokens and a chat template modelled on DeepSeek-V3's; ``training/`` builds it with the model (training/tokenizer.py).

Two behaviours of the embedded tokenizer (and of DeepSeek-V3's) that callers rely on:

- ``tokenizer(text)`` prepends bos (the post-processor in tokenizer.json). Under transformers 5 the
  ``add_bos_token`` attribute reads False even so; check ``tokenizer("")["input_ids"]`` rather than that attribute.
- The chat template emits bos itself. ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``
  tokenizes the rendered text with ``add_special_tokens=False``, so its ids hold exactly one bos. In transformers 5
  it returns a ``BatchEncoding`` (``return_dict`` defaults to True): take ``["input_ids"]``, or pass
  ``return_dict=False`` for a plain list. Rendering with ``tokenize=False`` and then calling ``tokenizer(text)``
  gives two bos tokens unless ``add_special_tokens=False`` is passed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EMBEDDED_MODEL_DIR: Path = Path(__file__).resolve().parent.parent / "assets" / "embedded_model"
"""The embedded default model, inside the package: a small DeepSeek-V3 trained by training/ in DeepSeek's block-FP8
format (config, safetensors shards, tokenizer). The small presets' random weights use its tokenizer too."""

TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
"""A directory holding none of these files has no tokenizer."""


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer in `model_dir` with ``AutoTokenizer``, never reaching the network or running remote code.

    Raises ValueError naming the directory when it does not exist, holds no tokenizer files (tokenizer.json,
    tokenizer.model, tokenizer_config.json), or transformers cannot load what it holds, in place of transformers'
    errors about the hub.
    """
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise ValueError(f"tokenizer directory {str(path)!r} does not exist or is not a directory")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer files in {str(path)!r}: expected one of {', '.join(TOKENIZER_FILES)}")
    from transformers import AutoTokenizer  # here: transformers takes seconds to import, `--help` none

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except OSError as exc:
        raise ValueError(f"cannot load the tokenizer in {str(path)!r}: {exc}") from exc
