"""Which of a namespace's stream memories a question goes to, with ``stream.tuning.clusters`` > 1: one stream memory per
cluster of the questions' retrieval keys, so unlike questions do not pull one memory two ways (retrieval by key,
of a stream memory instead of a per-question one).

The clusters are found online, with no pass over the data: a question joins the cluster whose centroid is most
similar to its key (cosine), unless that similarity is below ``min_similarity`` and fewer than ``max_clusters``
exist, in which case it opens a new one. A centroid is the mean of the (unit) keys that joined it (kept as their
sum, compared by direction).
Cluster ``i``'s stream memory is the namespace ``"<namespace>#cluster-<i>"`` (see :func:`cluster_namespace`), a
stream memory like any other (versions, guard, export, deletion).

::

    <root>/<namespace folder>.clusters.safetensors   key sums [C, d] and counts [C], replaced atomically
    <root>/<namespace folder>.clusters.lock           held while a question is assigned

Clusters are never merged or moved apart: a cluster's index names its stream memory for good.
"""

from __future__ import annotations

import re
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
    """The stream memory of cluster ``index`` of ``namespace`` (a namespace too long to carry the suffix is
    refused by name)."""
    return validate_namespace(CLUSTER_NAMESPACE.format(namespace=namespace, index=index))


def belongs_to(stream_namespace: str, namespace: str) -> bool:
    """Whether a stream memory is ``namespace``'s own or one of its clusters' (``NS#cluster-<digits>`` only)."""
    return (
        stream_namespace == namespace
        or re.fullmatch(re.escape(namespace) + r"#cluster-\d+", stream_namespace) is not None
    )


def delete_streams(root: str | Path, namespace: str) -> list[int]:
    """Delete ``namespace``'s stream memory and its clusters' (every version) and the clusters themselves
    (``elm memories delete --stream``); the versions that were on disk. Learners start again from scratch."""
    path, lock = _cluster_files(root, validate_namespace(namespace))
    with lock:  # no learner assigns (and writes the clusters back) while they go
        mine = [s["namespace"] for s in list_streams(root) if belongs_to(s["namespace"], namespace)]
        if not mine and not path.exists():
            raise StoreError(f"namespace {namespace!r} has no stream memory under {Path(root)}")
        removed = [v for stream in mine for v in delete_stream(root, stream)]
        path.unlink(missing_ok=True)
    return removed


def _cluster_files(root: str | Path, namespace: str, lock_timeout: float = 600.0) -> tuple[Path, FileLock]:
    """A namespace's clusters file and the lock held while it is read and written."""
    root, name = Path(root), folder_name(namespace)
    return root / f"{name}.clusters.safetensors", FileLock(str(root / f"{name}.clusters.lock"), timeout=lock_timeout)


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
        self.path, self.lock = _cluster_files(root, self.namespace, lock_timeout)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key sums ``[C, d]`` (float32; a centroid is a row over its count) and counts ``[C]``; empty before
        the first question."""
        if not self.path.exists():
            return torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
        try:
            tensors = load_tensors(self.path.read_bytes())
            sums, counts = tensors["sums"], tensors["counts"]
        except Exception as exc:  # a damaged file: say which, never guess the clusters
            raise MemoryFormatError(f"stream clusters file {self.path} cannot be read: {exc}") from None
        return sums, counts

    def centroids(self) -> torch.Tensor:
        """Each cluster's mean key ``[C, d]``."""
        sums, counts = self.read()
        return sums / counts.clamp_min(1)[:, None].to(sums.dtype) if len(counts) else sums

    def assign(self, key: torch.Tensor, *, update: bool = True) -> tuple[int, float | None]:
        """The cluster ``key`` (a question's retrieval key, any shape) belongs to and its cosine similarity to
        that cluster's centroid (None: it opened the cluster). ``update``: record the question in its cluster
        (its centroid moves, a new cluster is kept); False only reads, for a question nothing learns from: it
        joins the most similar cluster that exists and never opens one (cluster 0 when there is none yet)."""
        unit = _unit(key)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            sums, counts = self.read()
            if len(counts) and sums.shape[1] != unit.numel():
                raise MemoryFormatError(
                    f"stream clusters {self.path} hold keys of size {sums.shape[1]}, this question's key has "
                    f"{unit.numel()} (another retrieval.key or model): use another namespace or store path"
                )
            if not len(counts):
                index, found = 0, None
            else:
                similarity = (sums / sums.norm(dim=1, keepdim=True).clamp_min(1e-12)) @ unit
                index, found = int(similarity.argmax()), float(similarity.max())
                if update and found < self.min_similarity and len(counts) < self.max_clusters:
                    index, found = len(counts), None
            if not update:
                return index, found
            if index == len(counts):  # a new cluster
                sums = torch.cat([sums, unit[None]]) if len(counts) else unit[None].clone()
                counts = torch.cat([counts, torch.ones(1, dtype=torch.long)])
            else:
                sums, counts = sums.clone(), counts.clone()
                sums[index] += unit
                counts[index] += 1
            write_bytes_atomic(self.path, save_tensors({"sums": sums.contiguous(), "counts": counts.contiguous()}))
        return index, found


def _unit(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1).to(torch.float32)
    return flat / flat.norm().clamp_min(1e-12)
