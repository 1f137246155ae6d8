"""Priority classes: the built-in names and the configured classes (HANGAR_PRIORITY_CLASSES)."""

from dataclasses import dataclass

from django.conf import settings
from django.db import models


class Priority(models.TextChoices):
    """The built-in priority classes; HANGAR_PRIORITY_CLASSES may define others."""

    URGENT = "urgent", "Urgent"
    HIGH = "high", "High"
    NORMAL = "normal", "Normal"
    LOW = "low", "Low"
    SCAVENGER = "scavenger", "Scavenger"

    @property
    def rank(self) -> int:
        """Higher goes first."""
        return priority_class(self.value).rank


@dataclass(frozen=True)
class PriorityClass:
    name: str
    rank: int
    may_preempt: bool = False
    preemptible: bool = False


def priority_classes() -> dict[str, PriorityClass]:
    """The configured classes (HANGAR_PRIORITY_CLASSES), highest rank first."""
    configured = settings.HANGAR_PRIORITY_CLASSES
    ordered = sorted(configured.items(), key=lambda item: -item[1]["rank"])
    return {name: PriorityClass(name, **fields) for name, fields in ordered}


def priority_class(name: str) -> PriorityClass:
    """A class by name; a name no longer configured ranks lowest and is preemptible."""
    return priority_classes().get(name) or PriorityClass(name, rank=-1, preemptible=True)
