from django.contrib import admin

from jobs.models import Attempt, Budget, GpuRate, Job


class AttemptInline(admin.TabularInline):
    model = Attempt
    extra = 0


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "project", "submitted_by", "state", "gpus_per_node", "created_at"]
    list_filter = ["state", "project"]
    inlines = [AttemptInline]


@admin.register(GpuRate)
class GpuRateAdmin(admin.ModelAdmin):
    list_display = ["gpu_type", "effective_from", "per_gpu_hour"]
    list_filter = ["gpu_type"]


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    list_display = ["project", "month", "amount", "warn_percent", "hard_limit"]
    list_filter = ["project", "hard_limit"]
