"""Facts a web process reads at every submit but that change rarely, remembered for a few
seconds in the process's local-memory cache (settings.CACHES): node sizes for the capacity
check (jobs.api.capacity), which projects have a budget (jobs.api.costs). A change saved in
this process is forgotten at once; one made by another process counts within the seconds."""

from collections.abc import Callable
from typing import TypeVar

from django.core.cache import cache
from django.db import connection
from django.db.models.signals import post_delete, post_save

T = TypeVar("T")


def remembered(key: str, read: Callable[[], T], seconds: float) -> T:
    """read(), remembered under `key` for `seconds`. Read afresh inside a transaction: what
    it reads there (its own writes) may be rolled back, so it is not remembered."""
    if connection.in_atomic_block:
        return read()
    return cache.get_or_set(key, read, seconds)


def forget_on_change(key: str, model) -> None:
    """Forget `key` whenever a `model` row is saved or deleted in this process."""

    def forget(**kwargs) -> None:
        cache.delete(key)

    post_save.connect(forget, sender=model, weak=False, dispatch_uid=f"hangar.forget.{key}.saved")
    post_delete.connect(forget, sender=model, weak=False, dispatch_uid=f"hangar.forget.{key}.deleted")
