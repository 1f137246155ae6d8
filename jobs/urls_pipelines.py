from django.urls import path

from jobs import views_pipelines

urlpatterns = [
    path("", views_pipelines.pipeline_list, name="pipeline-list"),
    path("<int:pk>/", views_pipelines.pipeline_detail, name="pipeline-detail"),
    path("<int:pk>/status/", views_pipelines.pipeline_status, name="pipeline-status"),
    path("<int:pk>/cancel/", views_pipelines.cancel, name="pipeline-cancel"),
    path("<int:pk>/rerun/", views_pipelines.rerun, name="pipeline-rerun"),
]
