"""The thinking budget (runtime/engine/think_budget.py): after `budget` reasoning tokens the close tag is
forced token by token, the request's own grammar sees every token, and a reply that closes its block in
time is left alone. The tokenizer is the default model's, which spells the tags out in several tokens."""

from __future__ import annotations

import torch

from lowbit.runtime.engine.think_budget import ThinkBudget

TAGS = ("<think>", "</think>")


class Recorder:
    """An inner grammar that allows everything and records what it saw."""

    def __init__(self):
        self.seen, self.masked = [], 0

    def mask(self, logits):
        self.masked += 1

    def accept(self, token):
        self.seen.append(token)

    done = False


def _generate(budget: ThinkBudget, prefer: list[int], V: int) -> list[int]:
    """Greedy decoding of a 'model' whose every step prefers prefer[step]."""
    out = []
    for want in prefer:
        logits = torch.zeros(V)
        logits[want] = 5.0
        budget.mask(logits)
        token = int(logits.argmax())
        budget.accept(token)
        out.append(token)
    return out


def test_the_block_is_closed_after_the_budget(default_model):
    tok = default_model.tokenizer
    a = tok.encode(" a", add_special=False)[0]
    close = tok.encode("</think>", add_special=False)
    assert len(close) > 1  # spelled out: the test covers forcing several tokens
    inner = Recorder()
    budget = ThinkBudget(5, TAGS, True, tok, inner)
    out = _generate(budget, [a] * 20, tok.vocab_size)
    assert out == [a] * 5 + close + [a] * (15 - len(close))
    assert inner.seen == out and inner.masked == 20
    assert tok.decode(out).split("</think>")[0] == " a" * 5


def test_thinking_opened_by_the_model_counts_from_its_tag_and_a_timely_close_is_left_alone(default_model):
    tok = default_model.tokenizer
    a = tok.encode(" a", add_special=False)[0]
    opened = tok.encode("<think>", add_special=False)
    close = tok.encode("</think>", add_special=False)
    script = opened + [a] * 3 + close + [a] * 10
    assert _generate(ThinkBudget(5, TAGS, False, tok), script, tok.vocab_size) == script
    out = _generate(ThinkBudget(2, TAGS, False, tok), opened + [a] * 10, tok.vocab_size)
    assert out == opened + [a] * 2 + close + [a] * (8 - len(close))
