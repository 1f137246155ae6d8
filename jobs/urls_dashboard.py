from django.urls import path

from jobs import views_dashboard

urlpatterns = [
    path("", views_dashboard.dashboard, name="dashboard"),
    path("dashboard/panels/", views_dashboard.dashboard_panels, name="dashboard-panels"),
]
