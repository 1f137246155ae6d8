"""Where a job's command runs, and which nodes can run it; and the Python requirements a
job's cached environment is built from (agent/envcache.py builds it on the node)."""

import hashlib
import json
from datetime import datetime

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

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
    requirements = models.JSONField(
        default=list,
        blank=True,
        help_text="Host kind without a path: requirements of a cached environment built on demand on each node, "
        'e.g. ["torch", "transformers"].',
    )
    python_version = models.CharField(max_length=16, blank=True, help_text="Cached kind: e.g. 3.11; blank: the node's.")
    everywhere = models.BooleanField(default=False, help_text="Every node can run it.")
    nodes = models.ManyToManyField("fleet.Node", blank=True, related_name="environments")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """The admin's form: requirements by the submit's rules, normalised (jobs/jobspec.py)."""
        from django.core.exceptions import ValidationError

        from jobs import jobspec

        try:
            self.requirements = jobspec.parse_requirements(self.requirements or [])
        except (TypeError, ValueError) as exc:
            raise ValidationError({"requirements": str(exc)})
        if problem := jobspec.python_problem(self.python_version):
            raise ValidationError({"python_version": problem})

    @property
    def cached(self) -> bool:
        """Built on demand from requirements on whichever node runs it (so every node can)."""
        return self.kind == EnvironmentKind.HOST and not self.path and bool(self.requirements)

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
        wakeup.request_pass(queue_changed=False)  # what the node can run changed, and it may be new: place work now
        return sorted(set(names) - set(known))


class EnvironmentRebuild(models.Model):
    """An operator's request that every node drop the cached environments it built for a named
    environment (or the one whose hash starts with `target`): the next job builds them anew
    (`hangar env rebuild NAME`). Each agent applies it within 30 s (agent/envcache.py);
    an environment a running job holds goes once that job ends."""

    target = models.CharField(max_length=64)
    requested_at = models.DateTimeField(default=timezone.now, db_index=True)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)

    class Meta:
        ordering = ["-requested_at"]

    def __str__(self) -> str:
        return f"rebuild {self.target}"

    def covers(self, environment: str, hash_: str, built_at: datetime | None) -> bool:
        """Whether this request drops a cached environment built for `environment` at `built_at`."""
        named = self.target == environment or (len(self.target) >= 8 and hash_.startswith(self.target))
        return named and (built_at is None or built_at < self.requested_at)


KEY_VERSION = "hangar-env-1"


def requirements_key(requirements: list[str], python_version: str) -> str:
    """What a job asks for, hashed: the same list (in any order) and Python version give the
    same key. A node maps a key to the exact environment it resolved it to (agent/envcache.py);
    the scheduler prefers nodes that hold one (warm-cache affinity). Empty: no requirements."""
    if not requirements:
        return ""
    text = json.dumps([KEY_VERSION, python_version, sorted(set(requirements))])
    return hashlib.sha256(text.encode()).hexdigest()


def requirements_of(environment, requirements: list[str], python_version: str) -> tuple[list[str], str]:
    """The requirements and Python version of a job's cached environment: its environment's
    (a cached one, like `ai`) and its own; ([], "") when it has none."""
    own = list(requirements or [])
    if environment is not None and environment.cached:
        return sorted({*environment.requirements, *own}), python_version or environment.python_version
    return sorted(set(own)), python_version if own else ""


def job_requirements(job) -> tuple[list[str], str]:
    return requirements_of(job.environment, job.requirements, job.python_version)


# The environments every install has (migrations jobs 0004 and 0014 made them; `ensure_built_in`
# brings back one that is missing after the migrations run, or after a `flush`).
BUILT_IN_ENVIRONMENTS = [
    {"name": "cuda", "description": "Minimal CUDA runtime on the host", "everywhere": True},
    {
        "name": "ai",
        "description": "PyTorch + Transformers: a cached environment built on demand on each node (uv)",
        "everywhere": True,
        "requirements": ["torch", "transformers"],
    },
]


def ensure_built_in(**kwargs) -> None:
    """A post_migrate receiver: the built-in environments exist (an operator's changes to them are kept)."""
    for fields in BUILT_IN_ENVIRONMENTS:
        Environment.objects.get_or_create(name=fields["name"], defaults=fields)
