"""Projects, memberships, API tokens and the audit trail: the access model every app scopes by."""

import functools
import hashlib
import secrets
from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

from portal import statements


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"
    MEMBER = "member", "Member"
    MANAGER = "manager", "Manager"
    ADMIN = "admin", "Admin"


ROLE_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.MANAGER: 2, Role.ADMIN: 3}


def roles_from(role: str) -> list[str]:
    """`role` and the roles above it."""
    return [r for r, rank in ROLE_RANK.items() if rank >= ROLE_RANK[role]]


class ProjectQuerySet(models.QuerySet):
    def visible_to(self, user) -> "ProjectQuerySet":
        """The one place that says which projects a user may see.

        A request made with a project-limited API token carries that limit on
        its user (`token_project_id`, set by the token authentication), so every
        page, endpoint and websocket scoped here is limited with it.
        """
        return self.member_of(user)

    def with_role(self, user, role: str) -> "ProjectQuerySet":
        """Projects where the user holds `role` or a higher one."""
        return self.member_of(user, roles=roles_from(role))

    def member_of(self, user, roles: list[str] | None = None) -> "ProjectQuerySet":
        """Projects the user is a member of (with one of `roles`, when given); every project
        for a superuser. One join and no DISTINCT: a user has at most one membership in
        a project (one_membership_per_user), so each project comes once."""
        if user is None or not user.is_authenticated:
            return self.none()
        projects = self if user.is_superuser else self.held_by(user.pk, roles)
        if limit := getattr(user, "token_project_id", None):
            projects = projects.filter(pk=limit)
        return projects

    def held_by(self, user_id: int, roles: list[str] | None = None) -> "ProjectQuerySet":
        """Projects with a membership of this user (in one of `roles`, when given): member_of's
        join, and project_with_role's statement's."""
        return self.filter(memberships__user_id=user_id, **({"memberships__role__in": roles} if roles else {}))

    def with_role_of(self, user) -> "ProjectQuerySet":
        """Annotate `my_role`: the user's role in each project (admin for superusers), in the same query."""
        if user.is_superuser:
            return self.annotate(my_role=models.Value(Role.ADMIN.value, output_field=models.CharField()))
        role = Membership.objects.filter(project=models.OuterRef("pk"), user=user).values("role")[:1]
        return self.annotate(my_role=models.Subquery(role))

    def role_of(self, user, project: "Project") -> str | None:
        """The user's role in the project (admin for superusers), or None."""
        if user is None or not user.is_authenticated or not self.visible_to(user).filter(pk=project.pk).exists():
            return None
        if user.is_superuser:
            return Role.ADMIN
        return Membership.objects.filter(project=project, user=user).values_list("role", flat=True).first()


class Project(models.Model):
    slug = models.SlugField(unique=True, help_text="Short name used in the API and CLI.")
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(default=timezone.now)
    # Queues and capacity (see jobs/scheduler.py).
    gpu_quota = models.PositiveIntegerField(default=0, help_text="GPUs guaranteed to this project.")
    may_borrow = models.BooleanField(default=True, help_text="May use idle GPUs beyond its quota (taken back first).")
    max_running_jobs = models.PositiveIntegerField(null=True, blank=True, help_text="Blank: no limit.")
    max_running_jobs_per_user = models.PositiveIntegerField(null=True, blank=True, help_text="Blank: no limit.")
    max_gpus_per_job = models.PositiveIntegerField(null=True, blank=True, help_text="Blank: no limit.")
    default_priority = models.CharField(max_length=32, default="normal", help_text="Class of jobs that ask for none.")
    max_member_priority = models.CharField(
        max_length=32, default="high", help_text="Highest class a member may ask for; managers may ask for any."
    )
    network = models.CharField(
        max_length=8,
        choices=[("host", "host"), ("none", "none (loopback only)")],
        default="host",
        help_text="What its sandboxed jobs may reach: the host's network (multi-node jobs need it) or loopback only.",
    )
    allowed_images = models.TextField(
        blank=True, help_text="Container images its jobs may use, one fnmatch pattern a line; empty: any image."
    )

    objects = ProjectQuerySet.as_manager()

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "user"], name="one_membership_per_user")]

    def __str__(self) -> str:
        return f"{self.user} in {self.project} as {self.role}"


def project_with_role(user, slug: str, role: str) -> Project | None:
    """`Project.objects.with_role(user, role).filter(slug=slug).first()` as a statement compiled
    once (portal/statements.py): every submit reads it, and building and compiling that query was
    a fifth of `submit_job`'s CPU."""
    if user is None or not user.is_authenticated:
        return None
    if user.is_superuser:
        project = project_by_slug.first(slug=slug)
    else:
        project = project_by_slug_as(role).first(slug=slug, user_id=user.pk)
    limit = getattr(user, "token_project_id", None)  # a project-limited API token's (member_of)
    return None if project is None or (limit and project.pk != limit) else project


@statements.query
def project_by_slug(slug: str):
    return Project.objects.filter(slug=slug)[:1]


@functools.cache
def project_by_slug_as(role: str) -> statements.Statement:
    """The project with this slug where the user holds `role` or a higher one (one statement per role)."""
    roles = roles_from(role)

    def project(slug: str, user_id: int):
        return Project.objects.filter(slug=slug).held_by(user_id, roles)[:1]

    return statements.query(project)


TOKEN_PREFIX = "hgr_"
LIMIT_FIELDS = ("max_running_jobs", "max_gpus", "max_gpu_hours_per_day", "max_spend_per_day")


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiTokenQuerySet(models.QuerySet):
    def active(self) -> "ApiTokenQuerySet":
        return self.filter(revoked_at__isnull=True)


class ApiToken(models.Model):
    """A named bearer token for agents and the CLI. Only its SHA-256 is stored.

    A token may be limited to one project (it sees and touches nothing else)
    and to reading (every unsafe method is refused).
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    project = models.ForeignKey(
        Project, null=True, blank=True, on_delete=models.CASCADE, related_name="+", help_text="Blank: all projects."
    )
    read_only = models.BooleanField(default=False)
    # Limits on what jobs submitted with it may hold or use (jobs/tokenlimits.py); blank: none.
    max_running_jobs = models.PositiveIntegerField(
        null=True, blank=True, help_text="Unfinished jobs (queued or running) at once; blank: no limit."
    )
    max_gpus = models.PositiveIntegerField(
        null=True, blank=True, help_text="GPUs its unfinished jobs ask for at once; blank: no limit."
    )
    max_gpu_hours_per_day = models.DecimalField(
        max_digits=10, decimal_places=2, null=True, blank=True, help_text="GPU-hours a UTC day; blank: no limit."
    )
    max_spend_per_day = models.DecimalField(
        max_digits=12, decimal_places=2, null=True, blank=True, help_text="Spend a UTC day; blank: no limit."
    )
    digest = models.CharField(max_length=64, unique=True)
    hint = models.CharField(max_length=12, help_text="First characters, to recognise the token.")
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    def __str__(self) -> str:
        return f"{self.name} ({self.hint}…)"

    @classmethod
    def issue(
        cls, user, name: str, project: Project | None = None, read_only: bool = False, **limits
    ) -> tuple["ApiToken", str]:
        """Create a token and return it with its secret, which is shown this once.
        `limits`: any of LIMIT_FIELDS (None: no limit)."""
        raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
        limits = {k: v for k, v in limits.items() if k in LIMIT_FIELDS and v is not None}
        token = cls.objects.create(
            user=user, name=name, digest=hash_token(raw), hint=raw[:10], project=project, read_only=read_only, **limits
        )
        detail = {"name": name, "project": project.slug if project else None, "read_only": read_only}
        detail.update({k: str(v) for k, v in limits.items()})
        AuditEvent.record(user, "token.create", token, detail=detail)
        return token, raw

    def revoke(self, by) -> bool:
        if not ApiToken.objects.filter(pk=self.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()):
            return False
        AuditEvent.record(by, "token.revoke", self, detail={"name": self.name})
        return True

    @classmethod
    def authenticate(cls, raw: str) -> "ApiToken | None":
        """The active token for a raw secret, with its user limited by it, or None."""
        token = cls.objects.active().select_related("user").filter(digest=hash_token(raw)).first()
        if token is None or not token.user.is_active:
            return None
        now = timezone.now()
        # One write a minute at most: an agent polling many times a second must
        # not turn every read into a database write.
        if token.last_used_at is None or now - token.last_used_at > timedelta(minutes=1):
            cls.objects.filter(pk=token.pk).update(last_used_at=now)
        token.limit(token.user)
        return token

    def limit(self, user) -> None:
        """Put this token's limits on `user` (its project, read-only, and its id: submit_job counts
        the job against the token's limits), as every request made with it has them."""
        user.token_project_id, user.token_read_only, user.api_token_id = self.project_id, self.read_only, self.pk

    @property
    def limits(self) -> dict:
        """The limits set on it (None: none)."""
        return {name: getattr(self, name) for name in LIMIT_FIELDS}


def volume_env_name(name: str) -> str:
    """The variable a job finds a volume's path in: `train-data` -> HANGAR_VOLUME_TRAIN_DATA."""
    return "HANGAR_VOLUME_" + name.upper().replace("-", "_")


class VolumeMode(models.TextChoices):
    READ = "ro", "read-only"
    READ_WRITE = "rw", "read-write"


class Volume(models.Model):
    """A project's data (a dataset, checkpoints, outputs) registered as a path, with the
    lowest role that may mount it read-only and read-write."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="volumes")
    name = models.SlugField(max_length=64, help_text="Seen by jobs as HANGAR_VOLUME_<NAME>.")
    path = models.CharField(max_length=1000)
    version = models.CharField(max_length=100, blank=True, help_text="Recorded on each job that uses it.")
    read_role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    write_role = models.CharField(max_length=16, choices=Role.choices, default=Role.MANAGER)

    class Meta:
        ordering = ["project", "name"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="volume_name_per_project")]

    def __str__(self) -> str:
        return f"{self.project}/{self.name}"

    @property
    def env_name(self) -> str:
        return volume_env_name(self.name)

    def allows(self, role: str | None, mode: str) -> bool:
        needed = self.write_role if mode == VolumeMode.READ_WRITE else self.read_role
        return role is not None and ROLE_RANK[role] >= ROLE_RANK[needed]


@statements.query
def volume_paths():
    """Every registered volume's path (a set: unordered, so no join to the projects)."""
    return Volume.objects.order_by().values_list("path", flat=True)


class AuditEvent(models.Model):
    """Who did what to which object, when and why: cordons, cancels, role changes, tokens."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=64)
    target_id = models.CharField(max_length=64)
    reason = models.TextField(blank=True)
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target_type}:{self.target_id}"

    @classmethod
    def record(cls, actor, action: str, target, reason: str = "", detail: dict | None = None) -> "AuditEvent":
        return cls.objects.create(
            actor=actor if actor is not None and actor.is_authenticated else None,
            action=action,
            target_type=target._meta.label_lower,
            target_id=str(target.pk),
            reason=reason,
            detail=detail or {},
        )
