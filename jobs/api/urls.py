from django.urls import path
from rest_framework.routers import SimpleRouter

from jobs.api.views import JobViewSet, QueueView

router = SimpleRouter()
router.register("jobs", JobViewSet, basename="api-job")
urlpatterns = [path("queue/", QueueView.as_view(), name="api-queue"), *router.urls]
