"""The Chroma-backed memory store: :class:`ChromaMemoryStore` and the parts it is built from.

Layout under ``StoreConfig.path`` (``~`` expanded)::

    chroma/           embedded Chroma (PersistentClient); unused when ``StoreConfig.url`` is set
    blobs/            content-addressed safetensors memories (see ``store/blobs.py``)
    utility.sqlite3   usage and utility counters, and the delete journal (see ``store/utility.py``)

**One collection per (model fingerprint, key kind, namespace)**, cosine space. A namespace
is therefore a structural boundary, not a ``where`` filter. Measured with
``benchmarks/retrieval.py`` (section ``namespace_isolation``, 20k KV keys, chromadb 1.5.9,
2 busy cores): a ``where`` on the namespace took the top-1 query from 9 ms to 128 ms p50
with every row matching, and to 63 ms when a quarter matched, against 5.2 ms for that
quarter in a collection of its own and 5.6 ms in a database of its own. Collections and
databases isolate equally fast; collections win on handling: a Chroma client is bound to
one database, so a process serving several namespaces would need a client per namespace,
while a collection needs only a name, and works unchanged against a server.

Modules, one concern each:

- ``store.py``       the class: write path, reads and search, utility counters
- ``index.py``       collections (found, created, cached, HNSW settings) and rows, in batches
- ``rows.py``        collection names and row metadata; records built from rows (no client)
- ``connection.py``  the chromadb client: embedded, or a server with tenant, database and token
- ``deletes.py``     journalled deletes (crash-safe order) and index compaction
- ``capacity.py``    eviction (``max_memories``) and expiry (``ttl_days``)
- ``check.py``       ``check`` / ``check --repair``
- ``merges.py``      key matrices for clustering; a merge's commit (merged memory first, then members)
- ``rebuild.py``     collections rewritten with their live rows (HNSW keeps deleted entries)
"""

from elm_memory.store.chroma.capacity import EVICTION_POLICIES
from elm_memory.store.chroma.connection import DEFAULT_DATABASE, DEFAULT_TENANT
from elm_memory.store.chroma.index import DEFAULT_HNSW, KIND_HNSW
from elm_memory.store.chroma.rows import collection_name
from elm_memory.store.chroma.store import ChromaMemoryStore

__all__ = [
    "DEFAULT_DATABASE",
    "DEFAULT_HNSW",
    "DEFAULT_TENANT",
    "EVICTION_POLICIES",
    "KIND_HNSW",
    "ChromaMemoryStore",
    "collection_name",
]
