"""One family of errors a user can act on.

Every error the engine raises for a reason outside the program (a file, a setting, a document, the
context or the KV memory running out) is an `OmlxError`; its message is written for the user and
`kind` names the case for machines (the worker's results, `--json` output). Anything else that
escapes (a `MemoryError` from numpy, a bug) is not in this family and is reported as what it is.

    OmlxError
    ├── ModelError            a model file that cannot be used (GGUFError, TokenizerError)
    │   └── UnsupportedModel  an architecture or tensor type the engine does not implement
    ├── SettingsError         a KV spec or settings value (also a ValueError: KVConfigError)
    ├── DocumentError         a document that cannot be read or does not fit
    ├── ContextFull           no room for the next tokens under the overflow policy
    ├── KVPoolFull            a layer's block pool has no free block (a memory budget, not the context)
    ├── CatalogError          a catalog model that cannot be fetched or found
    │   └── HubError          a Hugging Face repo or file that cannot be listed or downloaded
    └── EngineError           any other request the engine cannot serve
        └── DoesNotFit        a model whose estimated memory exceeds what the machine has free
"""

from __future__ import annotations


class OmlxError(Exception):
    """A failure the user can act on; `str(error)` is the message to show them."""

    kind = "error"

    @property
    def user_message(self) -> str:
        return str(self).strip() or self.kind.replace("_", " ")


class ModelError(OmlxError):
    """A model file that cannot be used; the message says why in words a user can act on."""

    kind = "bad_model"


class UnsupportedModel(ModelError):
    """A well-formed model file whose architecture or tensor type the engine does not implement."""

    kind = "unsupported_model"


class SettingsError(OmlxError, ValueError):
    """A setting or spec that cannot be used as written (names the closest valid one)."""

    kind = "bad_settings"


class DocumentError(OmlxError):
    """A document that cannot be read or does not fit."""

    kind = "bad_document"


class ContextFull(OmlxError):
    """No room for the next tokens: the context limit under the `stop` policy, or nothing left
    that the policy may drop (pinned prefix + new tokens exceed the context)."""

    kind = "context_full"


class KVPoolFull(OmlxError):
    """A layer's block pool has no free block left (its `max_blocks`, after evicting unused cached
    blocks). Distinct from ContextFull: the context may have room while the memory budget has not."""

    kind = "kv_pool_full"


class CatalogError(OmlxError):
    """A catalog model that cannot be fetched or found."""

    kind = "catalog"


class HubError(CatalogError):
    """A Hugging Face repo or file that cannot be listed, downloaded or verified."""

    kind = "hub"


class EngineError(OmlxError):
    """A request the engine cannot serve; the message is meant for the user."""

    kind = "engine"


class DoesNotFit(EngineError):
    """Loading would need more memory than is available (the will-it-fit estimate); the CLI's
    --force loads anyway."""

    kind = "does_not_fit"


def describe(exc: BaseException) -> tuple[str, str]:
    """(kind, message) for any exception: the family's own, "out_of_memory" for a real
    MemoryError, "internal" with the class name for anything else (a bug to report)."""
    if isinstance(exc, OmlxError):
        return exc.kind, exc.user_message
    if isinstance(exc, MemoryError):
        return "out_of_memory", "out of memory: " + (str(exc).strip() or "the machine has no memory left")
    text = str(exc).strip()
    return "internal", f"{type(exc).__name__}: {text}" if text else type(exc).__name__
