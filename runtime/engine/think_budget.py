"""A thinking budget: after `budget` tokens of reasoning the model's think block is closed for it.

Reasoning models (Qwen3, SmolLM3, DeepSeek-R1 distills) may think for thousands of tokens; a client that
wants an answer within a budget asks for `max_reasoning_tokens` (llama.cpp #17750, ollama #17561). Once a
reply has spent the budget inside `<think>`, every next token is forced to the close tag's tokens (all
other logits masked), so the model goes on to its answer instead of being cut by max_tokens. The tag is
seen in the text, not matched by id: a byte vocabulary spells `</think>` out.

It is a grammar to the engine (runtime/engine/grammar.py's mask / accept / done), wrapping the request's
own grammar, if any, which sees every token, forced or not.
"""

from __future__ import annotations

import torch


class ThinkBudget:
    def __init__(self, budget: int, tags: tuple[str, str], in_think: bool, tokenizer, inner=None):
        """budget: reasoning tokens allowed; tags: the template's (open, close) (server/reply.py think_tags);
        in_think: the prompt already opened the block (the generation prompt ends with `<think>`)."""
        self.budget, (self.open, self.close), self.tok, self.inner = budget, tags, tokenizer, inner
        self.thinking, self.spent = in_think, 0
        self.forced: list[int] | None = None  # the close tag's tokens still to force, once the budget is spent
        self.tail = ""  # the output's last characters, for spotting either tag

    def mask(self, logits: torch.Tensor) -> None:
        if self.inner is not None:
            self.inner.mask(logits)
        if self.thinking and self.spent >= self.budget:
            if self.forced is None:  # the rest of the tag: the model may have begun typing it
                typed = max((n for n in range(len(self.close)) if self.tail.endswith(self.close[:n])), default=0)
                self.forced = self.tok.encode(self.close[typed:], add_special=False)
            token = self.forced[0]
            keep = logits[token].clone()
            logits.fill_(float("-inf"))
            logits[token] = keep if torch.isfinite(keep) else 0.0  # forced even where the inner grammar differs

    def accept(self, token: int) -> None:
        if self.inner is not None:
            self.inner.accept(token)
        if self.thinking and self.forced:
            self.forced = self.forced[1:]
        elif self.thinking:
            self.spent += 1
        text = self.tok.token_bytes(token).decode("utf-8", errors="replace")
        self.tail = (self.tail + text)[-max(len(self.open), len(self.close)):]
        if self.thinking and (self.tail.endswith(self.close) or self.forced == []):
            self.thinking, self.forced, self.tail = False, None, ""
        elif not self.thinking and self.tail.endswith(self.open):  # the budget is for the whole reply
            self.thinking, self.tail = True, ""

    @property
    def done(self) -> bool:
        return self.inner.done if self.inner is not None else False

    def reset(self) -> None:
        if self.inner is not None:
            self.inner.reset()
