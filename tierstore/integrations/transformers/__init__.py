"""tierstore for transformers models: save the cache a model produced for a prompt into
tierstore (embedded or as a service) and restore it for a later prompt sharing the prefix.

``model_layout`` derives the store's layout from the model; ``CacheCodec`` turns a
``DynamicCache`` into envelopes and back (conventions in its module); ``PrefixCache`` runs
prefills that reuse cached prefixes through a ``LibraryBackend`` or ``ServiceBackend``.
Needs the ``transformers`` extra (``pip install tierstore[transformers]``).
"""

from tierstore.integrations.transformers.backends import (
    Fetched,
    LibraryBackend,
    PrefixBackend,
    ServiceBackend,
)
from tierstore.integrations.transformers.codec import (
    CacheCodec,
    CacheMismatchError,
    Envelopes,
    model_layout,
)
from tierstore.integrations.transformers.prefix import Prefilled, PrefixCache, Restored

__all__ = [
    "CacheCodec", "CacheMismatchError", "Envelopes", "Fetched", "LibraryBackend",
    "Prefilled", "PrefixBackend", "PrefixCache", "Restored", "ServiceBackend", "model_layout",
]
