from django.contrib import admin

from jobs.models import Attempt, Budget, Environment, GpuRate, Job


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


@admin.register(GpuRate)
class GpuRateAdmin(admin.ModelAdmin):
    list_display = ["gpu_type", "effective_from", "per_gpu_hour", "note"]
    list_filter = ["gpu_type"]


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    list_display = ["project", "month", "amount", "warn_percent", "hard_limit"]
    list_filter = ["project", "hard_limit"]
