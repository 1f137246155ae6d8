"""Projects, members, volumes, API tokens and the audit trail."""

from functools import cached_property

from django.db import transaction
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.permissions import SAFE_METHODS
from rest_framework.response import Response

from portal.api.serializers import (
    AuditEventSerializer,
    MembershipSerializer,
    NewTokenSerializer,
    ProjectSerializer,
    RoleSerializer,
    TokenSerializer,
    VolumeSerializer,
)
from portal.models import LIMIT_FIELDS, ApiToken, AuditEvent, Membership, Project, Role, Volume


class ProjectViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = ProjectSerializer
    lookup_field = "slug"
    queryset = Project.objects.none()

    def get_queryset(self):
        return Project.objects.visible_to(self.request.user).with_role_of(self.request.user)


class ProjectChildMixin:
    """Views under /projects/<slug>/: readable by any member, changed by the project's admins.

    The project and the caller's role in it are read once per request (one query)."""

    @cached_property
    def project(self) -> Project:
        user = self.request.user
        return get_object_or_404(Project.objects.visible_to(user).with_role_of(user), slug=self.kwargs["project_slug"])

    @cached_property
    def admin_project(self) -> Project:
        project = self.project
        if project.my_role != Role.ADMIN:
            raise PermissionDenied(f"only an admin of project {project.slug} can change its members and volumes")
        return project

    def check_permissions(self, request) -> None:
        super().check_permissions(request)
        if request.method not in SAFE_METHODS:
            # Raises for a non-admin before the body is validated: a viewer learns nothing from a 400.
            _ = self.admin_project


class MemberViewSet(ProjectChildMixin, viewsets.ModelViewSet):
    serializer_class = MembershipSerializer
    lookup_field = "user__username"
    lookup_url_kwarg = "username"
    queryset = Membership.objects.none()
    http_method_names = ["get", "post", "patch", "delete"]

    def get_queryset(self):
        return Membership.objects.filter(project=self.project).select_related("user").order_by("user__username")

    def get_serializer_class(self):
        return RoleSerializer if self.action == "partial_update" else MembershipSerializer

    def perform_create(self, serializer):
        project = self.admin_project
        user = serializer.validated_data["user"]
        if Membership.objects.filter(project=project, user=user).exists():
            raise ValidationError({"username": f"{user} is already a member; PATCH their role instead"})
        membership = serializer.save(project=project)
        AuditEvent.record(
            self.request.user, "member.add", project, detail={"user": user.username, "role": membership.role}
        )

    @extend_schema(request=RoleSerializer, responses=MembershipSerializer)
    def partial_update(self, request, *args, **kwargs):
        membership = self.get_object()
        project = self.admin_project
        change = RoleSerializer(data=request.data)
        change.is_valid(raise_exception=True)
        old, new = membership.role, change.validated_data["role"]
        if new != Role.ADMIN:
            keep_an_admin(membership)
        with transaction.atomic():
            Membership.objects.filter(pk=membership.pk).update(role=new)
            detail = {"user": membership.user.username, "from": old, "to": new}
            AuditEvent.record(request.user, "member.role", project, detail=detail)
        membership.role = new
        return Response(MembershipSerializer(membership).data)

    def perform_destroy(self, membership):
        project = self.admin_project
        keep_an_admin(membership)
        membership.delete()
        AuditEvent.record(self.request.user, "member.remove", project, detail={"user": membership.user.username})


def keep_an_admin(membership: Membership) -> None:
    others = Membership.objects.filter(project_id=membership.project_id, role=Role.ADMIN).exclude(pk=membership.pk)
    if membership.role == Role.ADMIN and not others.exists():
        raise ValidationError(
            {"role": f"{membership.user} is the last admin of {membership.project}; make another member admin first"}
        )


class VolumeViewSet(ProjectChildMixin, viewsets.ModelViewSet):
    serializer_class = VolumeSerializer
    lookup_field = "name"
    queryset = Volume.objects.none()
    http_method_names = ["get", "post", "patch", "delete"]

    def get_queryset(self):
        return Volume.objects.filter(project=self.project)

    def perform_create(self, serializer):
        project = self.admin_project
        if Volume.objects.filter(project=project, name=serializer.validated_data["name"]).exists():
            raise ValidationError({"name": "a volume of this name exists in the project; choose another name"})
        volume = serializer.save(project=project)
        AuditEvent.record(self.request.user, "volume.create", volume, detail=serializer.data)

    def perform_update(self, serializer):
        volume = serializer.save()
        AuditEvent.record(self.request.user, "volume.change", volume, detail=serializer.data)

    def perform_destroy(self, volume):
        AuditEvent.record(self.request.user, "volume.delete", volume, detail={"name": volume.name})
        volume.delete()


class TokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Your API tokens. DELETE revokes one; its secret is never shown again after creation."""

    serializer_class = TokenSerializer
    queryset = ApiToken.objects.none()
    lookup_value_regex = r"\d+"

    def get_queryset(self):
        return ApiToken.objects.filter(user=self.request.user).select_related("project").order_by("-created_at")

    @extend_schema(request=TokenSerializer, responses={201: NewTokenSerializer})
    def create(self, request):
        serializer = TokenSerializer(data=request.data, context={"request": request})
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        limits = {name: data.get(name) for name in LIMIT_FIELDS}
        token, raw = ApiToken.issue(
            request.user, data["name"], data.get("project"), data.get("read_only", False), **limits
        )
        body = NewTokenSerializer(token, context={"request": request}).data
        body["token"] = raw
        return Response(body, status=status.HTTP_201_CREATED)

    def perform_destroy(self, token):
        token.revoke(self.request.user)


class AuditViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """The audit trail: all of it for site admins, your own actions for everyone else."""

    serializer_class = AuditEventSerializer
    queryset = AuditEvent.objects.none()

    def get_queryset(self):
        events = AuditEvent.objects.select_related("actor")
        if self.request.user.is_superuser and not getattr(self.request.user, "token_project_id", None):
            return events
        return events.filter(actor=self.request.user)
