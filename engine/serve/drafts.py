"""The drafts of the scheduler's decode passes: prompt lookup (`--speculate lookup`) or a draft
model (`--draft MODEL`, which wins when both are given).

A decode pass computes up to `group` rows (DECODE_GROUP) each exactly as it is computed alone; a
batch of fewer sequences leaves rows over, and they go to the sequences' drafts in batch order
(`Drafts.for_pass`; a full batch drafts nothing). The scheduler verifies every draft in the same
pass as the batch's plain rows and rolls the rejected rows back.

Draft model (`ModelDrafts`): each sequence has a `speculate.DraftModel` on a cache of the draft
model's own prefix cache (its pools at the main model's KV spec, `speculate.draft_kv`; the draft
model's own prefix reuse; no disk, no master copies), started at admission on the longest cached
prefix of the prompt. Its pools have the KV budget's blocks per layer: a sequence's draft cache
holds at most history + draft[:-1] <= prompt + max_tokens - 2 tokens, inside the worst case its
admission reserved, so whenever the running sequences fit the budget their draft caches fit the
draft's pools (blocks the draft's prefix cache keeps for no sequence are evicted on demand). A
pool that is short all the same (a bug) costs drafts, never an answer: the step drafts nothing.

One step drafts for the whole batch at once: the tokens each draft cache lacks (the accepted
tokens and the next one; after admission the prompt, read in chunks of at most `prefill_chunk`
tokens per step, the sequence not drafting until the draft model has caught up) go through one
pass (`kv.batch.SequenceBatch` of `VerifyBatch`es: every row as that token's decode step alone),
and the draft's further tokens through one `DecodeBatch` pass each, over the sequences still
drafting (a draft ends with a token that ends the answer). Drafts are greedy; their rounding
never changes an answer, only what is accepted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..errors import ContextFull, KVPoolFull
from ..kv.batch import DecodeBatch, SequenceBatch, VerifyBatch
from ..speculate import DraftModel, PromptLookup, draft_kv

log = logging.getLogger("omlx.serve")

CATCH_UP_ROWS = 8  # a draft cache lacking more tokens than this reads them as a prefill first


class Drafts:
    """The drafters of an engine's sequences and the drafts of each decode pass.

    Args:
        engine: the served Engine (its `speculate` and `draft_engine`).
        group: the rows of one exact decode pass (a draft is at most group - 1 tokens).
        prefill_chunk: the most prompt tokens a draft model reads per step (the scheduler's).
    """

    def __init__(self, engine, group: int, prefill_chunk: int):
        self.group = group
        self.model = ModelDrafts(engine, group, prefill_chunk) if engine.draft_engine is not None else None
        self.lookup = self.model is None and engine.speculate == "lookup"
        self.stop_ids = engine.tokenizer.stop_ids  # a lookup draft ends with a token that ends the answer

    def start(self, kv_tokens: int) -> None:
        """On the engine thread, before the first sequence: the draft model's pools."""
        if self.model is not None:
            self.model.start(kv_tokens)

    def new(self, prompt_ids: Sequence[int], ctx: int):
        """The drafter of a sequence admitted with `prompt_ids` (None without speculation)."""
        if self.model is not None:
            return self.model.new(prompt_ids, ctx)
        return PromptLookup(max_draft=self.group - 1, stop_ids=self.stop_ids) if self.lookup else None

    def for_pass(self, drafters: list, histories: list, rooms: list[int]) -> list[list[int]]:
        """Each sequence's draft for this pass ([] for none): sequence i's at most rooms[i] tokens
        (speculate.draft_room), the rows beyond one per sequence handed out in order."""
        spare = self.group - len(drafters)
        if self.model is not None:
            wants = []
            for drafter, history, room in zip(drafters, histories, rooms):
                k = drafter.want(len(history), min(room, spare)) if drafter is not None and spare > 0 else 0
                spare -= k
                wants.append(k)
            return self.model.draft(drafters, histories, wants)
        drafts: list[list[int]] = []
        for drafter, history, room in zip(drafters, histories, rooms):
            draft = drafter.draft(history, min(room, spare)) if drafter is not None and min(room, spare) > 0 else []
            spare -= len(draft)
            drafts.append(draft)
        return drafts

    def gauges(self, metrics, budget) -> None:
        """The draft model's KV gauges; its pools have the KV budget's blocks (`start`)."""
        if self.model is not None and self.model.prefix is not None:
            metrics.draft_kv_bytes_in_use.set(self.model.prefix.nbytes)
            metrics.draft_kv_bytes_capacity.set(budget.capacity_bytes(self.model.prefix))


class ModelDrafts:
    """A draft model's caches for the scheduler's sequences, and its drafts for a batch (see the
    module's doc)."""

    def __init__(self, engine, group: int, prefill_chunk: int):
        self.main = engine
        self.engine = engine.draft_engine
        self.group = group
        self.prefill_chunk = prefill_chunk
        self.prefix = None  # the draft model's PrefixCache, made on the engine thread (start)

    def start(self, kv_tokens: int) -> None:
        draft = self.engine
        draft.disk_cache = False
        draft.master_copies = False
        draft.set_kv(draft_kv(self.main.kv_config, draft.model))
        draft.prefixes.set_capacity_tokens(kv_tokens)
        self.prefix = draft.prefix_cache()

    def new(self, prompt_ids: Sequence[int], ctx: int) -> DraftModel:
        cache = self.prefix.new_sequence(limit=min(ctx, self.engine.model.context_length), overflow="stop")
        held = 0
        try:
            if len(prompt_ids) <= cache.limit:
                held = self.prefix.attach(cache, prompt_ids).tokens
        except Exception:  # never the request's problem: the draft model reads the whole prompt
            log.exception("draft model: attaching a cached prefix failed")
            cache.release()
            cache = self.prefix.new_sequence(limit=cache.limit, overflow="stop")
        return DraftModel(self.engine, max_draft=self.group - 1, cache=cache, held=prompt_ids[:held])

    def draft(self, drafters: list, histories: list, wants: list[int]) -> list[list[int]]:
        """Up to wants[i] greedy tokens after histories[i] for each sequence; fewer (none) for
        a sequence whose draft model is still reading its prompt, or when a pool is short."""
        out: list[list[int]] = [[] for _ in drafters]
        ready: list[tuple[int, list[int]]] = []  # (sequence, the tokens its draft cache lacks)
        budget = self.prefill_chunk
        try:
            for i, (drafter, history, k) in enumerate(zip(drafters, histories, wants)):
                if not k:
                    continue
                feed = drafter.sync(history)
                if len(feed) > CATCH_UP_ROWS:
                    take = min(len(feed) - 1, budget)
                    self._read(drafter, feed[:take])
                    budget -= take
                    if take < len(feed) - 1:
                        continue  # drafts once it has caught up
                    feed = feed[take:]
                ready.append((i, feed))
            if ready:
                self._run(drafters, ready, wants, out)
        except (ContextFull, KVPoolFull) as exc:  # unchanged caches: this step drafts what it has
            log.debug("draft model: %s", exc)
        return out

    def _read(self, drafter: DraftModel, ids: list[int]) -> None:
        """Feed `ids` to the draft cache in prefill chunks, no logits."""
        model = self.engine.model
        step = self.engine.chunk_size(drafter.cache)
        for start in range(0, len(ids), step):
            chunk = ids[start : start + step]
            model.forward(np.asarray(chunk, np.int64), drafter.cache, np.empty(0, np.int64))
            drafter.held.extend(chunk)

    def _run(self, drafters: list, ready: list[tuple[int, list[int]]], wants: list[int], out: list) -> None:
        model = self.engine.model
        verifies = [VerifyBatch(drafters[i].cache) for i, _ in ready]
        counts = [len(feed) for _, feed in ready]
        tokens = np.concatenate([np.asarray(feed, np.int64) for _, feed in ready])
        cache = verifies[0] if len(ready) == 1 else SequenceBatch(verifies, counts)
        logits = model.forward(tokens, cache, np.cumsum(counts) - 1)  # (len(ready), vocab)
        for verify in verifies:
            verify.finish(0)
        for (i, feed), row in zip(ready, logits):
            drafters[i].held.extend(feed)
            out[i].append(int(np.argmax(row)))
        active = [i for i, _ in ready if wants[i] > 1 and out[i][-1] not in drafters[i].stop_ids]
        while active:
            caches = [drafters[i].cache for i in active]
            tokens = np.array([out[i][-1] for i in active], np.int64)
            logits = model.forward(tokens, caches[0] if len(active) == 1 else DecodeBatch(caches), "all")
            for i, row in zip(active, logits):
                drafters[i].held.append(out[i][-1])
                out[i].append(int(np.argmax(row)))
            active = [i for i in active if len(out[i]) < wants[i] and out[i][-1] not in drafters[i].stop_ids]
