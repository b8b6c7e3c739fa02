"""Held-out chat workloads for the drafter's card and the benchmarks.

Three shapes a serving system meets, none of them trained on (drafter training uses the
other stdlib modules and other questions, training/specd_train/drafter/prompts.py):
- chat: everyday questions, answered in prose;
- code_edit: an edit of a given function, where the answer repeats much of the prompt;
- summarize: a summary of a given text.
Built deterministically from fixed lists and the held-out stdlib modules.
"""
from __future__ import annotations

import ast

from specd_train.demo.corpus import load_corpus, read_text

CHAT_QUESTIONS = (
    "What causes the seasons on Earth?", "How do I make a good cup of tea?",
    "What is the difference between weather and climate?", "Why do cats purr?",
    "Explain how a bicycle works.", "What should I pack for a weekend camping trip?",
    "How does a refrigerator keep food cold?", "What are the benefits of regular exercise?",
    "Why is the sky blue?", "How do airplanes stay in the air?", "What is a prime number?",
    "Give me tips for writing a good resume.", "How do plants grow from seeds?",
    "What is the capital of Japan and what is it known for?", "How do I start learning to play the guitar?",
    "What is artificial intelligence?", "Why do we need to drink water?", "How does a rainbow form?",
    "What are some ways to reduce stress?", "Explain what a computer virus is.",
    "How do bees make honey?", "What is the theory of evolution?", "How can I improve my sleep?",
    "What is the difference between a virus and a bacterium?", "How does the internet work?",
    "What are the main causes of air pollution?", "How do I cook rice?", "Why do leaves change color in autumn?",
    "What is a healthy breakfast?", "How does a camera take a picture?", "What is the purpose of a budget?",
    "Why do we have different time zones?",
)
CODE_EDITS = (
    "Add type hints to this Python function and return the whole function:",
    "Add a docstring to this Python function and return the whole function:",
    "Rewrite this Python function with clearer variable names:",
    "Add comments to this Python function explaining each step, and return the whole function:",
)
WORKLOADS = ("chat", "code_edit", "summarize")


def workload(name: str, n: int = 32) -> list[list[dict]]:
    """n chat message lists of one workload (fewer only if the held-out modules run out)."""
    if name == "chat":
        return [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:n]]
    if name == "code_edit":
        funcs = _heldout_functions()
        return [[{"role": "user", "content": f"{CODE_EDITS[i % len(CODE_EDITS)]}\n\n```python\n{code}\n```"}]
                for i, (code, _) in enumerate(funcs[:n])]
    if name == "summarize":
        docs = [doc for _, doc in _heldout_functions() if doc and len(doc) >= 150]
        return [[{"role": "user", "content": f"Summarize the following text in a few sentences:\n\n{doc}"}]
                for doc in docs[:n]]
    raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")


def _heldout_functions(min_lines: int = 6, max_lines: int = 25) -> list[tuple[str, str | None]]:
    """(source, docstring) of held-out functions of a readable size, in file order."""
    out = []
    for path in load_corpus().heldout:
        source = read_text(path)
        lines = source.splitlines()
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in tree.body + [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]:
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                body = lines[node.lineno - 1:node.end_lineno]
                indent = len(body[0]) - len(body[0].lstrip())
                out.append(("\n".join(line[indent:] for line in body), ast.get_docstring(node)))
    return out
