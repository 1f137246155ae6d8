from django.urls import path
from rest_framework.routers import SimpleRouter

from jobs.api.costs import CostJobsView, CostSummaryView
from jobs.api.experiments import JobMetricsView
from jobs.api.views import JobViewSet

router = SimpleRouter()
router.register("jobs", JobViewSet, basename="api-job")
urlpatterns = router.urls + [
    path("costs/summary/", CostSummaryView.as_view(), name="api-cost-summary"),
    path("costs/jobs/", CostJobsView.as_view(), name="api-cost-jobs"),
    path("jobs/<int:pk>/metrics/", JobMetricsView.as_view(), name="api-job-metrics"),
]
