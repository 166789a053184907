"""From a request body to a prompt: the endpoint's request checked (protocol.py, anthropic.py), the
messages rendered through the model's chat template with the tools (tools.py), tokenized, and its
max_tokens checked against the context and the KV budget. `OpenAIServer` asks it on the thread pool
(tokenizing a long conversation must not hold up the event loop).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from ..constrain import json_grammar
from ..errors import OmlxError
from ..kv.prefix import common_prefix
from . import tools
from .anthropic import parse_messages
from .protocol import bad, parse_chat, parse_completion

PREFIX_MEMO = 16  # system turns whose token ids are remembered (rendered once, not per request)


class PromptBuilder:
    """Args:
        engine: the served Engine (its tokenizer and chat template).
        model_id: the id /v1/models lists (named in errors); served_ids: the names a request may use.
        ctx: tokens a sequence may hold (prompt and completion); budget: the scheduler's KVBudget.
    """

    def __init__(self, engine, model_id: str, served_ids: tuple[str, ...], ctx: int, budget):
        self.engine = engine
        self.model_id = model_id
        self.served_ids = served_ids
        self.ctx = ctx
        self.budget = budget
        self.tool_family = tools.template_family(engine.tokenizer.chat_template)  # the tool-call syntax
        self._prefix_memo: OrderedDict[str, list[int]] = OrderedDict()  # system turn → its token ids
        self._prefix_lock = threading.Lock()  # prompts are encoded on the thread pool

    def encode(self, kind: str, req) -> list[int]:
        """The prompt's token ids: the messages rendered through the chat template (with the tools,
        and what the answer must start with), or the completion prompt as given or tokenized.
        Sets `req.prefix_tokens` (the system turn) and, for a required tool call, `req.tool_grammar`."""
        e = self.engine
        if kind in ("chat", "messages"):
            if not e.has_chat_template:
                raise bad(f"{self.model_id} has no chat template: use /v1/completions", "messages",
                          "unsupported_model")
            prepared = tools.prepare(req.messages, req.tools, req.tool_choice, self.tool_family)
            try:
                ids = e.encode_chat(prepared.messages, tools=prepared.tools)
            except Exception as exc:  # OmlxError, or a template raising on an unusual conversation (jinja)
                raise bad(f"the messages cannot be rendered with the model's chat template: {exc}",
                          "messages") from None
            # the answer continues the last assistant turn's text, then the start of a required call
            req.tool_prefill = prepared.prefill
            if prepared.call_schema is not None:
                try:
                    req.tool_grammar = json_grammar(prepared.call_schema)
                except OmlxError as exc:
                    raise bad(f"a tool's parameters cannot be used to constrain its call: {exc.user_message}",
                              "tools") from None
            req.prefix_tokens = self.system_turn_tokens(prepared.messages, prepared.tools, ids)
            prefill = getattr(req, "prefill", "") + prepared.prefill
            if prefill:
                ids = ids + e.tokenizer.encode(prefill, add_bos=False, parse_special=False)
            return ids
        if isinstance(req.prompt, list):
            return list(req.prompt)
        return e.encode_prompt(req.prompt)

    def system_turn_tokens(self, messages: list[dict], tools_: list | None, ids: list[int]) -> int:
        """How many leading tokens of the prompt `ids` are its system turn (the leading system
        messages and the tools): the prefix other requests with the same system prompt share,
        which the scheduler saves to disk. Found as the tokens two renderings of the system
        messages followed by different user messages share, so it also works for templates that
        write the system prompt into the first user turn (Gemma's) or the tools there (Llama
        3.1's). 0 without a system message (or when the conversation is all system messages)."""
        lead = 0
        while lead < len(messages) and messages[lead].get("role") == "system":
            lead += 1
        if lead == 0 or lead == len(messages):
            return 0
        key = json.dumps([messages[:lead], tools_], sort_keys=True, default=str)
        with self._prefix_lock:
            system_ids = self._prefix_memo.get(key)
            if system_ids is not None:
                self._prefix_memo.move_to_end(key)
        if system_ids is None:
            try:
                a, b = (self.engine.encode_chat([*messages[:lead], {"role": "user", "content": text}], tools=tools_)
                        for text in ("A", "Z"))
                system_ids = a[: common_prefix(a, b)]
            except Exception:  # a template raising on this conversation: nothing saved
                system_ids = []
            with self._prefix_lock:
                self._prefix_memo[key] = system_ids
                while len(self._prefix_memo) > PREFIX_MEMO:
                    self._prefix_memo.popitem(last=False)
        return common_prefix(system_ids, ids)

    def parse(self, kind: str, body: dict):
        """The endpoint's request object, every field checked (ApiError otherwise)."""
        if kind == "chat":
            return parse_chat(body, self.served_ids)
        if kind == "messages":
            return parse_messages(body, self.served_ids)
        return parse_completion(body, self.served_ids, self.engine.model.vocab_size)

    def room(self, kind: str, prompt_ids: list[int], req) -> int:
        """The request's max_tokens, checked against the context and the KV budget."""
        param = "prompt" if kind == "completions" else "messages"
        if not prompt_ids:
            raise bad("the prompt has no tokens", param)
        ctx = self.ctx
        if len(prompt_ids) >= ctx:
            raise bad(f"the prompt is {len(prompt_ids):,} tokens; this server's context holds {ctx:,} "
                      "(prompt and completion together)", param, "context_length_exceeded")
        room = ctx - len(prompt_ids)
        max_tokens = room if req.max_tokens is None else req.max_tokens
        if max_tokens > room:
            raise bad(f"max_tokens is {max_tokens:,} but the prompt ({len(prompt_ids):,} tokens) leaves "
                      f"room for {room:,} in this server's context of {ctx:,}", "max_tokens",
                      "context_length_exceeded")
        if not self.budget.fits(len(prompt_ids), max_tokens):
            raise bad(f"the prompt and max_tokens ({len(prompt_ids) + max_tokens:,} tokens) exceed the "
                      f"server's KV budget of {self.budget.kv_tokens:,} tokens", "max_tokens",
                      "context_length_exceeded")
        return max_tokens
