from rest_framework import serializers, viewsets

from fleet.models import GPU, Node


class GPUSerializer(serializers.ModelSerializer):
    class Meta:
        model = GPU
        fields = [
            "index",
            "uuid",
            "model",
            "memory_total_mb",
            "utilization_pct",
            "memory_used_mb",
            "temperature_c",
            "power_w",
            "sampled_at",
        ]


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
            "gpu_model",
            "gpu_count",
            "simulated",
            "last_heartbeat_at",
            "gpus",
        ]


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    """Nodes are shared by all projects: any signed-in user may read the fleet."""

    serializer_class = NodeSerializer
    queryset = Node.objects.prefetch_related("gpus")
    lookup_field = "name"
