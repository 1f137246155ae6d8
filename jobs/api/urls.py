from django.urls import path
from rest_framework.routers import SimpleRouter

from jobs.api.logs import JobLogDownloadView, JobLogsView
from jobs.api.views import JobViewSet, QueueView

router = SimpleRouter()
router.register("jobs", JobViewSet, basename="api-job")
urlpatterns = [
    path("queue/", QueueView.as_view(), name="api-queue"),
    path("jobs/<int:pk>/logs/", JobLogsView.as_view(), name="api-job-logs"),
    path("jobs/<int:pk>/logs/download/", JobLogDownloadView.as_view(), name="api-job-logs-download"),
    *router.urls,
]
