"""A conversation's prompt as token ids with a reusable prefix:

    [system turn: system prompt + documents + retrieved sections]  [conversation]  [answer cue]
     ^ the prefix: its ids are the same in every prompt with the same system turn, so its KV
       blocks can be reused (and pinned) across turns and conversations

`system_content` writes the system turn the same way for every source (a local Session, a
remote one); `PromptLayout` renders it with the model's chat template (a base model: a plain
Question/Answer transcript) and tokenizes it.
"""

from __future__ import annotations

from typing import Sequence

from .documents import plain_text


def system_content(system_prompt: str | None, documents: Sequence, sections: Sequence = ()) -> str | None:
    """The system turn every source renders the same way: the system prompt, each whole document
    (``.name``, ``.text``), then retrieved ``sections`` (engine.retrieval.Section) grouped per
    document in the order they come; None when there is nothing."""
    from .retrieval import render_sections

    parts = [system_prompt] if system_prompt else []
    if documents or sections:
        parts.append("Answer using these documents.")
        for d in documents:
            parts.append(f"Document: {d.name}\n\n{plain_text(d.text).strip()}")
        names = list(dict.fromkeys(s.document for s in sections))
        for name in names:
            parts.append(render_sections(name, [s for s in sections if s.document == name]))
    return "\n\n".join(parts) if parts else None


class PromptLayout:
    """Renders prompts for `engine`'s model (its tokenizer and chat template)."""

    def __init__(self, engine):
        self.engine = engine
        self._memo: tuple[str, str, list[int]] | None = None  # (system content, text, ids)

    def render(self, system: str | None, conversation: Sequence[dict],
               add_generation_prompt: bool = True) -> tuple[list[int], int]:
        """Token ids of the prompt with the system turn `system` (None: none) before
        `conversation`, and the length of its prefix (0 when there is no system turn, or the
        chat template rewrites it so that no prefix of ids is shared)."""
        e, tok = self.engine, self.engine.tokenizer
        if e.has_chat_template:
            system_msgs = [{"role": "system", "content": system}] if system else []
            if not system_msgs:
                return e.encode_chat(list(conversation), add_generation_prompt), 0
            prefix_text, prefix_ids = self.encoded_prefix(system)
            full_text = tok.apply_chat_template(system_msgs + list(conversation),
                                                add_generation_prompt=add_generation_prompt)
            if not full_text.startswith(prefix_text):  # a template that rewrites the system turn
                return e.encode_chat(system_msgs + list(conversation), add_generation_prompt), 0
            rest = full_text[len(prefix_text):]
            return prefix_ids + (tok.encode(rest, add_bos=False, parse_special=True) if rest else []), len(prefix_ids)
        # A base model: a plain transcript.
        lines = []
        for m in conversation:
            who = "Question" if m["role"] == "user" else "Answer"
            lines.append(f"{who}: {m['content'].strip()}")
        rest = "\n".join(lines) + ("\nAnswer:" if add_generation_prompt else "")
        if not system:
            return tok.encode(rest, add_bos=True, parse_special=False), 0
        prefix_ids = self.encoded_prefix(system)[1]
        return prefix_ids + tok.encode(rest, add_bos=False, parse_special=False), len(prefix_ids)

    def encoded_prefix(self, system: str) -> tuple[str, list[int]]:
        """The prefix's rendered text and token ids for a system content. Remembered for the
        last content: every turn renders the prefix, and tokenizing pinned documents again each
        time (thousands of tokens) is work the first turn already did."""
        if self._memo is None or self._memo[0] != system:
            e, tok = self.engine, self.engine.tokenizer
            if e.has_chat_template:
                system_msgs = [{"role": "system", "content": system}]
                text = tok.apply_chat_template(system_msgs, add_generation_prompt=False)
                ids = e.encode_chat(system_msgs, add_generation_prompt=False)
            else:
                text = system + "\n\n"
                ids = tok.encode(text, add_bos=True, parse_special=False)
            self._memo = (system, text, ids)
        return self._memo[1], list(self._memo[2])
