from django.urls import path
from rest_framework.routers import SimpleRouter

from jobs.api.costs import CostJobsView, CostSummaryView
from jobs.api.environments import EnvironmentViewSet
from jobs.api.experiments import JobMetricsView
from jobs.api.logs import JobLogDownloadView, JobLogsView
from jobs.api.notify import SubscriptionViewSet
from jobs.api.pipelines import PipelineViewSet
from jobs.api.snapshots import JobCodeDiffView, JobCodeView, SnapshotView
from jobs.api.sweeps import SweepViewSet
from jobs.api.tokens import CurrentTokenUsageView, TokenUsageView
from jobs.api.views import JobViewSet, PriorityListView, QueueView

router = SimpleRouter()
router.register("jobs", JobViewSet, basename="api-job")
router.register("sweeps", SweepViewSet, basename="api-sweep")
router.register("pipelines", PipelineViewSet, basename="api-pipeline")
router.register("subscriptions", SubscriptionViewSet, basename="api-subscription")
router.register("environments", EnvironmentViewSet, basename="api-environment")
urlpatterns = [
    path("queue/", QueueView.as_view(), name="api-queue"),
    path("priorities/", PriorityListView.as_view(), name="api-priorities"),
    path("jobs/<int:pk>/logs/", JobLogsView.as_view(), name="api-job-logs"),
    path("jobs/<int:pk>/logs/download/", JobLogDownloadView.as_view(), name="api-job-logs-download"),
    path("jobs/<int:pk>/metrics/", JobMetricsView.as_view(), name="api-job-metrics"),
    path("tokens/<int:pk>/usage/", TokenUsageView.as_view(), name="api-token-usage"),
    path("tokens/current/usage/", CurrentTokenUsageView.as_view(), name="api-token-usage-current"),
    path("jobs/<int:pk>/code/", JobCodeView.as_view(), name="api-job-code"),
    path("jobs/<int:pk>/code/diff/", JobCodeDiffView.as_view(), name="api-job-code-diff"),
    path("projects/<slug:slug>/snapshots/<str:sha256>/", SnapshotView.as_view(), name="api-snapshot"),
    path("costs/summary/", CostSummaryView.as_view(), name="api-cost-summary"),
    path("costs/jobs/", CostJobsView.as_view(), name="api-cost-jobs"),
    *router.urls,
]
