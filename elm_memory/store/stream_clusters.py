"""Which of a namespace's stream memories a question goes to, with ``stream.clusters`` > 1: one stream memory per
cluster of the questions' retrieval keys, so unlike questions do not pull one memory two ways.

The clusters are found online, with no pass over the data: a question joins the cluster whose centroid is most
similar to its key (cosine), unless that similarity is below ``min_similarity`` and fewer than ``max_clusters``
exist, in which case it opens a new one. A centroid is the running mean of the (unit) keys that joined it.
Cluster ``i``'s stream memory is the namespace ``"<namespace>#cluster-<i>"`` (see :func:`cluster_namespace`), a
stream memory like any other (versions, guard, export, deletion).

::

    <root>/<namespace folder>.clusters.safetensors   centroids [C, d] and counts [C], replaced atomically
    <root>/<namespace folder>.clusters.lock           held while a question is assigned

Clusters are never merged or moved apart: a cluster's index names its stream memory for good.
"""

from __future__ import annotations

from pathlib import Path

import torch
from filelock import FileLock
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from elm_memory.atomic import write_bytes_atomic
from elm_memory.errors import MemoryFormatError, StoreError
from elm_memory.memory.ids import validate_namespace
from elm_memory.store.stream_files import delete_stream, folder_name, list_streams

#: How cluster ``i`` of a namespace names its stream memory.
CLUSTER_NAMESPACE = "{namespace}#cluster-{index}"


def cluster_namespace(namespace: str, index: int) -> str:
    """The stream memory of cluster ``index`` of ``namespace``."""
    return CLUSTER_NAMESPACE.format(namespace=namespace, index=index)


def belongs_to(stream_namespace: str, namespace: str) -> bool:
    """Whether a stream memory is ``namespace``'s own or one of its clusters'."""
    return stream_namespace == namespace or stream_namespace.startswith(cluster_namespace(namespace, 0)[:-1])


def delete_streams(root: str | Path, namespace: str) -> list[int]:
    """Delete ``namespace``'s stream memory and its clusters' (every version) and the clusters themselves
    (``elm memories delete --stream``); the versions that were on disk. Learners start again from scratch."""
    mine = [s["namespace"] for s in list_streams(root) if belongs_to(s["namespace"], namespace)]
    clusters = Path(root) / f"{folder_name(namespace)}.clusters.safetensors"
    if not mine and not clusters.exists():
        raise StoreError(f"namespace {namespace!r} has no stream memory under {Path(root)}")
    removed = [v for stream in mine for v in delete_stream(root, stream)]
    clusters.unlink(missing_ok=True)
    return removed


class StreamClusters:
    """A namespace's clusters of question keys, on disk, shared by every process that learns in it."""

    def __init__(
        self,
        root: str | Path,
        namespace: str,
        *,
        max_clusters: int,
        min_similarity: float,
        lock_timeout: float = 600.0,
    ):
        if max_clusters < 1:
            raise ValueError(f"max_clusters must be at least 1, got {max_clusters}")
        self.namespace = validate_namespace(namespace)
        self.max_clusters = max_clusters
        self.min_similarity = min_similarity
        root = Path(root)
        self.path = root / f"{folder_name(namespace)}.clusters.safetensors"
        self._lock = FileLock(str(root / f"{folder_name(namespace)}.clusters.lock"), timeout=lock_timeout)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Centroids ``[C, d]`` (float32, unit rows) and counts ``[C]``; empty before the first question."""
        if not self.path.exists():
            return torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
        try:
            tensors = load_tensors(self.path.read_bytes())
            centroids, counts = tensors["centroids"], tensors["counts"]
        except Exception as exc:  # a damaged file: say which, never guess the clusters
            raise MemoryFormatError(f"stream clusters file {self.path} cannot be read: {exc}") from None
        return centroids, counts

    def assign(self, key: torch.Tensor, *, update: bool = True) -> tuple[int, float | None]:
        """The cluster ``key`` (a question's retrieval key, any shape) belongs to and its cosine similarity to
        that cluster's centroid (None: it opened the cluster). ``update``: record the question in its cluster
        (its centroid moves, a new cluster is kept); False only reads, for a question nothing learns from."""
        unit = _unit(key)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            centroids, counts = self.read()
            if len(counts) and centroids.shape[1] != unit.numel():
                raise MemoryFormatError(
                    f"stream clusters {self.path} hold keys of size {centroids.shape[1]}, this question's key has "
                    f"{unit.numel()} (another retrieval.key or model): use another namespace or store path"
                )
            best, best_similarity = -1, float("-inf")
            if len(counts):
                similarity = centroids @ unit
                best = int(similarity.argmax())
                best_similarity = float(similarity[best])
            if best_similarity < self.min_similarity and len(counts) < self.max_clusters:
                index, found = len(counts), None
                centroids = torch.cat([centroids, unit[None]]) if len(counts) else unit[None].clone()
                counts = torch.cat([counts, torch.ones(1, dtype=torch.long)])
            else:
                index, found = best, best_similarity
                n = int(counts[index])
                centroids = centroids.clone()
                centroids[index] = _unit(centroids[index] * n + unit)  # the running mean's direction
                counts = counts.clone()
                counts[index] = n + 1
            if update:
                write_bytes_atomic(
                    self.path, save_tensors({"centroids": centroids.contiguous(), "counts": counts.contiguous()})
                )
        return index, found


def _unit(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1).to(torch.float32)
    return flat / flat.norm().clamp_min(1e-12)
