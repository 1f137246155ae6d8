"""A started Celery worker (agent, scheduler, notifier) freezes what it loaded, so the cyclic
collector's full collections walk only what it made since (portal/celery.py)."""

import gc

from celery.signals import worker_ready

from jobs import tracking


def test_a_worker_that_is_ready_moves_what_it_loaded_out_of_the_collectors_reach(monkeypatch):
    monkeypatch.setattr(tracking, "enabled", lambda: False)  # no MLflow warm-up thread here
    gc.unfreeze()
    try:
        tracked_before = len(gc.get_objects())
        worker_ready.send(sender=None)
        assert gc.get_freeze_count() > tracked_before / 2  # what was loaded (less the garbage collected first)
        assert len(gc.get_objects()) < tracked_before / 10  # a full collection has little left to walk
    finally:
        gc.unfreeze()


def test_mlflow_loaded_by_the_warm_up_is_frozen_with_it(monkeypatch):
    monkeypatch.setattr(tracking, "client", lambda: None)
    gc.unfreeze()
    try:
        tracking._warm()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_mlflow_is_warmed_up_by_the_workers_that_use_it_and_not_by_the_scheduler(monkeypatch):
    from types import SimpleNamespace

    from kombu import Queue

    def worker(*queues):
        return SimpleNamespace(task_consumer=SimpleNamespace(queues=[Queue(name) for name in queues]))

    warmed = []
    monkeypatch.setattr(tracking, "enabled", lambda: True)
    monkeypatch.setattr(tracking, "_warm", lambda: warmed.append(True))
    started_at_once = SimpleNamespace(Thread=lambda target, **kw: SimpleNamespace(start=target))
    monkeypatch.setattr(tracking, "threading", started_at_once)

    tracking.warm_up(sender=worker("hangar.scheduler"))
    assert warmed == []  # the scheduler makes no run: MLflow stays out of it
    tracking.warm_up(sender=worker("hangar.notify", tracking.QUEUE))  # the notifier
    tracking.warm_up(sender=worker("hangar.node.gpu-01"))  # an agent
    assert warmed == [True, True]
