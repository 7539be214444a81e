"""One stream memory per cluster of the questions' retrieval keys (``stream.tuning.clusters``): clusters found online,
kept on disk and shared between learners, listed and deleted with their namespace."""

from __future__ import annotations

import threading

import pytest
import torch

from elm_memory.config import ELMConfig
from elm_memory.errors import ConfigError, InvalidNamespaceError, MemoryFormatError, StoreError
from elm_memory.retrieval.stream_clusters import StreamClusters, belongs_to, cluster_namespace, delete_streams

X, Y = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])


def _clusters(tmp_path, **kw) -> StreamClusters:
    return StreamClusters(tmp_path, "team", max_clusters=kw.pop("max_clusters", 3), min_similarity=0.8, **kw)


def test_a_question_joins_the_nearest_cluster_or_opens_one_while_there_is_room(tmp_path):
    clusters = _clusters(tmp_path, max_clusters=2)
    assert clusters.assign(X) == (0, None)  # the first question opens cluster 0
    near = torch.tensor([0.9, 0.1, 0.0])
    index, similarity = clusters.assign(near)  # alike: joins it
    assert index == 0 and similarity == pytest.approx(0.9 / (0.82**0.5), abs=1e-6)
    assert clusters.assign(Y) == (1, None)  # unlike every cluster: opens one
    index, _ = clusters.assign(torch.tensor([0.0, 0.6, 0.8]))  # unlike both, but no room: the nearest (Y's)
    assert index == 1
    sums, counts = clusters.read()
    assert counts.tolist() == [2, 2] and sums.shape == (2, 3)
    # a centroid is the mean of its unit keys, not a re-normalised running blend
    assert torch.allclose(clusters.centroids()[0], (X + near / near.norm()) / 2, atol=1e-6)
    assert torch.allclose(clusters.centroids()[1], (Y + torch.tensor([0.0, 0.6, 0.8])) / 2, atol=1e-6)


def test_reading_without_learning_leaves_the_clusters_as_they_were(tmp_path):
    clusters = _clusters(tmp_path)
    assert clusters.assign(Y, update=False) == (0, None)  # none yet: cluster 0, nothing written
    assert not clusters.path.exists()
    clusters.assign(X)
    before = clusters.path.read_bytes()
    index, similarity = clusters.assign(Y, update=False)  # would open cluster 1 if it learned: joins 0
    assert (index, similarity) == (0, pytest.approx(0.0))
    assert clusters.assign(X * 2, update=False) == (0, pytest.approx(1.0))
    assert clusters.path.read_bytes() == before and clusters.read()[1].tolist() == [1]


def test_two_learners_share_the_clusters_and_lose_no_assignment(tmp_path):
    a, b = _clusters(tmp_path), _clusters(tmp_path)
    assert a.assign(X) == (0, None) and b.assign(Y) == (1, None)  # b sees a's cluster 0
    keys = [X + 0.01 * i * Y for i in range(10)]
    threads = [threading.Thread(target=(a if i % 2 else b).assign, args=(k,)) for i, k in enumerate(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert int(a.read()[1].sum()) == 12


def test_a_key_of_another_size_and_a_damaged_file_are_named(tmp_path):
    clusters = _clusters(tmp_path)
    clusters.assign(X)
    with pytest.raises(MemoryFormatError, match="keys of size 3, this question's key has 4"):
        clusters.assign(torch.ones(4))
    clusters.path.write_bytes(b"not safetensors")
    with pytest.raises(MemoryFormatError, match="cannot be read"):
        clusters.assign(X)


def test_cluster_names_and_deletion(tmp_path):
    assert cluster_namespace("team", 3) == "team#cluster-3"
    assert belongs_to("team#cluster-3", "team") and belongs_to("team", "team")
    assert not belongs_to("teammate", "team") and not belongs_to("team#cluster-3", "other")
    assert not belongs_to("team#cluster-x", "team") and not belongs_to("team#cluster-3b", "team")
    with pytest.raises(InvalidNamespaceError, match="too long"):
        cluster_namespace("n" * 250, 1)
    with pytest.raises(StoreError, match="has no stream memory"):
        delete_streams(tmp_path, "team")
    clusters = _clusters(tmp_path)
    clusters.assign(X)
    assert delete_streams(tmp_path, "team") == [] and not clusters.path.exists()


def test_clusters_need_a_store_for_their_keys():
    overrides = {"verifier": {"name": "consistency"}, "stream": {"mode": "stream", "tuning": {"clusters": 4}}}
    with pytest.raises(ConfigError, match="stream.tuning.clusters=4 .* store.kind=none"):
        ELMConfig.load(preset="cpu-tiny", overrides={**overrides, "store": {"kind": "none"}})
    assert ELMConfig.load(preset="cpu-tiny", overrides=overrides).stream.tuning.clusters == 4


def test_the_graph_answers_each_kind_of_question_with_its_clusters_stream_memory(smol, tmp_path):
    from _fakes import ScriptedRollouts, stream_graph_config

    from elm_memory import ELM
    from elm_memory.backends.hf import HFBackend
    from elm_memory.store.stream_files import list_streams, stream_root

    cfg = stream_graph_config(tmp_path, objective="sft", clusters=2, cluster_min_similarity=0.999)
    with ELM(cfg, loaded=smol, backend=ScriptedRollouts(HFBackend(smol), ["so \\boxed{5}"])) as elm:
        first = elm.answer("What is 2 + 3?")
        again = elm.answer("What is 2 + 3?")  # the same key: the same cluster, its memory one version on
        other = elm.answer("Name a colour of the sky on a clear day.", learn=True)
        assert first.stream_update["namespace"] == "default#cluster-0" and first.stream_update["cluster"]["index"] == 0
        assert again.stream_update["cluster"]["index"] == 0 and again.stream_update["version_used"] == 1
        assert other.stream_update["namespace"] == "default#cluster-1" and other.stream_update["version_used"] == 0
        root = stream_root(cfg.store.path)
        assert sorted(s["namespace"] for s in list_streams(root)) == ["default#cluster-0", "default#cluster-1"]
        assert delete_streams(root, "default") and list_streams(root) == []
