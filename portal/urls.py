from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerSplitView

from portal import views
from portal.login import password_reset_urls

api_v1 = [
    path("", include("jobs.api.urls")),
    path("", include("fleet.api.urls")),
    path("", include("portal.api.urls")),
]

handler404 = "portal.api.errors.not_found"
handler500 = "portal.api.errors.crashed"

urlpatterns = [
    # Browsers ask for /favicon.ico on pages without a <link rel="icon"> (the admin's, a JSON answer).
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"), permanent=True)),
    path("", include("jobs.urls_dashboard")),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    *password_reset_urls,
    path("jobs/", include("jobs.urls")),
    path("pipelines/", include("jobs.urls_pipelines")),
    path("tokens/", views.tokens, name="tokens"),
    path("tokens/<int:pk>/revoke/", views.revoke_token, name="token-revoke"),
    path("fleet/", include("fleet.urls")),
    path("costs/", include("jobs.urls_costs")),
    path("notifications/", include("jobs.urls_notify")),
    path("api/v1/", include(api_v1)),
    path("api/mlflow/", include("jobs.urls_tracking")),  # jobs reach MLflow through it (jobs/trackingproxy.py)
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    # The split view serves its start-up code as a script of its own: no inline script (CSP).
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="api-schema"), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="api-schema"), name="api-redoc"),
    path("admin/", admin.site.urls),
    path("metrics", include("jobs.urls_metrics")),
]
