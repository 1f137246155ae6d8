"""The shapes of the result document (jobs/results.py) for the OpenAPI schema: what
`GET /api/v1/jobs/<id>/result/` answers and each line of `hangar wait --json` holds.
(The document is built as plain data; these serializers only describe it.)"""

from rest_framework import serializers

from jobs.api.serializers import CodeOfJobSerializer, DiagnosisSerializer


class PointSerializer(serializers.Serializer):
    value = serializers.FloatField()
    step = serializers.IntegerField()


class MetricSummarySerializer(serializers.Serializer):
    last = PointSerializer(help_text="The value at the last step.")
    best = PointSerializer(help_text="The best value under best_mode.")
    best_mode = serializers.ChoiceField(choices=["min", "max"])
    min = PointSerializer()
    max = PointSerializer()
    points = serializers.IntegerField()


class ObjectiveValueSerializer(serializers.Serializer):
    metric = serializers.CharField()
    mode = serializers.ChoiceField(choices=["min", "max"])
    value = serializers.FloatField(allow_null=True, help_text="The metric's last value; null: never logged.")
    step = serializers.IntegerField(allow_null=True)
    best = serializers.FloatField(allow_null=True)
    best_step = serializers.IntegerField(allow_null=True)
    found = serializers.BooleanField()


class LineSerializer(serializers.Serializer):
    attempt = serializers.IntegerField()
    attempt_number = serializers.IntegerField(allow_null=True)
    seq = serializers.IntegerField()
    ts = serializers.CharField()
    node = serializers.CharField(allow_null=True)
    rank = serializers.IntegerField()
    stream = serializers.CharField()
    severity = serializers.CharField()
    fault = serializers.BooleanField()
    text = serializers.CharField(allow_blank=True)


class ResultCostSerializer(serializers.Serializer):
    total = serializers.CharField(help_text="A decimal, as text.")
    preflight = serializers.CharField()
    wasted = serializers.CharField(help_text="Of failed, lost and preempted attempts.")
    gpu_hours = serializers.FloatField()


class ResultTimesSerializer(serializers.Serializer):
    queued_seconds = serializers.FloatField()
    preflight_seconds = serializers.FloatField()
    running_seconds = serializers.FloatField()
    created_at = serializers.CharField()
    finished_at = serializers.CharField(allow_null=True)


class ResultSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    project = serializers.CharField()
    state = serializers.CharField()
    final = serializers.BooleanField()
    state_reason = serializers.CharField(allow_blank=True)
    exit_code = serializers.IntegerField(allow_null=True)
    failure_class = serializers.CharField(allow_blank=True)
    attempt_count = serializers.IntegerField()
    diagnosis = DiagnosisSerializer(allow_null=True)
    objective = ObjectiveValueSerializer(allow_null=True)
    metrics = serializers.DictField(child=MetricSummarySerializer())
    metrics_available = serializers.BooleanField()
    metrics_reason = serializers.CharField(allow_blank=True)
    first_error = LineSerializer(allow_null=True)
    log_tail = LineSerializer(many=True, help_text="The latest attempt's last 50 lines.")
    cost = ResultCostSerializer()
    times = ResultTimesSerializer()
    code = CodeOfJobSerializer(allow_null=True, help_text="The code snapshot it ran, as on the job.")
    code_version = serializers.CharField(allow_blank=True)
    mlflow_run_id = serializers.CharField(allow_blank=True)
    urls = serializers.DictField(child=serializers.CharField())
