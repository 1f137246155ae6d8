from django.contrib import admin

from fleet.models import GPU, Node


class GPUInline(admin.TabularInline):
    model = GPU
    extra = 0


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "state", "gpu_count", "gpu_model", "simulated", "last_heartbeat_at"]
    list_filter = ["state", "gpu_model"]
    inlines = [GPUInline]
