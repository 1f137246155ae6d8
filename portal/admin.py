from django.contrib import admin

from portal.models import ApiToken, AuditEvent, Membership, Project, Volume


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 1


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "created_at"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [MembershipInline]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["name", "user", "hint", "project", "read_only", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["digest", "hint", "created_at", "last_used_at"]


@admin.register(Volume)
class VolumeAdmin(admin.ModelAdmin):
    list_display = ["project", "name", "path", "version", "read_role", "write_role"]
    list_filter = ["project"]


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ["at", "actor", "action", "target_type", "target_id", "reason"]
    list_filter = ["action"]

    def has_change_permission(self, request, obj=None):
        return False
