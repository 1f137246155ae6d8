from django.urls import include, path
from rest_framework.routers import SimpleRouter

from portal.api.views import AuditViewSet, MemberViewSet, ProjectViewSet, TokenViewSet, VolumeViewSet

router = SimpleRouter()
router.register("projects", ProjectViewSet, basename="api-project")
router.register("tokens", TokenViewSet, basename="api-token")
router.register("audit", AuditViewSet, basename="api-audit")

project_router = SimpleRouter()
project_router.register("members", MemberViewSet, basename="api-member")
project_router.register("volumes", VolumeViewSet, basename="api-volume")

urlpatterns = [
    *router.urls,
    path("projects/<slug:project_slug>/", include(project_router.urls)),
]
