"""Chat prompts the target answers to make the drafter's training text.

Built deterministically from the training split of the Python standard library (docstrings,
function sources, module docs) and from fixed topic lists, in the three shapes speculation
is benchmarked on: questions, code edits that repeat much of the prompt, and summaries.
The benchmark workloads (bench/workloads.py) come from the held-out modules and other
questions, so nothing here is scored on.
"""
from __future__ import annotations

import ast
import random
from pathlib import Path

from specd_train.demo.corpus import load_corpus, read_text

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
    "compound interest", "vaccines", "plate tectonics", "the Roman Empire", "climate change",
    "the human heart", "volcanoes", "electric cars", "the stock market", "recycling", "the moon landing",
    "DNA", "renewable energy", "the printing press", "earthquakes", "honey bees", "the immune system",
    "inflation", "the internet", "solar panels", "coffee", "the Great Wall of China", "rainbows",
    "democracy", "sleep", "gravity", "antibiotics", "the Industrial Revolution", "coral reefs",
    "blockchain", "meditation", "the Olympic Games", "tides", "nuclear power", "bread baking",
    "the periodic table", "hurricanes", "the Renaissance", "dinosaurs", "public speaking",
    "time management", "healthy eating", "learning a new language", "budgeting", "gardening",
)
QUESTION_TEMPLATES = (
    "What is {t}?", "Explain {t} to a ten-year-old.", "Give me three interesting facts about {t}.",
    "Why is {t} important?", "Write a short paragraph about {t}.", "What are the pros and cons of {t}?",
    "How does {t} work?", "Write a short story that involves {t}.", "What are common misconceptions about {t}?",
    "Write a haiku about {t}.", "Summarize the history of {t}.", "How can I learn more about {t}?",
)
# share of each kind in the mix (the rest of a kind's prompts are left out)
MIX = {"question": 0.35, "summary": 0.15, "edit": 0.25, "explain": 0.15, "write": 0.10}
CODE_EDITS = (
    "Add type hints to this Python function and return the whole function:",
    "Add a docstring to this Python function and return the whole function:",
    "Rewrite this Python function with clearer variable names:",
    "Fix any bugs in this Python function and return the corrected code:",
)


def training_prompts(limit: int, seed: int = 0, corpus_root: Path | None = None) -> list[list[dict]]:
    """`limit` chat message lists mixed by MIX, in a fixed shuffled order."""
    corpus = load_corpus(corpus_root)
    kinds: dict[str, list[str]] = {k: [] for k in MIX}
    kinds["question"] = [q.format(t=t) for t in TOPICS for q in QUESTION_TEMPLATES]
    for path in corpus.train:
        tree = _parse(path)
        if tree is None:
            continue
        doc = ast.get_docstring(tree)
        if doc and 200 <= len(doc) <= 1500:
            kinds["summary"].append(f"Summarize the following text in a few sentences:\n\n{doc}")
        for name, code, fdoc in _functions(tree, read_text(path)):
            if fdoc and 200 <= len(fdoc) <= 1500:
                kinds["summary"].append(f"Summarize the following documentation:\n\n{fdoc}")
            edit = CODE_EDITS[hash_name(name) % len(CODE_EDITS)]
            kinds["edit"].append(f"{edit}\n\n```python\n{code}\n```")
            kinds["explain"].append(f"Explain what this Python function does:\n\n```python\n{code}\n```")
            if fdoc:
                first = fdoc.strip().splitlines()[0].rstrip(".")
                kinds["write"].append(f"Write a Python function `{name}`: {first}.")
    rng = random.Random(seed)
    prompts = []
    for kind, share in MIX.items():
        pool = kinds[kind]
        rng.shuffle(pool)
        prompts += pool[: round(share * limit)]
    rng.shuffle(prompts)
    return [[{"role": "user", "content": p}] for p in prompts[:limit]]


def hash_name(name: str) -> int:
    # Python's hash() is salted per process; this one is not.
    return sum((i + 1) * ord(c) for i, c in enumerate(name))


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(read_text(path))
    except (SyntaxError, ValueError):
        return None


def _functions(tree: ast.Module, source: str, min_lines: int = 4, max_lines: int = 30):
    """(name, source, docstring) of top-level and method functions of a readable size."""
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
            n = node.end_lineno - node.lineno + 1
            if min_lines <= n <= max_lines:
                body = lines[node.lineno - 1: node.end_lineno]
                indent = len(body[0]) - len(body[0].lstrip())
                yield node.name, "\n".join(line[indent:] for line in body), ast.get_docstring(node)
