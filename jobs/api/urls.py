from rest_framework.routers import SimpleRouter

from jobs.api.views import JobViewSet

router = SimpleRouter()
router.register("jobs", JobViewSet, basename="api-job")
urlpatterns = router.urls
