from django.contrib import admin

from jobs.models import Attempt, Environment, Job


class AttemptInline(admin.TabularInline):
    model = Attempt
    extra = 0


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "name",
        "project",
        "submitted_by",
        "state",
        "priority",
        "nodes",
        "gpus_per_node",
        "created_at",
    ]
    list_filter = ["state", "project"]
    inlines = [AttemptInline]
    exclude = ["secret_env"]  # never shown back, not even to site admins


@admin.register(Environment)
class EnvironmentAdmin(admin.ModelAdmin):
    list_display = ["name", "kind", "everywhere", "path", "image", "description"]
    filter_horizontal = ["nodes"]
