"""Build the tokenizer of the embedded default model into ``plugserve/assets/embedded_model/``.

Run once by a developer (the output is committed; the package never imports this script)::

    .venv/bin/python tools/build_embedded_tokenizer.py            # writes plugserve/assets/embedded_model/
    .venv/bin/python tools/build_embedded_tokenizer.py --check    # rebuilds in a temporary folder, compares

It trains a byte-level BPE tokenizer (4096 tokens, every UTF-8 text round-trips) with the ``tokenizers``
library on text found offline: this repository's README.md, docs/*.md and plugserve/**/*.py, plus the docstrings,
the pydoc topics (English prose) and part of the source of the Python standard library (code). The special tokens are
DeepSeek-V3's, spelled as DeepSeek spells them (fullwidth bar U+FF5C, U+2581 in place of spaces), and the chat
template is modelled on DeepSeek-V3's.

The build is deterministic: the inputs are read in sorted order with fixed caps, and the BPE trainer breaks ties
between equally frequent pairs by the pair itself; reruns on the same inputs give byte-identical files. The output
changes when the inputs do (this repository's README, docs and plugserve/*.py, the Python version whose standard
library is read), so ``--check`` also reports that drift; the committed files need no rebuild for it.

The output loads with transformers 4.48+ and 5.x (see `_finish_config`).
"""

from __future__ import annotations

import argparse
import ast
import filecmp
import json
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parent.parent
OUTPUT_DIR = REPO_ROOT / "plugserve" / "assets" / "embedded_model"

VOCAB_SIZE = 4096

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
# Ids 0..3 in this order (DeepSeek-V3 also has bos = 0, eos = 1).
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]

# Caps on the standard library's share of the training text, in characters.
STDLIB_PROSE_CAP = 2_500_000
STDLIB_CODE_CAP = 1_500_000
STDLIB_CODE_PER_FILE_CAP = 12_000
# Parts of the standard library that are not ordinary prose or code (tests, data, vendored wheels).
STDLIB_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "_bundled"}

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


def _read_text(path: Path) -> str | None:
    """The file's text as UTF-8, or None when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def repo_texts() -> Iterator[str]:
    """This repository's prose and code, in a fixed order."""
    paths = [REPO_ROOT / "README.md"]
    paths += sorted((REPO_ROOT / "docs").glob("*.md"))
    paths += sorted((REPO_ROOT / "plugserve").rglob("*.py"))
    for path in paths:
        if path.is_file() and (text := _read_text(path)) is not None:
            yield text


def _stdlib_files(stdlib: Path) -> list[Path]:
    files = []
    for path in stdlib.rglob("*"):
        rel = path.relative_to(stdlib)
        if rel.parts and rel.parts[0].startswith("config-"):
            continue
        if STDLIB_SKIP_PARTS.intersection(rel.parts) or path.suffix not in {".py", ".txt"} or not path.is_file():
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def _docstrings(source: str) -> list[str]:
    """The docstrings of a module, its classes and functions, in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                found.append(doc)
    return found


def _pydoc_topics(stdlib: Path) -> list[str]:
    """The text of pydoc's help topics (the language reference, in English), when the stdlib ships them."""
    path = stdlib / "pydoc_data" / "topics.py"
    source = _read_text(path) if path.is_file() else None
    if source is None:
        return []
    try:
        tree = ast.parse(source)
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "topics" for t in node.targets):
                topics = ast.literal_eval(node.value)
                return [topics[key] for key in sorted(topics)]
    except (SyntaxError, ValueError):
        pass
    return []


def stdlib_texts() -> Iterator[str]:
    """Prose (docstrings, pydoc topics, .txt files) and code from the Python standard library, capped."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():
        return
    files = _stdlib_files(stdlib)
    prose_left = STDLIB_PROSE_CAP
    for text in _pydoc_topics(stdlib):
        if prose_left <= 0:
            break
        yield text[:prose_left]
        prose_left -= len(text)
    code_left = STDLIB_CODE_CAP
    for path in files:
        source = _read_text(path)
        if source is None:
            continue
        pieces = [source] if path.suffix == ".txt" else _docstrings(source)
        for piece in pieces:
            if prose_left <= 0:
                break
            yield piece[:prose_left]
            prose_left -= len(piece)
        if path.suffix == ".py" and code_left > 0 and path.parent.name != "pydoc_data":
            code = source[: min(STDLIB_CODE_PER_FILE_CAP, code_left)]
            yield code
            code_left -= len(code)


def training_texts() -> list[str]:
    """The whole training text as a list of documents, in a fixed order."""
    return [*repo_texts(), *stdlib_texts()]


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


def build(output_dir: Path) -> None:
    """Train and save the tokenizer files into `output_dir`."""
    texts = training_texts()
    print(f"training on {len(texts)} documents, {sum(map(len, texts)):,} characters", file=sys.stderr)
    tokenizer = build_tokenizer(texts)
    assert len(tokenizer) == VOCAB_SIZE, f"vocabulary has {len(tokenizer)} tokens, expected {VOCAB_SIZE}"
    for path in save_tokenizer(tokenizer, output_dir):
        print(f"wrote {path} ({Path(path).stat().st_size:,} bytes)", file=sys.stderr)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT_DIR, help="where to write (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="rebuild in a temporary folder and compare to --output")
    args = parser.parse_args(argv)
    if not args.check:
        build(args.output)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        names = sorted(p.name for p in Path(tmp).iterdir())
        _, mismatch, errors = filecmp.cmpfiles(args.output, tmp, names, shallow=False)
        if mismatch or errors:
            print(f"differs from {args.output}: {mismatch + errors}", file=sys.stderr)
            return 1
    print(f"{args.output} is up to date", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
