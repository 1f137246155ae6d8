from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from portal import views

api_v1 = [
    path("", include("jobs.api.urls")),
    path("", include("fleet.api.urls")),
]

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("dashboard/panels/", views.dashboard_panels, name="dashboard-panels"),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("jobs/", include("jobs.urls")),
    path("costs/", include("jobs.urls_costs")),
    path("api/v1/", include(api_v1)),
    path("admin/", admin.site.urls),
]
