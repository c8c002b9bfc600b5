"""The calibration corpus: English sentences from the Python standard library's docstrings, which
an embedding model's export embeds to calibrate int8/uint8 ranges, and a held-out part on which
bench/quantization.py measures how the quantised vectors rank.

The corpus is shipped (embeddings/tooling/calibration/); this module regenerates it, the same
bytes from the same Python version's standard library:

    .venv/bin/python -m embeddings.tooling.calibration_corpus [--check]

Nothing here is imported by the service: it reads the calibration vectors an export wrote.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import platform
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration"
CALIBRATION_CORPUS = CALIBRATION_DIR / "calibration.txt"
HELD_OUT_CORPUS = CALIBRATION_DIR / "held_out.txt"
CALIBRATION_TEXTS = 2000
HELD_OUT_TEXTS = 500
# The Python whose standard library the shipped files were drawn from: another version's docstrings
# differ, and so would a regenerated corpus.
SOURCE_PYTHON = "3.11.7"

# Test suites, demos and vendored code: their docstrings describe tests, not things.
SKIPPED_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__phello__"})
MIN_CHARACTERS, MAX_CHARACTERS = 40, 200
MIN_WORDS = 7
SENTENCE_END = re.compile(r"(?<=[a-z][.!?])\s+(?=[A-Z])")
# Code, markup, paths and symbols: what makes a docstring line something other than prose.
NOT_PROSE = re.compile(
    r"[^A-Za-z0-9 ,.;:'!?-]|\.\.|--|\b[a-z]+_[a-z]|\b\w+\.\w+\(|[A-Za-z][0-9]|[0-9][A-Za-z]"
)
WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


def sentences_of(docstring: str) -> Iterator[str]:
    """The prose sentences of a docstring: paragraphs of plain text (no examples, lists, tables or
    indented blocks), split at sentence ends, each kept when it reads as an English sentence."""
    for paragraph in re.split(r"\n\s*\n", inspect.cleandoc(docstring)):
        if any(
            line.startswith((" ", "\t", ">>>", "-", "*", "+", ":", "|", "#", "="))
            for line in paragraph.splitlines()
        ):
            continue
        text = " ".join(paragraph.split())
        for sentence in SENTENCE_END.split(text):
            if _is_prose(sentence):
                yield sentence


def _is_prose(sentence: str) -> bool:
    if not MIN_CHARACTERS <= len(sentence) <= MAX_CHARACTERS or not sentence.isascii():
        return False
    if not (sentence[0].isupper() and sentence[1].islower() and sentence.endswith(".")):
        return False
    if NOT_PROSE.search(sentence[:-1]):
        return False
    words = sentence.split()
    lowercase = sum(1 for word in words if word[0].islower())
    return (
        len(words) >= MIN_WORDS
        and lowercase >= 0.7 * len(words)
        and len(WORD.findall(sentence)) == len(words)
    )


def stdlib_sentences(stdlib: Path) -> list[str]:
    """Every distinct prose sentence of the docstrings of `stdlib`'s Python files (modules,
    classes, functions), in a fixed order: by the SHA-256 of the sentence, so any prefix of the
    list mixes all modules rather than following the alphabet."""
    seen: dict[str, str] = {}
    for path in sorted(stdlib.rglob("*.py")):
        if SKIPPED_PARTS.intersection(path.relative_to(stdlib).parts):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):  # lib2to3's deliberately broken examples
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                docstring = ast.get_docstring(node, clean=False)
                for sentence in sentences_of(docstring or ""):
                    seen.setdefault(sentence.lower(), sentence)
    return sorted(seen.values(), key=lambda sentence: hashlib.sha256(sentence.encode()).hexdigest())


def corpus_texts(stdlib: Path) -> tuple[list[str], list[str]]:
    """The calibration texts and the held-out texts: disjoint, CALIBRATION_TEXTS and HELD_OUT_TEXTS."""
    sentences = stdlib_sentences(stdlib)
    wanted = CALIBRATION_TEXTS + HELD_OUT_TEXTS
    if len(sentences) < wanted:
        raise SystemExit(f"{stdlib} has {len(sentences)} prose sentences in its docstrings, not {wanted}")
    return sentences[:CALIBRATION_TEXTS], sentences[CALIBRATION_TEXTS:wanted]


def read_corpus(path: Path) -> list[str]:
    """A corpus file's texts, one a line (UTF-8, newline-terminated)."""
    return path.read_text(encoding="utf-8").splitlines()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the shipped files instead of writing them"
    )
    parser.add_argument(
        "--stdlib",
        type=Path,
        default=Path(sysconfig.get_paths()["stdlib"]),
        help="the standard library to read (default: this Python's)",
    )
    args = parser.parse_args(argv)
    if platform.python_version() != SOURCE_PYTHON:
        print(
            f"warning: the shipped corpus comes from Python {SOURCE_PYTHON}'s standard library, this is "
            f"{platform.python_version()}'s: its docstrings, and so the corpus, may differ",
            file=sys.stderr,
        )
    calibration, held_out = corpus_texts(args.stdlib)
    files = {CALIBRATION_CORPUS: calibration, HELD_OUT_CORPUS: held_out}
    if args.check:
        differing = [path.name for path, texts in files.items() if read_corpus(path) != texts]
        print(f"differs: {', '.join(differing)}" if differing else "the shipped corpus is reproduced")
        return 1 if differing else 0
    CALIBRATION_DIR.mkdir(exist_ok=True)
    for path, texts in files.items():
        path.write_text("".join(f"{text}\n" for text in texts), encoding="utf-8")
        print(f"wrote {path} ({len(texts)} texts, {path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
