from django.urls import path

from jobs.metrics import metrics_view

urlpatterns = [path("", metrics_view, name="metrics")]
