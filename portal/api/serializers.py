from django.conf import settings
from django.contrib.auth import get_user_model
from rest_framework import serializers

from portal.models import LIMIT_FIELDS, ApiToken, AuditEvent, Membership, Project, Role, Volume
from portal.volumes import clean_volume_path


class ProjectSerializer(serializers.ModelSerializer):
    role = serializers.CharField(source="my_role", read_only=True, help_text="Your role in the project.")

    class Meta:
        model = Project
        fields = ["slug", "name", "created_at", "role", "network"]
        read_only_fields = ["network"]  # set by site admins (README, Security model)


class MembershipSerializer(serializers.ModelSerializer):
    username = serializers.SlugRelatedField(
        source="user",
        slug_field="username",
        queryset=get_user_model().objects.filter(is_active=True),
        error_messages={"does_not_exist": "there is no active user {value!r}; check the spelling"},
    )
    role = serializers.ChoiceField(
        choices=Role.choices,
        error_messages={"invalid_choice": f"{{input}} is not a role; use one of {', '.join(Role.values)}"},
    )

    class Meta:
        model = Membership
        fields = ["username", "role"]


class RoleSerializer(serializers.Serializer):
    role = serializers.ChoiceField(
        choices=Role.choices,
        error_messages={"invalid_choice": f"{{input}} is not a role; use one of {', '.join(Role.values)}"},
    )


class VolumeSerializer(serializers.ModelSerializer):
    env_name = serializers.CharField(read_only=True)

    class Meta:
        model = Volume
        fields = ["name", "path", "version", "read_role", "write_role", "env_name"]

    def validate_path(self, path: str) -> str:
        try:
            return clean_volume_path(path, settings.HANGAR_VOLUME_ROOTS)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc))


class TokenSerializer(serializers.ModelSerializer):
    project = serializers.SlugRelatedField(
        slug_field="slug",
        queryset=Project.objects.all(),
        required=False,
        allow_null=True,
        help_text="Limit the token to this project; omit for all your projects.",
    )

    class Meta:
        model = ApiToken
        fields = [
            "id", "name", "hint", "project", "read_only", *LIMIT_FIELDS, "created_at", "last_used_at", "revoked_at"
        ]  # fmt: skip
        read_only_fields = ["id", "hint", "created_at", "last_used_at", "revoked_at"]
        extra_kwargs = {name: {"min_value": 0} for name in ("max_gpu_hours_per_day", "max_spend_per_day")}

    def to_internal_value(self, data):
        # DRF reads "" as null for a relation: a blank slug is a mistake, not "all projects".
        if isinstance(data, dict) and data.get("project") == "":
            message = "is blank; give a project's slug, or leave it out (or null) for all your projects"
            raise serializers.ValidationError({"project": [message]})
        return super().to_internal_value(data)

    def validate_project(self, project: Project | None) -> Project | None:
        request = self.context["request"]
        if project is not None and not Project.objects.visible_to(request.user).filter(pk=project.pk).exists():
            raise serializers.ValidationError(f"no project {project.slug!r} among yours")
        return project

    def validate(self, attrs):
        limit = getattr(self.context["request"].user, "token_project_id", None)
        project = attrs.get("project")
        if limit and (project is None or project.pk != limit):
            # A token limited to one project must not mint a wider one.
            raise serializers.ValidationError(
                {"project": "this request's token is limited to one project; limit the new token to it"}
            )
        self.check_no_wider_limits(attrs)
        return attrs

    def check_no_wider_limits(self, attrs: dict) -> None:
        """A token with limits must not mint one without them (or with higher ones)."""
        token = self.context["request"].auth
        if not isinstance(token, ApiToken):
            return
        for name, mine in token.limits.items():
            asked = attrs.get(name)
            if mine is not None and (asked is None or asked > mine):
                raise serializers.ValidationError(
                    {name: f"this request's token has {name}={mine}; give the new token {name} of at most {mine}"}
                )


class NewTokenSerializer(TokenSerializer):
    token = serializers.CharField(read_only=True, help_text="The secret: shown this once, only its hash is kept.")

    class Meta(TokenSerializer.Meta):
        fields = [*TokenSerializer.Meta.fields, "token"]


class AuditEventSerializer(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor.username", default=None)

    class Meta:
        model = AuditEvent
        fields = ["at", "actor", "action", "target_type", "target_id", "reason", "detail"]
