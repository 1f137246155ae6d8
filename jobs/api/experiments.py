"""A job's MLflow metrics, for the job page's chart and for agents: `/api/v1/jobs/<id>/metrics/`."""

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import tracking
from jobs.models import Job


class JobMetricsView(APIView):
    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, pk: int):
        job = get_object_or_404(Job.objects.visible_to(request.user), pk=pk)
        found = tracking.metrics(job)
        return Response(
            {
                **found,
                "job_state": job.state,
                "final": job.is_final,
                "run_id": job.mlflow_run_id,
                "experiment_id": job.mlflow_experiment_id,
                "mlflow_ui": tracking.ui_url(job),
                "figure": tracking.metrics_figure(found["series"]) if found["series"] else None,
            }
        )
