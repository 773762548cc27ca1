"""The metrics adapter: one definition per metric, read back in-process, served for scraping."""

from __future__ import annotations

import gc
import threading
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvmesh import metrics
from kvmesh.metrics import ALL_METRICS, Counter, Gauge, Histogram, InstanceNames, Metric


def fresh_registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_every_metric_is_kvmesh_prefixed_and_described() -> None:
    for name, metric in ALL_METRICS.items():
        assert name.startswith("kvmesh_"), name
        assert metric.definition.help.strip(), name
        assert not name.endswith("_total"), f"{name}: counters get _total on export"


def test_labels_are_refused_when_missing_unknown_or_mixed() -> None:
    m = Counter("kvmesh_test_refusals", "t", ["worker", "kind"], registry=fresh_registry())
    with pytest.raises(ValueError, match="labels are"):
        m.labels("w0")
    with pytest.raises(ValueError, match="labels are"):
        m.labels(worker="w0", tenant="a")
    with pytest.raises(ValueError, match="not both"):
        m.labels("w0", kind="x")


def test_value_sums_the_series_that_match_a_subset_of_labels() -> None:
    m = Counter("kvmesh_test_sum", "t", ["worker", "kind"], registry=fresh_registry())
    m.labels("w0", "a").inc()
    m.labels("w0", "b").inc(2)
    m.labels(worker="w1", kind="a").inc(5)
    assert m.value(worker="w0") == 3
    assert m.value(kind="a") == 6
    assert m.value() == 8
    assert m.values_by("worker") == {"w0": 3, "w1": 5}


def test_gauges_and_histograms_read_back_their_value_count_and_sum() -> None:
    reg = fresh_registry()
    g = Gauge("kvmesh_test_gauge", "t", ["worker"], registry=reg)
    g.labels("w0").set(7)
    g.labels("w0").dec(2)
    assert g.value(worker="w0") == 5
    h = Histogram("kvmesh_test_seconds", "t", ["worker"], buckets=(0.1, 1.0), registry=reg)
    h.labels("w0").observe(0.5)
    h.labels("w0").observe(0.25)
    assert h.value(worker="w0") == 2
    assert h.histogram_sum(worker="w0") == pytest.approx(0.75)


def test_forget_drops_only_the_matching_series() -> None:
    m = Counter("kvmesh_test_forget", "t", ["coordinator", "kind"], registry=fresh_registry())
    m.labels("c1", "a").inc()
    m.labels("c2", "a").inc()
    m.forget(coordinator="c1")
    assert m.values_by("coordinator") == {"c2": 1}


def test_a_second_live_holder_of_a_name_counts_apart_and_a_freed_name_starts_from_zero() -> None:
    names = InstanceNames("coordinator")

    class Holder:
        pass

    first, second = Holder(), Holder()
    assert names.claim(first, "kvmesh-coordinator") == "kvmesh-coordinator"
    assert names.claim(second, "kvmesh-coordinator") == "kvmesh-coordinator#2"
    metrics.ROUTES.labels("kvmesh-coordinator#2", "kv_aware", "w0").inc()
    del second
    gc.collect()
    assert metrics.ROUTES.value(coordinator="kvmesh-coordinator#2") == 0
    assert names.claim(Holder(), "kvmesh-coordinator") != "kvmesh-coordinator"  # first lives


def test_outside_ray_a_recording_goes_to_prometheus_client_only() -> None:
    assert not metrics.in_ray_actor()
    m = Metric("counter", "kvmesh_test_local", "t", ["worker"], registry=fresh_registry())
    m.labels("w0").inc()
    assert m._ray_metric() is None
    assert m.value(worker="w0") == 1


def test_served_metrics_parse_with_prometheus_clients_parser() -> None:
    metrics.WORKER_REQUESTS.labels("served-w0").inc(3)
    port = metrics.serve_metrics(0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = [
        s
        for s in families["kvmesh_worker_requests"].samples
        if s.labels.get("worker") == "served-w0"
    ]
    assert [(s.name, s.value) for s in samples] == [("kvmesh_worker_requests_total", 3.0)]
    assert families["kvmesh_route_seconds"].type == "histogram"


def test_a_child_is_kept_and_a_forgotten_series_counts_afresh() -> None:
    m = Counter("kvmesh_test_kept", "t", ["coordinator"], registry=fresh_registry())
    first = m.labels("c1")
    assert m.labels("c1") is first
    first.inc(2)
    m.forget(coordinator="c1")
    m.labels("c1").inc()
    assert m.value(coordinator="c1") == 1


def test_a_holder_collected_inside_a_metrics_lock_does_not_deadlock_and_its_series_go() -> None:
    """A finalizer runs wherever the garbage collector does: here inside prometheus-client's
    lock of the very metric whose series it frees (a full test run once hung exactly so)."""
    names = InstanceNames("coordinator")

    class Holder:
        pass

    holder = Holder()
    label = names.claim(holder, "kvmesh-coordinator-gc")
    metrics.ROUTES.labels(label, "kv_aware", "w0").inc()

    def collect_under_the_lock() -> None:
        nonlocal holder
        with metrics.ROUTES._local._lock:
            del holder
            gc.collect()

    worker = threading.Thread(target=collect_under_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the holder's finalizer deadlocked on the metric's lock"
    assert metrics.ROUTES.value(coordinator=label) == 0
    assert names.claim(Holder(), "kvmesh-coordinator-gc") == "kvmesh-coordinator-gc"
