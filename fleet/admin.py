from django.contrib import admin, messages

from fleet.gpus import FAULT_KINDS
from fleet.models import GPU, FaultInjection, HealthCheck, HealthEvent, Node, XidPolicy
from fleet.operator import OperatorError, inject_fault


class GPUInline(admin.TabularInline):
    model = GPU
    extra = 0


def fault_action(kind: str):
    def act(modeladmin, request, queryset):
        for node in queryset:
            try:
                inject_fault(node, kind, request.user)
                modeladmin.message_user(request, f"{kind} queued for {node.name}")
            except OperatorError as exc:
                modeladmin.message_user(request, str(exc), messages.ERROR)

    act.__name__ = f"inject_{kind}"
    act.short_description = f"Inject fault: {kind} (simulated nodes)"
    return act


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "state", "gpu_count", "gpu_model", "simulated", "auto_cordoned", "last_heartbeat_at"]
    list_filter = ["state", "gpu_model", "simulated"]
    search_fields = ["name", "hostname"]
    inlines = [GPUInline]
    actions = [fault_action(kind) for kind in FAULT_KINDS]
    readonly_fields = ["state", "state_reason", "state_changed_at", "state_changed_by", "auto_cordoned"]


@admin.register(XidPolicy)
class XidPolicyAdmin(admin.ModelAdmin):
    list_display = ["xid", "action", "threshold", "window_minutes", "description"]
    list_editable = ["action", "threshold", "window_minutes"]


@admin.register(FaultInjection)
class FaultInjectionAdmin(admin.ModelAdmin):
    list_display = ["created_at", "node", "kind", "gpu_index", "xid", "seconds", "created_by", "applied_at"]
    fields = ["node", "kind", "gpu_index", "xid", "seconds"]

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "node":
            kwargs["queryset"] = Node.objects.filter(simulated=True)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def save_model(self, request, obj, form, change):
        obj.created_by = request.user
        super().save_model(request, obj, form, change)


@admin.register(HealthEvent)
class HealthEventAdmin(admin.ModelAdmin):
    list_display = ["at", "node", "kind", "severity", "gpu_index", "xid", "message", "action", "source"]
    list_filter = ["kind", "severity", "source"]
    list_select_related = ["node"]


@admin.register(HealthCheck)
class HealthCheckAdmin(admin.ModelAdmin):
    list_display = ["at", "node", "suite", "name", "passed", "duration_ms", "evidence"]
    list_filter = ["suite", "name", "passed"]
    list_select_related = ["node"]
