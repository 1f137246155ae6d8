from drf_spectacular.utils import extend_schema
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from fleet import evidence
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
            "address",
            "network_interface",
            "state",
            "state_reason",
            "state_changed_at",
            "auto_cordoned",
            "gpu_model",
            "gpu_count",
            "simulated",
            "isolation",
            "isolation_reason",
            "job_python",
            "job_python_problem",
            "refused_environments",
            "last_heartbeat_at",
            "gpus",
        ]


OTHER_PROJECT_HELP = "true: the attempt and the job's output are hidden, they belong to a job of another project"


class HealthEventSerializer(serializers.ModelSerializer):
    other_project = serializers.BooleanField(read_only=True, default=False, help_text=OTHER_PROJECT_HELP)

    class Meta:
        model = HealthEvent
        fields = [
            "at", "kind", "severity", "gpu_index", "xid", "attempt", "other_project", "message", "evidence", "action",
            "source",
        ]  # fmt: skip


class HealthCheckSerializer(serializers.ModelSerializer):
    other_project = serializers.BooleanField(read_only=True, default=False, help_text=OTHER_PROJECT_HELP)

    class Meta:
        model = HealthCheck
        fields = ["at", "suite", "name", "passed", "duration_ms", "evidence", "attempt", "other_project"]


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


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    """Nodes are shared by all projects: any signed-in user may read the fleet; operators (staff) change it."""

    serializer_class = NodeSerializer
    lookup_field = "name"
    # Staff only, never with a read-only or project-limited token (portal.permissions.ApiAccess).
    operator_actions = ("cordon", "drain", "uncordon", "fault")

    def get_queryset(self):
        nodes = Node.objects.prefetch_related("gpus")
        if state := self.request.query_params.get("state"):
            nodes = nodes.filter(state=state)
        if gpu_model := self.request.query_params.get("gpu_model"):
            nodes = nodes.filter(gpu_model=gpu_model)
        return nodes

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

    @extend_schema(responses=HealthEventSerializer(many=True))
    @action(detail=True, methods=["get"])
    def events(self, request, name=None):
        events = HealthEvent.objects.filter(node=self.get_object())
        page = evidence.redact(self.paginate_queryset(events), request.user)
        return self.get_paginated_response(HealthEventSerializer(page, many=True).data)

    @extend_schema(responses=HealthCheckSerializer(many=True))
    @action(detail=True, methods=["get"])
    def checks(self, request, name=None):
        checks = HealthCheck.objects.filter(node=self.get_object())
        page = evidence.redact(self.paginate_queryset(checks), request.user, evidence_is_dict=False)
        return self.get_paginated_response(HealthCheckSerializer(page, many=True).data)
