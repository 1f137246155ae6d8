from rest_framework import permissions, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from fleet.gpus import FAULT_KINDS
from fleet.models import GPU, HealthCheck, HealthEvent, Node
from fleet.operator import OperatorError, change_state, inject_fault


class GPUSerializer(serializers.ModelSerializer):
    class Meta:
        model = GPU
        fields = ["index", "uuid", "model", "memory_total_mb", *GPU.TELEMETRY_FIELDS, "last_xid", "last_xid_at"]


class NodeSerializer(serializers.ModelSerializer):
    gpus = GPUSerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = [
            "name",
            "hostname",
            "state",
            "state_reason",
            "state_changed_at",
            "auto_cordoned",
            "gpu_model",
            "gpu_count",
            "simulated",
            "last_heartbeat_at",
            "gpus",
        ]


class HealthEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = HealthEvent
        fields = ["at", "kind", "severity", "gpu_index", "xid", "attempt", "message", "evidence", "action", "source"]


class HealthCheckSerializer(serializers.ModelSerializer):
    class Meta:
        model = HealthCheck
        fields = ["at", "suite", "name", "passed", "duration_ms", "evidence", "attempt"]


class StateChangeSerializer(serializers.Serializer):
    reason = serializers.CharField(
        error_messages={"required": "say why; it goes in the audit trail", "blank": "say why; it may not be blank"}
    )
    override = serializers.BooleanField(default=False, help_text="uncordon: skip the burn-in (audited)")


class FaultSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=FAULT_KINDS)
    gpu = serializers.IntegerField(required=False, allow_null=True, min_value=0)
    xid = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    seconds = serializers.FloatField(required=False, default=30.0, min_value=0.1)


class IsOperator(permissions.BasePermission):
    message = "only fleet operators (staff users) may change a node"

    def has_permission(self, request, view):
        return bool(request.user and request.user.is_staff)


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    """Nodes are shared by all projects: any signed-in user may read the fleet; operators (staff) change it."""

    serializer_class = NodeSerializer
    lookup_field = "name"

    def get_queryset(self):
        nodes = Node.objects.prefetch_related("gpus")
        if state := self.request.query_params.get("state"):
            nodes = nodes.filter(state=state)
        if gpu_model := self.request.query_params.get("gpu_model"):
            nodes = nodes.filter(gpu_model=gpu_model)
        return nodes

    def get_permissions(self):
        if self.action in ("cordon", "drain", "uncordon", "fault"):
            return [permissions.IsAuthenticated(), IsOperator()]
        return super().get_permissions()

    def _change(self, request, verb: str):
        node = self.get_object()
        body = StateChangeSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            outcome = change_state(
                node, verb, request.user, body.validated_data["reason"], body.validated_data["override"]
            )
        except OperatorError as exc:
            raise ValidationError({exc.field: [str(exc)]})
        node.refresh_from_db()
        if not outcome.changed:
            raise ValidationError({"state": [outcome.message]})
        return Response({"message": outcome.message, "node": NodeSerializer(node).data})

    @action(detail=True, methods=["post"])
    def cordon(self, request, name=None):
        return self._change(request, "cordon")

    @action(detail=True, methods=["post"])
    def drain(self, request, name=None):
        return self._change(request, "drain")

    @action(detail=True, methods=["post"])
    def uncordon(self, request, name=None):
        return self._change(request, "uncordon")

    @action(detail=True, methods=["post"])
    def fault(self, request, name=None):
        node = self.get_object()
        body = FaultSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        try:
            fault = inject_fault(node, data["kind"], request.user, data.get("gpu"), data.get("xid"), data["seconds"])
        except OperatorError as exc:
            raise ValidationError({exc.field: [str(exc)]})
        return Response({"id": fault.pk, "kind": fault.kind, "gpu": fault.gpu_index, "xid": fault.xid}, status=201)

    @action(detail=True, methods=["get"])
    def events(self, request, name=None):
        events = HealthEvent.objects.filter(node=self.get_object())
        page = self.paginate_queryset(events)
        return self.get_paginated_response(HealthEventSerializer(page, many=True).data)

    @action(detail=True, methods=["get"])
    def checks(self, request, name=None):
        checks = HealthCheck.objects.filter(node=self.get_object())
        page = self.paginate_queryset(checks)
        return self.get_paginated_response(HealthCheckSerializer(page, many=True).data)
