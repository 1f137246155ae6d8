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
