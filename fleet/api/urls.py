from rest_framework.routers import SimpleRouter

from fleet.api.views import NodeViewSet

router = SimpleRouter()
router.register("nodes", NodeViewSet, basename="api-node")
urlpatterns = router.urls
