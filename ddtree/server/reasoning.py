"""`--reasoning-parser qwen3 | deepseek-r1`: a thinking model's `<think>...</think>` block split
from its answer, incrementally (a tag may arrive split across any number of chunks).

qwen3: the output is reasoning only where it opens `<think>` (after optional whitespace) or where
the rendered prompt left one open (Qwen3.5 / 3.6 templates end the generation prompt with
`<think>\\n`; `enable_thinking: false` closes it there). deepseek-r1: the output starts in
reasoning (R1's template opens the block). Reasoning ends at `</think>`; a block cut by
max_tokens or a stop string leaves everything in reasoning and no content. Output without a block
is the content byte for byte (leading spaces of code included; no reasoning: None). Around a block
the newlines Qwen3's template puts there (`<think>\n` reasoning `\n</think>\n\n` answer: it
strips them with `strip('\n')` when it renders a turn back) belong to neither part, and so does
whitespace before `<think>`; spaces after `</think>` are the answer's. Streaming and
non-streaming results are the same parser fed differently, so the deltas concatenate to the
non-streamed fields.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
NL = "\n"  # what the template puts around the block's parts
PARSERS = ("qwen3", "deepseek-r1")


def prompt_opens_reasoning(prompt: str) -> bool:
    """The rendered prompt ends inside an open `<think>` block."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, kind: str, prompt: str = ""):
        if kind not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {PARSERS}, got {kind!r}")
        self.state = (
            "reason" if kind == "deepseek-r1" or prompt_opens_reasoning(prompt) else "start"
        )
        self.lead = True  # at the start of the current part: its leading newlines are dropped
        self.buf = ""
        self.saw_reasoning = self.state == "reason"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that text completes; final: no more text comes (flush)."""
        self.buf += text
        reasoning, content = [], []
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(OPEN):
                    self.buf, self.state, self.lead, self.saw_reasoning = (
                        s[len(OPEN) :],
                        "reason",
                        True,
                        True,
                    )
                    continue
                if not final and (not s or OPEN.startswith(s)):
                    return "".join(reasoning), "".join(content)  # may still open a block
                # no block: the answer is the output as it is, whitespace and all
                self.state, self.lead = "content", False
                continue
            if self.state == "reason":
                if self.lead:
                    self.buf = self.buf.lstrip(NL)
                    if not self.buf and not final:
                        break
                    self.lead = False
                i = self.buf.find(CLOSE)
                if i >= 0:
                    reasoning.append(self.buf[:i].rstrip(NL))
                    self.buf, self.state, self.lead = self.buf[i + len(CLOSE) :], "content", True
                    continue
                if final:
                    reasoning.append(self.buf)
                    self.buf = ""
                    break
                keep = _partial_suffix(self.buf, CLOSE)
                body = self.buf[: len(self.buf) - keep]
                ws = len(body) - len(body.rstrip(NL))  # trailing newlines may precede </think>
                reasoning.append(body[: len(body) - ws])
                self.buf = self.buf[len(body) - ws :]
                break
            # content
            if self.lead:  # after </think>
                self.buf = self.buf.lstrip(NL)
                if not self.buf:
                    break
                self.lead = False
            content.append(self.buf)
            self.buf = ""
            break
        return "".join(reasoning), "".join(content)

    def parse(self, text: str) -> tuple[str | None, str]:
        """The whole output at once: (reasoning or None when there was no block, content)."""
        r, c = self.feed(text, final=True)
        return (r if self.saw_reasoning else None), c
