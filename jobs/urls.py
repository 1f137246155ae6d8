from django.urls import path

from jobs import views, views_experiments, views_sweeps

urlpatterns = [
    path("", views.job_list, name="job-list"),
    path("new/", views.submit, name="job-submit"),
    path("queue/", views.queue, name="job-queue"),
    path("queue/panel/", views.queue_panel, name="job-queue-panel"),
    path("<int:pk>/move/", views.move, name="job-move"),
    path("<int:pk>/", views.job_detail, name="job-detail"),
    path("<int:pk>/status/", views.job_status, name="job-status"),
    path("<int:pk>/cost/", views.job_cost_card, name="job-cost"),
    path("<int:pk>/cancel/", views.cancel, name="job-cancel"),
    path("<int:pk>/run-again/", views_experiments.run_again, name="job-run-again"),
    path("compare/", views_experiments.compare, name="job-compare"),
    path("sweeps/", views_sweeps.sweep_list, name="sweep-list"),
    path("sweeps/<int:pk>/", views_sweeps.sweep_detail, name="sweep-detail"),
]
