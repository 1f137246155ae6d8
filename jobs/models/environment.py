"""Where a job's command runs, and which nodes can run it."""

from django.db import models, transaction

from portal import wakeup


class EnvironmentKind(models.TextChoices):
    HOST = "host", "Host interpreter or virtualenv"
    CONTAINER = "container", "Container image (docker run --gpus)"


class Environment(models.Model):
    """Where a job's command runs: a host interpreter/virtualenv, or a container image.

    A node advertises the environments it can run (`manage.py agent --environments`);
    one marked `everywhere` runs on every node.
    """

    name = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=200, blank=True)
    kind = models.CharField(max_length=16, choices=EnvironmentKind.choices, default=EnvironmentKind.HOST)
    path = models.CharField(
        max_length=500, blank=True, help_text="Host kind: a virtualenv or prefix; its bin/ goes first on PATH."
    )
    image = models.CharField(max_length=300, blank=True, help_text="Container kind: the image to run.")
    everywhere = models.BooleanField(default=False, help_text="Every node can run it.")
    nodes = models.ManyToManyField("fleet.Node", blank=True, related_name="environments")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @classmethod
    def advertise(cls, node, names: list[str]) -> list[str]:
        """Set the environments a node can run (besides those that run everywhere);
        returns the names that are not defined, which are ignored."""
        known = {e.name: e for e in cls.objects.filter(name__in=names)}
        with transaction.atomic():
            for environment in cls.objects.filter(nodes=node).exclude(name__in=list(known)):
                environment.nodes.remove(node)
            for environment in known.values():
                environment.nodes.add(node)
        wakeup.request_pass()  # what the node can run changed, and it may be new: place work now
        return sorted(set(names) - set(known))
